"""The engine under memory pressure, on the tiny random model: a pool far too small for the
traffic, with prompts sharing a prefix, preempting by swap or recompute, with the prefix cache's
host tier on or off, and requests aborted while swapped out, while waiting to be recomputed and
in the middle of a chunked prefill. After every step each block's reference count is the number
of block tables holding it; the survivors' tokens equal an unpressured engine's; at the end every
block is free and the swap space is empty."""

from collections import Counter

import pytest
import torch

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.engine.sequence import SequenceStatus
from tests.helpers import our_model_from_hf, tiny_hf_model

BLOCK = 4
NUM_BLOCKS = 12


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=11, device=device))


def workload() -> list[tuple[list[int], SamplingParams]]:
    gen = torch.Generator().manual_seed(7)
    shared = torch.randint(3, 256, (10,), generator=gen).tolist()
    requests = []
    for i in range(8):
        own = torch.randint(3, 256, (3 + 2 * i,), generator=gen).tolist()
        params = SamplingParams(max_tokens=6 + i, temperature=0.8, seed=i, ignore_eos=True)
        requests.append((shared[: 4 + i] + own, params))
    return requests


def assert_refcounts_match_tables(engine: LLMEngine) -> None:
    manager = engine.block_manager
    manager.check_invariants()
    if engine.host_tier is not None:
        engine.host_tier.check_invariants()
    held = Counter(b for seq in engine._sequences.values() for b in seq.block_ids)
    for block_id in range(manager.num_blocks):
        assert manager.ref_count(block_id) == held[block_id], block_id


def pressure_kind(seq) -> str | None:
    if seq.status == SequenceStatus.SWAPPED:
        return "swapped"
    if seq.status == SequenceStatus.WAITING and seq.num_preemptions:
        return "to recompute"
    if seq.status == SequenceStatus.RUNNING and 0 < seq.num_computed_tokens < seq.num_prompt_tokens:
        return "mid-prefill"
    return None


@pytest.mark.parametrize("mode", ["swap", "recompute"])
@pytest.mark.parametrize("host_cache_bytes", [0, 1 << 20])
def test_aborts_under_pressure_leak_nothing_and_change_no_survivors_token(
    model, mode, host_cache_bytes
):
    requests = workload()
    roomy = LLMEngine(model, EngineConfig(num_blocks=64, enable_prefix_caching=False))
    expected = [r.token_ids for r in roomy.generate(*zip(*requests, strict=True))]
    config = EngineConfig(
        block_size=BLOCK, num_blocks=NUM_BLOCKS, max_num_batched_tokens=8, max_num_seqs=8,
        swap_bytes=1 << 20, preemption_mode=mode, host_cache_bytes=host_cache_bytes,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    for i, (prompt, params) in enumerate(requests):
        engine.add_request(prompt, params, request_id=str(i))
    tokens: dict[str, list[int]] = {}
    aborted: dict[str, str] = {}  # request id -> what it was doing
    while engine.has_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        for request_id, seq in list(engine._sequences.items()):
            kind = pressure_kind(seq)
            if kind is not None and kind not in aborted.values():  # one of each kind
                assert engine.abort(request_id)
                aborted[request_id] = kind
        assert_refcounts_match_tables(engine)
    assert engine.scheduler.num_preemptions_by_mode[mode] > 0
    preempted = "swapped" if mode == "swap" else "to recompute"
    assert {"mid-prefill", preempted} <= set(aborted.values()), aborted
    for i, want in enumerate(expected):
        if str(i) not in aborted:
            assert tokens[str(i)] == want, i
    assert engine.block_manager.num_free_blocks == NUM_BLOCKS
    assert len(engine.swap_space) == 0
    assert engine.swap_space.used_bytes == engine.swap_space.reserved_bytes == 0
