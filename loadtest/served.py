"""A served cluster for a benchmark: `tandem up` as a child process on a free local port.

Started with the same Python as the caller, from the repository root; ready when `/ready` answers
200; stopped with SIGTERM (then SIGKILL after a grace period), which `tandem up` passes on to its
own children. Its output goes to a log file whose tail is quoted if it fails to start.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
LOG_TAIL_CHARS = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class ServedCluster:
    url: str
    process: subprocess.Popen
    log_path: Path
    startup_s: float = 0.0

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-LOG_TAIL_CHARS:]


def wait_ready(cluster: ServedCluster, timeout_s: float) -> None:
    start = time.monotonic()
    with httpx.Client(trust_env=False, timeout=2.0) as client:
        while time.monotonic() - start < timeout_s:
            if cluster.process.poll() is not None:
                raise RuntimeError(f"tandem up exited during start-up:\n{cluster.log_tail()}")
            try:
                if client.get(cluster.url + "/ready").status_code == 200:
                    cluster.startup_s = time.monotonic() - start
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise TimeoutError(f"tandem up was not ready within {timeout_s:.0f} s:\n{cluster.log_tail()}")


def stop(cluster: ServedCluster, grace_s: float = 30.0) -> None:
    if cluster.process.poll() is None:
        cluster.process.send_signal(signal.SIGTERM)
    try:
        cluster.process.wait(grace_s)
    except subprocess.TimeoutExpired:
        cluster.process.kill()
        cluster.process.wait()


@contextmanager
def tandem_up(
    num_prefill: int = 1,
    num_decode: int = 1,
    extra_args: Sequence[str] = (),
    ready_timeout_s: float = 300.0,
    log_path: Path | None = None,
) -> Iterator[ServedCluster]:
    port = free_port()
    if log_path is None:
        log_path = Path(tempfile.mkstemp(prefix="tandem-up-", suffix=".log")[1])
    command = [
        sys.executable,
        "-m",
        "services.commands.cli",
        "up",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        str(num_prefill),
        "--decode",
        str(num_decode),
        *extra_args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT)
    cluster = ServedCluster(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_ready(cluster, ready_timeout_s)
        yield cluster
    finally:
        stop(cluster)


@contextmanager
def environment(settings: Mapping[str, str]) -> Iterator[None]:
    """`TANDEM_*` settings for the cluster's children, restored afterwards."""
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
