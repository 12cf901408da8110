"""Readiness and shutdown of clusters other than the shared one."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from loadtest.served import free_port

pytestmark = pytest.mark.slow


def test_gateway_without_workers_is_not_ready_and_answers_503(tmp_path):
    scheduler_address = f"ipc://{tmp_path}/s.sock"
    port = free_port()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.commands.cli",
                "scheduler",
                "--address",
                scheduler_address,
            ]
        ),
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.commands.cli",
                "gateway",
                "--port",
                str(port),
                "--scheduler-address",
                scheduler_address,
                "--stream-address",
                f"ipc://{tmp_path}/g.sock",
            ]
        ),
    ]
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                response = httpx.get(url + "/health", timeout=2)
                if response.status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        time.sleep(1.5)  # a cluster status has arrived by now
        assert httpx.get(url + "/ready", timeout=5).status_code == 503
        response = httpx.post(
            url + "/v1/completions", json={"model": "smollm2", "prompt": "hi"}, timeout=30
        )
        assert response.status_code == 503
        assert response.json()["error"]["type"] == "service_unavailable"
        assert "retry-after" in response.headers
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=20)


def test_tandem_up_stops_cleanly_on_sigterm(tmp_path):
    from tests.e2e.conftest import start_cluster

    cluster = start_cluster(tmp_path, "--kv-cache-bytes", str(64 << 20))
    children = subprocess.run(
        ["pgrep", "-P", str(cluster.process.pid)], capture_output=True, text=True
    )
    child_pids = [int(p) for p in children.stdout.split()]
    assert len(child_pids) == 5  # scheduler, prefill, decode, gateway, batch service
    # The spawn blocks the stopping signals around its fork, and a mask outlives exec: every
    # child ignored SIGTERM and was killed when the stop's 10 s of grace ran out.
    assert not [pid for pid in child_pids if blocked_signals(pid) & {signal.SIGTERM, signal.SIGINT}]
    stopping = time.monotonic()
    cluster.process.send_signal(signal.SIGTERM)
    assert cluster.process.wait(timeout=30) == 0
    assert time.monotonic() - stopping < 8  # each child stopped itself, within the grace
    for pid in child_pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    run_dirs = set(re.findall(r"ipc://(/[^\s\"']*?/tandem-[^/\s\"']+)/", cluster.log()))
    assert run_dirs, "the log names the cluster's ipc run directory"
    assert not any(os.path.exists(d) for d in run_dirs)


def blocked_signals(pid: int) -> set[signal.Signals]:
    """The signals process `pid` blocks (its main thread's mask, /proc's SigBlk)."""
    status = Path(f"/proc/{pid}/status").read_text()
    mask = int(re.search(r"^SigBlk:\s*([0-9a-f]+)$", status, re.MULTILINE).group(1), 16)
    return {signal.Signals(n) for n in range(1, 32) if mask >> (n - 1) & 1}


def test_a_signal_before_the_cluster_is_ready_stops_it_at_once(tmp_path):
    """SIGTERM (or Ctrl-C) while the workers still load: the start-up ran on until the cluster
    was ready (up to --ready-timeout), then stopped; under docker's SIGTERM then SIGKILL it
    left its children and run directory behind."""
    log = (tmp_path / "up.log").open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "up", "--port", str(free_port())],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        deadline = time.monotonic() + 60
        children: list[int] = []
        while not children and time.monotonic() < deadline:  # the first child is spawned
            found = subprocess.run(
                ["pgrep", "-P", str(process.pid)], capture_output=True, text=True
            )
            children = [int(p) for p in found.stdout.split()]
            time.sleep(0.05)
        assert children, "tandem up spawned no process"
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=30) == 1  # (it waited for the cluster to be ready first)
        text = (tmp_path / "up.log").read_text()
        assert "SIGTERM before the cluster was ready" in text and "is ready at" not in text
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(pid, 0)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
