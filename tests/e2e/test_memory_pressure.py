"""A decode worker whose KV pool cannot hold its sequences: it preempts by swap and by recompute,
and every client still gets the greedy tokens of a run without pressure, and no block leaks.

The pool holds 16 blocks of 16 tokens, a long request grows to 13 blocks (160 + 48 tokens) and a
short one to 4 (16 + 48), so a long and a short one cannot both finish resident: the newest is
preempted. The swap space holds 5 blocks: a short victim fits (swap), a long one never does
(recompute). Phase one starts the long request first, so the short one is newest and swapped;
phase two starts the short one first, so the long one is newest and recomputed: handed back by
the decode worker and prefilled again on the prefill worker, from the prompt and its tokens.

Phase two's short request asks for 96 tokens, so whenever the long one joins the batch (its
prefill runs while the short one decodes, and a loaded machine makes it late) the two outgrow
the pool before the short one ends; with 48 the long one had to arrive within 15 decode steps.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.kv_cache import bytes_per_block
from shared.engine.sampling_params import SamplingParams
from tests.e2e.conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
LONG_ANSWER = {"short2": 96}  # max_tokens where not MAX_TOKENS
NUM_BLOCKS = 16
SWAP_BLOCKS = 5
SENTENCE = "The river carried small boats past the old mill every morning. "


@pytest.fixture(scope="module")
def prompts(smollm2) -> dict[str, list[int]]:
    ids = smollm2.tokenizer(SENTENCE * 16)["input_ids"]
    return {"long1": ids[:160], "short1": ids[5:21], "long2": ids[20:180], "short2": ids[40:56]}


@pytest.fixture(scope="module")
def tight_cluster(tmp_path_factory, smollm2):
    block_bytes = bytes_per_block(smollm2.model.config, 16, smollm2.model.dtype)
    cluster = start_cluster(
        tmp_path_factory.mktemp("tight"),
        "--kv-cache-bytes",
        str(NUM_BLOCKS * block_bytes),
        env={"TANDEM_SWAP_BYTES": str(SWAP_BLOCKS * block_bytes)},
    )
    yield cluster
    stop_cluster(cluster)


def max_tokens(name: str) -> int:
    return LONG_ANSWER.get(name, MAX_TOKENS)


def body(prompt: list[int], max_tokens: int, stream: bool) -> dict:
    return {"model": "smollm2", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": stream}  # fmt: skip


def complete(url: str, prompt: list[int], max_tokens: int) -> str:
    request = body(prompt, max_tokens, False)
    response = httpx.post(url + "/v1/completions", json=request, timeout=600)
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == max_tokens
    return response.json()["choices"][0]["text"]


def complete_streaming(
    url: str, prompt: list[int], max_tokens: int, started: threading.Event
) -> str:
    """The text of a streamed completion; `started` is set at its first token."""
    text = []
    request = body(prompt, max_tokens, True)
    with httpx.stream("POST", url + "/v1/completions", json=request, timeout=600) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                started.set()
                text.append(json.loads(line[6:])["choices"][0]["text"])
    return "".join(text)


def run_pair(url: str, prompts: dict, first: str, second: str) -> dict[str, str]:
    """Both completions' texts; the second is sent once the first streams its first token, so
    the first is resident on the decode worker before the second arrives."""
    with ThreadPoolExecutor(1) as pool:
        started = threading.Event()
        earlier = pool.submit(complete_streaming, url, prompts[first], max_tokens(first), started)
        assert started.wait(120)
        later_text = complete(url, prompts[second], max_tokens(second))
        return {first: earlier.result(), second: later_text}


def test_preempted_requests_complete_token_identical_and_the_pool_refills(
    tight_cluster, smollm2, prompts
):
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64))
    params = [
        SamplingParams(max_tokens=max_tokens(name), temperature=0.0, ignore_eos=True)
        for name in prompts
    ]
    results = engine.generate(list(prompts.values()), params)
    expected = {
        name: smollm2.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        for name, result in zip(prompts, results, strict=True)
    }
    url = tight_cluster.url
    got = run_pair(url, prompts, "long1", "short1")  # the short one is newest: swapped
    after_phase_one = tight_cluster.wait_blocks_free()
    got.update(run_pair(url, prompts, "short2", "long2"))  # the long one is newest: recomputed
    assert got == expected
    info = tight_cluster.wait_blocks_free()
    assert info["decode_free_blocks"] == info["decode_total_blocks"] == NUM_BLOCKS
    assert after_phase_one["preemptions"]["swap"] > 0, after_phase_one["preemptions"]
    assert info["preemptions"]["recompute"] > 0, info["preemptions"]
    # Recompute is not done on the decode worker: the sequence goes back to a prefill worker
    # with its prompt and the tokens its client has.
    log = tight_cluster.log()
    assert "handed back for recompute" in log and "preempted on decode-0 for recompute" in log
