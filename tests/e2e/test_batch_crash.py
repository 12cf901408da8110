"""Crash safety of batch jobs: kill -9 of the batch service and of a decode worker in the middle
of a job. `tandem up` starts both again; the batch service resumes the job from SQLite and its
files, the gateway resumes the requests the worker held. The output must hold every custom_id
exactly once, with the greedy answers of the same job run without kills."""

from __future__ import annotations

import io
import json
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e.conftest import start_cluster, stop_cluster

NUM_LINES = 120


@pytest.fixture(scope="module")
def crash_cluster(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch-crash")
    running = start_cluster(
        root,
        "--batch-dir",
        str(root / "batch"),
        num_decode=2,
        env={
            "TANDEM_MAX_IN_FLIGHT": "32",
            # A line whose call is lost (its gateway or worker gone) is sent again this soon.
            "TANDEM_LINE_TIMEOUT_S": "120",
        },
    )
    yield running
    stop_cluster(running)


def child_pid(parent: int, needle: str) -> int:
    """The pid of the child of `parent` whose command line contains `needle`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and needle in cmdline:
            return int(entry.name)
    raise LookupError(f"no child of {parent} runs {needle!r}")


def job(api: openai.OpenAI) -> str:
    lines = [
        {
            "custom_id": f"k{i}",
            "method": "POST",
            "url": "/v1/completions",
            "body": {
                "model": "smollm2",
                "prompt": f"{i} plus {i} is",
                "max_tokens": 4,
                "temperature": 0,
            },
        }  # fmt: skip
        for i in range(NUM_LINES)
    ]
    text = "\n".join(json.dumps(x) for x in lines).encode()
    file_id = api.files.create(file=("k.jsonl", io.BytesIO(text)), purpose="batch").id
    return api.batches.create(
        input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
    ).id


def retrieve(api: openai.OpenAI, batch_id: str):
    """The batch, waiting out the moments its service is restarting (503)."""
    for _ in range(120):
        try:
            return api.batches.retrieve(batch_id)
        except (openai.APIStatusError, openai.APIConnectionError):
            time.sleep(0.5)
    raise TimeoutError("the batch service did not come back")


def wait_for(api: openai.OpenAI, batch_id: str, done: int, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        batch = retrieve(api, batch_id)
        if batch.request_counts.completed >= done or batch.status == "completed":
            return batch
        time.sleep(0.2)
    raise TimeoutError(f"{batch_id}: {batch.request_counts}")


@pytest.fixture
def log_on_failure(crash_cluster):
    """The cluster's warnings, shown by pytest when the test fails."""
    yield
    lines = crash_cluster.log().splitlines()
    notable = [x for x in lines if any(w in x for w in ("warning", "error", "exited", "resum"))]
    print("\n".join(notable[-80:]))


def answers(api: openai.OpenAI, batch) -> list[tuple[str, str]]:
    lines = [json.loads(x) for x in api.files.content(batch.output_file_id).text.splitlines()]
    return [(x["custom_id"], x["response"]["body"]["choices"][0]["text"]) for x in lines]


def test_kill_9_of_the_batch_service_and_a_decode_worker_loses_and_repeats_nothing(
    crash_cluster, log_on_failure
):
    api = openai.OpenAI(base_url=crash_cluster.url + "/v1", api_key="x", max_retries=0)
    reference_id = job(api)
    reference = wait_for(api, reference_id, NUM_LINES)
    assert reference.status == "completed"
    expected = dict(answers(api, reference))
    assert len(expected) == NUM_LINES

    batch_id = job(api)
    up = crash_cluster.process.pid
    wait_for(api, batch_id, NUM_LINES // 4)
    os.kill(child_pid(up, "batch-service"), signal.SIGKILL)
    wait_for(api, batch_id, NUM_LINES // 2)  # resumed by the restarted service
    os.kill(child_pid(up, "decode-0"), signal.SIGKILL)
    batch = wait_for(api, batch_id, NUM_LINES)
    deadline = time.monotonic() + 30
    while batch.status != "completed" and time.monotonic() < deadline:
        time.sleep(0.3)
        batch = retrieve(api, batch_id)
    assert batch.status == "completed", batch
    got = answers(api, batch)
    custom_ids = [custom_id for custom_id, _ in got]
    assert len(custom_ids) == len(set(custom_ids)) == NUM_LINES  # none lost, none twice
    assert dict(got) == expected  # greedy answers as without kills
    assert batch.request_counts.completed == NUM_LINES and batch.error_file_id is None
    assert "resuming batch" in crash_cluster.log()
