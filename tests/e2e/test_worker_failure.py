"""Workers killed with SIGKILL under load, on the guarded cluster (two prefill and two decode
workers, a 2 s heartbeat timeout): no request is lost, and every greedy stream equals its
reference token for token, across the move to another worker, constrained (JSON schema) streams
included, whose grammar state resumes on the new worker. `tandem up` starts the killed worker
again, and it serves."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path

import httpx
import jsonschema
import pytest

from shared.engine.constraint import schema_constraint
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.e2e.conftest import ALPHA_KEY

pytestmark = pytest.mark.slow
SUBJECTS = [
    "The history of the printing press",
    "A recipe for bread:",
    "def fibonacci(n):",
    "The three laws of motion are",
    "Once upon a time in a small village",
    "Dear hiring manager,",
]
# Two dozen concurrent streams: each subject in four framings.
PROMPTS = [
    f"{frame}{subject}" for frame in ("", "Note: ", "Draft 2. ", "> ") for subject in SUBJECTS
]
SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 24},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 2},
    },
    "required": ["title", "tags"],
    "additionalProperties": False,
}


def worker_pid(parent: int, peer_id: str) -> int:
    """The child of `tandem up` (process `parent`) whose argv has `--peer-id <peer_id>`."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and peer_id.encode() in argv:
            return int(entry.name)
    raise LookupError(f"no child of {parent} is {peer_id}")


def references(smollm2, max_tokens: int, constrained: bool = False) -> dict[str, str]:
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=256), tokenizer=smollm2.tokenizer)
    constraint = schema_constraint(SCHEMA, "structured_outputs.json") if constrained else None
    params = SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, constraint=constraint
    )
    prompts = [smollm2.tokenizer(p).input_ids for p in PROMPTS]
    outputs = engine.generate(prompts, params)
    return {
        p: smollm2.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        for p, o in zip(PROMPTS, outputs, strict=True)
    }


async def stream_text(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, seen: list, constrained: bool
) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    if constrained:
        body["structured_outputs"] = {"json": SCHEMA}
    pieces = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces.append(event["choices"][0]["text"])
            seen.append(time.monotonic())
    return "".join(pieces)


async def run_and_signal(
    cluster,
    max_tokens: int,
    victim: str,
    after_chunks: int,
    signum: int = signal.SIGKILL,
    constrained: bool = False,
) -> dict:
    seen: list[float] = []
    headers = {"Authorization": f"Bearer {ALPHA_KEY}"}
    async with httpx.AsyncClient(
        base_url=cluster.url, timeout=180, trust_env=False, headers=headers
    ) as client:
        tasks = {
            p: asyncio.create_task(stream_text(client, p, max_tokens, seen, constrained))
            for p in PROMPTS
        }
        while len(seen) < after_chunks:
            await asyncio.sleep(0.05)
            assert not any(t.done() for t in tasks.values()), "finished before the kill"
        os.kill(worker_pid(cluster.process.pid, victim), signum)
        return {p: await t for p, t in tasks.items()}


def resumed_count(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("tandem:requests_resumed_total")
    )


@pytest.mark.parametrize(
    "victim,after_chunks,signum",
    [
        ("decode-0", 3 * len(PROMPTS), signal.SIGKILL),
        ("prefill-0", 1, signal.SIGKILL),
        ("scheduler", 1, signal.SIGKILL),
        # Stopped (a scale-down): it says GOODBYE, and its requests move at once.
        ("decode-0", 3 * len(PROMPTS), signal.SIGTERM),
    ],
)
def test_a_killed_worker_loses_no_request_and_changes_no_token(
    guarded_cluster, smollm2, victim, after_chunks, signum
):
    max_tokens = 40
    expected = references(smollm2, max_tokens)
    resumed_before = resumed_count(guarded_cluster.url)
    texts = asyncio.run(run_and_signal(guarded_cluster, max_tokens, victim, after_chunks, signum))
    assert texts == expected  # all of them complete, none with a repeated or missing token
    # The victim held some of them (the scheduler: those not yet decoding, which it forgot).
    assert resumed_count(guarded_cluster.url) > resumed_before
    assert f"{victim} exited" in guarded_cluster.log()
    if signum == signal.SIGTERM:  # it left by its GOODBYE, not by a heartbeat timeout
        said = ("worker left rotation", f'"peer_id": "{victim}"', '"said": "goodbye"')
        assert any(all(s in line for s in said) for line in guarded_cluster.log().splitlines())
    # `tandem up` started it again: it registers and the cluster has all four workers.
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)


def test_constrained_streams_stay_valid_across_a_killed_decode_worker(guarded_cluster, smollm2):
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)
    max_tokens = 48
    expected = references(smollm2, max_tokens, constrained=True)
    texts = asyncio.run(
        run_and_signal(guarded_cluster, max_tokens, "decode-1", 3 * len(PROMPTS),
                       constrained=True)
    )  # fmt: skip
    assert texts == expected  # the grammar resumed where the dead worker left it
    complete = [json.loads(text) for text in texts.values() if text.endswith("}")]
    assert len(complete) >= len(PROMPTS) // 2, texts  # most finish inside max_tokens
    for document in complete:
        jsonschema.validate(document, SCHEMA)
    assert "decode-1 exited" in guarded_cluster.log()
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)


def wait_for_workers(cluster, num_prefill: int, num_decode: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        info = cluster.ready_info()
        if info["prefill_workers"] == num_prefill and info["decode_workers"] == num_decode:
            return
        time.sleep(0.5)
    pytest.fail(f"expected {num_prefill} prefill and {num_decode} decode workers: {info}")


def test_a_hung_worker_is_drained_and_rejoins_when_it_resumes(guarded_cluster, smollm2):
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)
    max_tokens = 40
    expected = references(smollm2, max_tokens)
    pid = worker_pid(guarded_cluster.process.pid, "decode-1")
    try:
        texts = asyncio.run(
            run_and_signal(guarded_cluster, max_tokens, "decode-1", 3 * len(PROMPTS),
                           signal.SIGSTOP)
        )  # fmt: skip
        assert texts == expected  # the paused worker's requests moved on without a seam
        wait_for_workers(guarded_cluster, num_prefill=2, num_decode=1, timeout_s=10)
    finally:
        os.kill(pid, signal.SIGCONT)
    # Its next heartbeat finds a scheduler that forgot it: it registers again, and serves.
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2, timeout_s=30)
    assert worker_pid(guarded_cluster.process.pid, "decode-1") == pid  # the same process
