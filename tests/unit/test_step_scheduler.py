"""The engine's step scheduler: water-filled prompt shares, decodes first, preemption order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import MIN_CHUNK, StepScheduler, water_fill
from shared.engine.sequence import Sequence


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(0, 4096))
def test_water_fill_is_max_min_fair(needs, budget):
    shares = water_fill(needs, budget)
    assert all(0 <= s <= n for s, n in zip(shares, needs, strict=True))
    assert sum(shares) == min(budget, sum(needs))  # nothing idles while someone needs more
    for i, share in enumerate(shares):
        if share < needs[i]:  # someone short of its need got at least as much as anyone, less 1
            assert all(share >= other - 1 for other in shares)


def test_water_fill_examples():
    assert water_fill([10, 1000], 512) == [10, 502]
    assert water_fill([1000, 1000, 1000], 512) == [171, 171, 170]
    assert water_fill([], 512) == []


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, [1] * prompt_len, SamplingParams(max_tokens=4))


def run_step(scheduler: StepScheduler) -> dict[str, int]:
    chunks = scheduler.schedule()
    for chunk in chunks:  # what the engine does after the forward
        chunk.sequence.num_computed_tokens += chunk.num_tokens
        if chunk.sequence.num_uncomputed_tokens == 0:
            chunk.sequence.output_token_ids.append(7)
    return {c.sequence.request_id: c.num_tokens for c in chunks}


def make_scheduler(num_blocks: int = 1000, budget: int = 512) -> StepScheduler:
    return StepScheduler(
        BlockManager(num_blocks, 16), max_num_seqs=64, max_num_batched_tokens=budget
    )


def test_a_short_prompt_is_not_stuck_behind_a_long_one_in_progress():
    scheduler = make_scheduler()
    scheduler.add(seq("long", 10_000))
    assert run_step(scheduler) == {"long": 512}
    scheduler.add(seq("short", 30))
    assert run_step(scheduler) == {"long": 482, "short": 30}  # done in one step, beside it
    assert run_step(scheduler) == {"long": 511, "short": 1}  # short decodes; long goes on


def test_many_prompts_share_the_budget_in_chunks_no_smaller_than_the_minimum():
    scheduler = make_scheduler()
    for i in range(100):
        scheduler.add(seq(f"p{i}", 1000))
    step = run_step(scheduler)
    assert len(step) == 512 // MIN_CHUNK and set(step.values()) == {MIN_CHUNK}


def test_preemption_frees_the_newest_and_admits_nobody_that_step():
    scheduler = make_scheduler(num_blocks=4, budget=512)  # 64 token slots
    for name in ("a", "b"):
        scheduler.add(seq(name, 32))
    assert run_step(scheduler) == {"a": 32, "b": 32}
    scheduler.add(seq("c", 8))
    step = run_step(scheduler)  # a needs a fifth block: b (newest) is preempted, c waits
    assert step == {"a": 1} and [s.request_id for s in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 1
