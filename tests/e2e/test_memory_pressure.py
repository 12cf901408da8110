"""A decode worker whose KV pool cannot hold its sequences: it preempts by swap and by recompute,
and every client still gets the greedy tokens of a run without pressure, and no block leaks."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.kv_cache import bytes_per_block
from shared.engine.sampling_params import SamplingParams
from tests.e2e.conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 48
NUM_BLOCKS = 16  # 256 tokens for six sequences of up to ~150: preemption is certain
SENTENCE = "The river carried small boats past the old mill every morning. "


@pytest.fixture(scope="module")
def prompts(smollm2) -> list[list[int]]:
    ids = smollm2.tokenizer(SENTENCE * 12)["input_ids"]
    return [ids[: 60 + 9 * i] for i in range(6)]


@pytest.fixture(scope="module")
def tight_cluster(tmp_path_factory, smollm2):
    block_bytes = bytes_per_block(smollm2.model.config, 16, smollm2.model.dtype)
    cluster = start_cluster(
        tmp_path_factory.mktemp("tight"),
        "--kv-cache-bytes",
        str(NUM_BLOCKS * block_bytes),
        # Host memory for one small victim at a time: larger or later ones must be recomputed.
        env={"TANDEM_SWAP_BYTES": str(7 * block_bytes), "TANDEM_PREEMPTION_MODE": "auto"},
    )
    yield cluster
    stop_cluster(cluster)


def complete(url: str, prompt: list[int]) -> dict:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    response = httpx.post(url + "/v1/completions", json=body, timeout=600)
    assert response.status_code == 200, response.text
    return response.json()


def test_preempted_requests_complete_token_identical_and_the_pool_refills(
    tight_cluster, smollm2, prompts
):
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = engine.generate(prompts, params)
    expected = [smollm2.tokenizer.decode(r.token_ids, skip_special_tokens=True) for r in results]
    with ThreadPoolExecutor(len(prompts)) as pool:
        answers = list(pool.map(lambda p: complete(tight_cluster.url, p), prompts))
    assert [a["usage"]["completion_tokens"] for a in answers] == [MAX_TOKENS] * len(prompts)
    assert [a["choices"][0]["text"] for a in answers] == expected
    info = tight_cluster.wait_blocks_free()
    assert info["decode_free_blocks"] == info["decode_total_blocks"] == NUM_BLOCKS
    preemptions = info["preemptions"]
    assert preemptions["swap"] > 0 and preemptions["recompute"] > 0, preemptions
