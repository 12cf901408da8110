"""Decode-side preemption under review: the order in which preempted sequences come back, and
what a preempted sequence keeps, on hand-made scheduler inputs and on the tiny random model."""

from __future__ import annotations

import pytest

from shared.engine.block_manager import BlockManager
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import StepScheduler
from shared.engine.sequence import Sequence, SequenceStatus
from tests.helpers import our_model_from_hf, tiny_hf_model

PARAMS = SamplingParams(max_tokens=8)


def run_step(scheduler: StepScheduler) -> dict[str, int]:
    """One step as the engine takes it: each chunk computed, a token sampled at its end."""
    chunks = scheduler.schedule().chunks
    for chunk in chunks:
        chunk.sequence.num_computed_tokens += chunk.num_tokens
        if chunk.sequence.num_uncomputed_tokens == 0:
            chunk.sequence.output_token_ids.append(7)
    return {c.sequence.request_id: c.num_tokens for c in chunks}


def swap_bulk_recompute_rest(seq: Sequence, num_blocks: int) -> str:
    """As `auto` may choose: a batch job's long line swapped, a short chat recomputed."""
    return "swap" if seq.bulk else "recompute"


def test_an_interactive_sequence_preempted_for_recompute_resumes_before_a_swapped_bulk_line():
    """A chat preempted for recompute waited behind a batch line swapped out before it: the
    swapped queue came back first whatever its urgency, and no waiting sequence was admitted
    while it was out, so the chat waited for the line's whole generation."""
    scheduler = StepScheduler(BlockManager(6, 16), 8, 512, swap_bulk_recompute_rest)
    old = Sequence("old", [1] * 32, PARAMS, arrival_time=0.0)
    chat = Sequence("chat", [1] * 32, PARAMS, arrival_time=1.0)
    line = Sequence("line", [1] * 32, PARAMS, arrival_time=2.0, bulk=True)
    for seq in (old, chat, line):
        scheduler.add(seq)
    assert run_step(scheduler) == {"old": 32, "chat": 32, "line": 32}  # all six blocks
    scheduler.preempt(line)  # the least urgent first: swapped out
    scheduler.preempt(chat)  # then recomputed
    assert chat.status == SequenceStatus.WAITING and line.status == SequenceStatus.SWAPPED
    # Four blocks free: old's growth block and room for one of the two, the chat's 33 tokens.
    plan = scheduler.schedule()
    assert not plan.swap_in and scheduler.swapped == [line]
    assert {c.sequence.request_id: c.num_tokens for c in plan.chunks} == {"old": 1, "chat": 33}
    scheduler.block_manager.check_invariants()


def test_a_newcomer_still_waits_while_a_sequence_is_swapped_out():
    """Only preempted sequences more urgent than every swapped one go ahead of it: a new
    arrival, however urgent, still waits (else arrivals could keep a swapped one out)."""
    scheduler = StepScheduler(BlockManager(6, 16), 8, 512, swap_bulk_recompute_rest)
    old = Sequence("old", [1] * 32, PARAMS, arrival_time=0.0)
    line = Sequence("line", [1] * 32, PARAMS, arrival_time=2.0, bulk=True)
    for seq in (old, line):
        scheduler.add(seq)
    run_step(scheduler)
    held = scheduler.block_manager.allocate(2)  # a reservation: the line cannot come back
    scheduler.preempt(line)
    scheduler.add(Sequence("new", [1] * 8, PARAMS, arrival_time=3.0, priority=9))
    plan = scheduler.schedule()
    assert not plan.swap_in and scheduler.swapped == [line]
    assert {c.sequence.request_id: c.num_tokens for c in plan.chunks} == {"old": 1}
    scheduler.block_manager.free(held)


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=11, device=device))


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def test_under_pressure_a_swapped_bulk_line_stays_out_while_a_preempted_chat_waits(model):
    """On the tiny model in float32, a pool too small for an old chat, a newer chat and a batch
    line: the line is swapped out, then the newer chat dropped for recompute. The line came back
    while the chat waited (and went straight out again when the old chat grew). Every sequence's
    greedy tokens equal an unpressured engine's."""
    requests = {
        "old": (list(range(10, 22)), greedy(24)),
        "chat": (list(range(30, 38)), greedy(14)),
        "line": (list(range(50, 58)), greedy(20)),
    }
    roomy = LLMEngine(model, EngineConfig(block_size=4, num_blocks=64))
    expected = {rid: roomy.generate([p], q)[0].token_ids for rid, (p, q) in requests.items()}
    config = EngineConfig(
        block_size=4, num_blocks=12, max_num_batched_tokens=32, swap_bytes=1 << 20,
        preemption_mode="swap", enable_prefix_caching=False,
    )  # fmt: skip
    engine = LLMEngine(model, config)
    by_cost = engine._choose_preemption  # as `auto` chooses when the line's context is long
    engine.scheduler.choose_preemption = lambda seq, n: by_cost(seq, n) if seq.bulk else "recompute"
    for rid, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id=rid, bulk=rid == "line")
    chat, line = engine.sequence("chat"), engine.sequence("line")
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished:
        chat_waits = chat.status == SequenceStatus.WAITING and chat.num_preemptions > 0
        line_was_out = line.status == SequenceStatus.SWAPPED
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        if chat_waits and line_was_out:
            assert line.status == SequenceStatus.SWAPPED, "the line resumed before the chat"
    assert engine.scheduler.num_preemptions_by_mode == {"swap": 1, "recompute": 1}
    assert tokens == expected
    assert engine.swap_space.used_bytes == engine.swap_space.reserved_bytes == 0
