"""`tandem top --once` against the shared cluster: one frame, every worker in it."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_top_renders_every_worker_of_a_running_cluster(cluster):
    response = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "smollm2", "prompt": "Watching the cluster:", "max_tokens": 8,
              "user": "top-test", "ignore_eos": True},
        timeout=120,
    )  # fmt: skip
    assert response.status_code == 200
    peers = [worker["peer_id"] for worker in cluster.ready_info()["workers"]]
    assert {"prefill-0", "decode-0", "decode-1"} <= set(peers)

    result = subprocess.run(
        [sys.executable, "-m", "services.commands.cli", "top", "--url", cluster.url, "--once"],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "COLUMNS": "100"},
    )

    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    for peer in peers:
        assert peer in result.stdout, result.stdout
    assert "cluster ready" in result.stdout
    assert "top-test" in result.stdout  # the fair-share table has the request's tenant
    assert "batch jobs" in result.stdout and "answered" not in result.stdout  # read, no error
