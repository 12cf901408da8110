"""One local cluster for all end-to-end tests, started with `tandem up` as real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from loadtest.served import free_port


@dataclass
class RunningCluster:
    url: str
    process: subprocess.Popen
    log_path: Path
    rpc_address: str | None = None  # the gateway's RPC ROUTER, when started with --rpc-port
    curve_keys_dir: Path | None = None  # its CurveZMQ keys, when its sockets use them

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def ready_info(self) -> dict:
        return httpx.get(self.url + "/ready", timeout=5).json()

    def wait_blocks_free(self, timeout_s: float = 20.0) -> dict:
        """Waits until nothing is in flight and every worker is idle with every block free (as
        their heartbeats report). A worker may hear of an abort only after the step it is in
        (up to the prefill step target), so its idleness lags the scheduler's."""
        deadline = time.monotonic() + timeout_s
        info = self.ready_info()
        while time.monotonic() < deadline:
            info = self.ready_info()
            if info["in_flight"] == 0 and all(_idle(w) for w in info["workers"]):
                return info
            time.sleep(0.3)
        return info


def _idle(worker: dict) -> bool:
    busy = worker["running"] or worker["waiting"] or worker["swapped"]
    return not busy and worker["free_blocks"] == worker["total_blocks"]


def start_cluster(
    tmp_path: Path,
    *extra: str,
    timeout_s: float = 300.0,
    rpc: bool = False,
    num_prefill: int = 1,
    num_decode: int = 1,
    env: dict[str, str] | None = None,
) -> RunningCluster:
    """`tandem up` with the given workers, once every one of them has joined."""
    extra = ("--prefill", str(num_prefill), "--decode", str(num_decode), *extra)
    port = free_port()
    rpc_address = None
    if rpc:
        rpc_port = free_port()
        rpc_address = f"tcp://127.0.0.1:{rpc_port}"
        extra = (*extra, "--rpc-port", str(rpc_port))
    log_path = tmp_path / "cluster.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "up", "--port", str(port), *extra],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, TANDEM_LOG_LEVEL="INFO", **(env or {})),
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"tandem up exited:\n{log_path.read_text()[-4000:]}")
        try:
            ready = httpx.get(url + "/ready", timeout=2)
            body = ready.json()
            joined = body["prefill_workers"] >= num_prefill and body["decode_workers"] >= num_decode
            # `tandem up` polls /ready too, and a signal before it has seen the cluster ready
            # stops the start-up (exit 1): its banner is the moment a user may rely on it.
            announced = b"tandem is ready at" in log_path.read_bytes()
            if ready.status_code == 200 and joined and announced:
                return RunningCluster(url, process, log_path, rpc_address)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
        time.sleep(0.5)
    process.kill()
    raise TimeoutError(f"cluster not ready:\n{log_path.read_text()[-4000:]}")


def stop_cluster(cluster: RunningCluster) -> None:
    cluster.process.send_signal(signal.SIGTERM)
    cluster.process.wait(timeout=30)


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> RunningCluster:
    running = start_cluster(
        tmp_path_factory.mktemp("cluster"),
        "--kv-cache-bytes",
        str(256 << 20),
        num_decode=2,
        rpc=True,
        env={"TANDEM_RPC_CLIENT_TIMEOUT_S": "4"},  # (a stopped RPC client is noticed in seconds)
    )
    yield running
    stop_cluster(running)


# The guarded cluster's API keys: one charged to tenant "alpha", one leaving it to `user`.
ALPHA_KEY = "alpha-key-0123456789abcdef"
OPEN_KEY = "open-key-0123456789abcdef"


@pytest.fixture(scope="session")
def guarded_cluster(tmp_path_factory) -> RunningCluster:
    """A second cluster, for tests that kill its processes or need its locks: two prefill and
    two decode workers, a 2 s heartbeat timeout, a small prefill window, API keys required on
    HTTP and RPC, and every ZeroMQ socket under CurveZMQ (an RPC client `agent` has keys)."""
    from shared.curve import generate

    root = tmp_path_factory.mktemp("guarded")
    keys_dir = root / "keys"
    generate(keys_dir, clients=("agent",))
    running = start_cluster(
        root,
        "--kv-cache-bytes",
        str(128 << 20),
        num_prefill=2,
        num_decode=2,
        rpc=True,
        env={
            "TANDEM_HEARTBEAT_TIMEOUT_S": "2",
            # A small window keeps requests in the scheduler's queue, where a restart loses them.
            "TANDEM_PREFILL_WINDOW_TOKENS": "4",
            "TANDEM_API_KEYS": f"{ALPHA_KEY}=alpha,{OPEN_KEY}",
            "TANDEM_CURVE_KEYS_DIR": str(keys_dir),
        },
    )
    running.curve_keys_dir = keys_dir
    yield running
    stop_cluster(running)


@pytest.fixture(scope="session")
def openai_client(cluster):
    from openai import OpenAI

    return OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=300)
