"""The engine's step scheduler: decodes first, prompt shares shortest first above a floor,
preemption order."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager
from shared.engine.prefix_blocks import cache_computed_blocks
from shared.engine.prefix_cache import PrefixCache
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import (
    MIN_CHUNK,
    PROGRESS_FLOOR,
    StepPlan,
    StepScheduler,
    lighten,
    raise_cap_for_short_prompts,
    shortest_first,
)
from shared.engine.sequence import Sequence, SequenceStatus


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(0, 4096))
def test_shortest_first_serves_a_floor_then_the_smallest_needs(needs, budget):
    shares = shortest_first(needs, budget, floor=16)
    assert all(0 <= s <= n for s, n in zip(shares, needs, strict=True))
    assert sum(shares) == min(budget, sum(needs))  # nothing idles while someone needs more
    if budget >= 16 * len(needs):
        assert all(s >= min(n, 16) for s, n in zip(shares, needs, strict=True))
        partial = [i for i, (s, n) in enumerate(zip(shares, needs, strict=True)) if 16 < s < n]
        assert len(partial) <= 1  # filled in need order: done, one partly, the rest at the floor
        for i in partial:
            assert all(shares[j] == needs[j] for j in range(len(needs)) if needs[j] < needs[i])


def test_shortest_first_examples():
    assert shortest_first([10_000, 48], 64, floor=16) == [16, 48]
    assert shortest_first([10, 1000], 512, floor=16) == [10, 502]
    assert shortest_first([1000, 1000, 1000], 40, floor=16) == [16, 16, 8]
    assert shortest_first([], 512) == []


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(1, 5000), max_size=40), st.integers(0, 4096))
def test_lighten_keeps_finishing_shares_and_floors_the_rest(needs, budget):
    shares = shortest_first(needs, budget, floor=16)
    light = lighten(needs, shares, floor=16)
    finishing = [s == n for s, n in zip(shares, needs, strict=True)]
    for share, new, done in zip(shares, light, finishing, strict=True):
        if all(finishing) or not any(finishing) or done:
            assert new == share  # nothing to lighten, or a prompt brought to its first token
        else:
            assert new == min(share, 16)  # still advances, by its floor


def test_lighten_examples():
    assert lighten([10_000, 48], [464, 48], floor=16) == [16, 48]
    assert lighten([10_000, 9_000], [256, 256], floor=16) == [256, 256]  # none finishes
    assert lighten([20, 48], [20, 48], floor=16) == [20, 48]  # all finish


def seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, [1] * prompt_len, SamplingParams(max_tokens=4))


def run_step(scheduler: StepScheduler) -> dict[str, int]:
    chunks = scheduler.schedule().chunks
    for chunk in chunks:  # what the engine does after the forward
        chunk.sequence.num_computed_tokens += chunk.num_tokens
        if chunk.sequence.num_uncomputed_tokens == 0:
            chunk.sequence.output_token_ids.append(7)
    return {c.sequence.request_id: c.num_tokens for c in chunks}


def make_scheduler(num_blocks: int = 1000, budget: int = 512, mode: str = "recompute"):
    return StepScheduler(
        BlockManager(num_blocks, 16),
        max_num_seqs=64,
        max_num_batched_tokens=budget,
        choose_preemption=lambda seq, num_blocks: mode,
    )


def test_a_short_prompt_is_not_stuck_behind_a_long_one_in_progress():
    scheduler = make_scheduler()
    scheduler.add(seq("long", 10_000))
    assert run_step(scheduler) == {"long": 512}
    scheduler.add(seq("short", 30))
    assert run_step(scheduler) == {"long": 482, "short": 30}  # done in one step, beside it
    assert run_step(scheduler) == {"long": 511, "short": 1}  # short decodes; long goes on


def test_a_step_time_cap_bounds_long_chunks_and_lightens_a_first_token_step():
    scheduler = make_scheduler()
    scheduler.prompt_token_cap = 128
    scheduler.add(seq("long", 10_000))
    assert run_step(scheduler) == {"long": 128}  # the cap, not the 512 budget
    scheduler.add(seq("short", 30))
    # The short prompt's first token comes from a light step: the long one keeps its floor.
    assert run_step(scheduler) == {"long": PROGRESS_FLOOR, "short": 30}
    assert run_step(scheduler) == {"long": 128, "short": 1}  # capped chunks again
    scheduler.prompt_token_cap = None
    assert run_step(scheduler) == {"long": 511, "short": 1}


def test_the_cap_is_raised_to_finish_short_prompts_never_for_long_ones():
    assert raise_cap_for_short_prompts([10_000], cap=128, budget=512, floor=16) == 128
    assert raise_cap_for_short_prompts([10_000, 120], cap=128, budget=512, floor=16) == 136
    assert raise_cap_for_short_prompts([100, 90, 80], cap=128, budget=512, floor=16) == 270
    assert raise_cap_for_short_prompts([100] * 8, cap=128, budget=512, floor=16) == 512  # bound
    assert raise_cap_for_short_prompts([129, 20], cap=128, budget=512, floor=16) == 128


def test_a_short_prompt_beside_long_ones_finishes_in_one_capped_step():
    scheduler = make_scheduler()
    scheduler.prompt_token_cap = 128
    scheduler.add(seq("long", 10_000))
    assert run_step(scheduler) == {"long": 128}
    scheduler.add(seq("short", 120))
    # Within the bare cap it would take 112 tokens now and 8 in the next step.
    assert run_step(scheduler) == {"long": PROGRESS_FLOOR, "short": 120}
    assert run_step(scheduler) == {"long": 128, "short": 1}


def test_many_prompts_share_the_budget_in_chunks_no_smaller_than_the_minimum():
    scheduler = make_scheduler()
    for i in range(100):
        scheduler.add(seq(f"p{i}", 1000))
    step = run_step(scheduler)
    assert len(step) == 512 // MIN_CHUNK and sum(step.values()) == 512
    assert min(step.values()) >= PROGRESS_FLOOR


def test_preemption_frees_the_newest_and_admits_nobody_that_step():
    scheduler = make_scheduler(num_blocks=4, budget=512)  # 64 token slots
    for name in ("a", "b"):
        scheduler.add(seq(name, 32))
    assert run_step(scheduler) == {"a": 32, "b": 32}
    scheduler.add(seq("c", 8))
    step = run_step(scheduler)  # a needs a fifth block: b (newest) is preempted, c waits
    assert step == {"a": 1} and [s.request_id for s in scheduler.waiting] == ["b", "c"]
    assert scheduler.num_preemptions == 1


def test_a_newcomer_shares_even_a_budget_smaller_than_two_chunks():
    scheduler = make_scheduler(budget=MIN_CHUNK)
    scheduler.add(seq("long", 10_000))
    assert run_step(scheduler) == {"long": MIN_CHUNK}
    scheduler.add(seq("short", 48))
    assert run_step(scheduler) == {"long": MIN_CHUNK - 48, "short": 48}


def test_a_swapped_sequence_keeps_its_progress_and_comes_back_first():
    scheduler = make_scheduler(num_blocks=4, budget=512, mode="swap")  # 64 token slots
    for name in ("a", "b"):
        scheduler.add(seq(name, 32))
    run_step(scheduler)
    b = scheduler.running[1]
    scheduler.add(seq("c", 8))
    plan = scheduler.schedule()  # a needs a fifth block: b is swapped out, c waits
    assert [(s.request_id, blocks) for s, blocks in plan.swap_out] == [("b", [2, 3])]
    assert b.status.name == "SWAPPED" and b.num_computed_tokens == 32 and not b.block_ids
    assert [c.sequence.request_id for c in plan.chunks] == ["a"]
    assert scheduler.num_preemptions_by_mode == {"swap": 1, "recompute": 0}
    plan.chunks[0].sequence.num_computed_tokens += 1
    scheduler.finish(scheduler.running[0], SequenceStatus.FINISHED_LENGTH)  # a leaves
    plan = scheduler.schedule()
    assert [(s.request_id, len(blocks)) for s, blocks in plan.swap_in] == [("b", 2)]
    # b resumes where it was (one decode token), and only then is c admitted
    assert [(c.sequence.request_id, c.num_tokens) for c in plan.chunks] == [("b", 1), ("c", 8)]


def test_a_finished_swapped_sequence_leaves_the_swap_queue():
    scheduler = make_scheduler(num_blocks=4, mode="swap")
    for name in ("a", "b"):
        scheduler.add(seq(name, 32))
    run_step(scheduler)
    scheduler.schedule()
    (b,) = scheduler.swapped
    scheduler.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert not scheduler.swapped and b.status == SequenceStatus.FINISHED_ABORTED


def test_the_victim_is_the_lowest_priority_then_the_latest_arrival():
    scheduler = make_scheduler(num_blocks=3, budget=512, mode="swap")  # one block each
    urgent = Sequence("urgent", [1] * 16, SamplingParams(max_tokens=4), priority=5)
    for item in (seq("old", 16), urgent, seq("new", 16)):
        scheduler.add(item)
    assert run_step(scheduler) == {"old": 16, "urgent": 16, "new": 16}
    plan = scheduler.schedule()  # each needs a second block: only one can have it
    # By arrival alone "urgent" would go before "old"; its priority keeps it running.
    assert [s.request_id for s, _ in plan.swap_out] == ["new", "old"]
    assert [c.sequence.request_id for c in plan.chunks] == ["urgent"]


def bulk_seq(name: str, prompt_len: int) -> Sequence:
    return Sequence(name, [1] * prompt_len, SamplingParams(max_tokens=4), bulk=True)


def test_an_interactive_prompt_goes_ahead_of_queued_bulk_lines_but_not_of_preempted_ones():
    scheduler = make_scheduler(num_blocks=4, budget=512)  # 64 token slots
    for name in ("a", "b"):
        scheduler.add(seq(name, 32))
    run_step(scheduler)
    scheduler.add(bulk_seq("bulk1", 8))
    run_step(scheduler)  # a needs a fifth block: b is preempted, back at the head
    scheduler.add(bulk_seq("bulk2", 8))
    scheduler.add(seq("chat", 8))
    assert [s.request_id for s in scheduler.waiting] == ["b", "chat", "bulk1", "bulk2"]
    scheduler.add(seq("chat2", 8))  # interactive among themselves: in arrival order
    assert [s.request_id for s in scheduler.waiting] == ["b", "chat", "chat2", "bulk1", "bulk2"]


def test_with_one_seat_per_step_an_interactive_prompt_runs_before_earlier_bulk_lines():
    scheduler = make_scheduler(budget=MIN_CHUNK)  # one newcomer a step
    for i in range(3):
        scheduler.add(bulk_seq(f"bulk{i}", 24))
    assert run_step(scheduler) == {"bulk0": 24}
    scheduler.add(seq("chat", 24))
    assert "chat" in run_step(scheduler)


def test_a_bulk_line_is_preempted_before_any_interactive_sequence():
    scheduler = make_scheduler(num_blocks=3, budget=512, mode="swap")  # one block each
    urgent_bulk = Sequence("bulk", [1] * 16, SamplingParams(max_tokens=4), priority=5, bulk=True)
    for item in (urgent_bulk, seq("old", 16), seq("new", 16)):
        scheduler.add(item)
    assert run_step(scheduler) == {"bulk": 16, "old": 16, "new": 16}
    plan = scheduler.schedule()  # each needs a second block: only one can have it
    # Its priority and arrival would keep the bulk line; its class makes it the first victim.
    assert [s.request_id for s, _ in plan.swap_out] == ["bulk", "new"]
    assert [c.sequence.request_id for c in plan.chunks] == ["old"]


def test_bulk_prompts_never_raise_the_cap_and_take_the_budget_after_interactive_ones():
    cap = dict(cap=128, budget=512, floor=16)
    assert raise_cap_for_short_prompts([100, 90, 80], **cap, bulk=[True] * 3) == 128
    assert raise_cap_for_short_prompts([120, 90], **cap, bulk=[False, True]) == 136
    # Interactive prompts first, their floors and the rest; bulk ones from what they leave,
    # whatever the sizes (a bulk line's floor beside an agent's long prompt slowed it).
    assert shortest_first([100, 20], 64, floor=16, bulk=[False, True]) == [64, 0]
    assert shortest_first([40, 20, 30], 64, floor=16, bulk=[False, True, True]) == [40, 16, 8]
    assert shortest_first([100, 20], 64, floor=16) == [44, 20]


def test_an_interactive_first_token_step_leaves_out_bulk_prompts_even_finishing_ones():
    assert lighten([30, 20, 500], [30, 20, 200], floor=16, bulk=[False, True, True]) == [30, 0, 0]
    assert lighten([30, 900], [30, 200], floor=16, bulk=[False, False]) == [30, 16]
    # With no interactive prompt finishing, bulk prompts are lightened as any others.
    assert lighten([30, 20, 500], [30, 20, 200], floor=16, bulk=[True, True, False]) == [30, 20, 16]
    assert lighten([20, 40], [20, 40], floor=16, bulk=[True, True]) == [20, 40]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 2000), st.booleans()), max_size=30), st.integers(64, 2048))
def test_a_step_of_bulk_prompts_stays_within_the_cap(prompts, cap):
    needs = [need for need, _ in prompts]
    bulk = [b for _, b in prompts]
    budget = raise_cap_for_short_prompts(needs, cap, 4096, floor=16, bulk=bulk)
    shares = lighten(needs, shortest_first(needs, budget, floor=16, bulk=bulk), 16, bulk)
    interactive = sum(s for s, b in zip(shares, bulk, strict=True) if not b)
    bulk_tokens = sum(s for s, b in zip(shares, bulk, strict=True) if b)
    # Bulk work in a step is bounded by the cap or by its floors, whatever interactive takes,
    # and is none at all in a step that brings an interactive prompt to its first token.
    assert bulk_tokens <= max(cap - min(interactive, cap), 16 * bulk.count(True))
    if any(s == n and not b for s, n, b in zip(shares, needs, bulk, strict=True)):
        assert bulk_tokens == 0
    assert all(0 <= s <= n for s, n in zip(shares, needs, strict=True))


def test_an_interactive_prompt_arriving_among_bulk_lines_finishes_in_a_light_step():
    scheduler = make_scheduler()
    scheduler.prompt_token_cap = 64
    for i in range(8):
        scheduler.add(bulk_seq(f"bulk{i}", 30))
    first = run_step(scheduler)
    assert sum(first.values()) <= 64  # the bulk lines do not raise the cap
    scheduler.add(seq("chat", 40))
    step = run_step(scheduler)
    assert step["chat"] == 40
    assert all(n == 1 for name, n in step.items() if name != "chat")  # decodes only
    assert sum(run_step(scheduler).values()) > 1  # then the bulk prompts go on


def test_a_started_bulk_line_waits_while_an_interactive_prompt_takes_the_capped_step():
    """A batch line part-way through its prompt gets nothing while an agent's long prompt
    fills the capped steps (it had its floor, a quarter of a 64-token cap), and goes on after."""
    scheduler = make_scheduler()
    scheduler.prompt_token_cap = 64
    scheduler.add(bulk_seq("line", 1000))
    assert run_step(scheduler) == {"line": 64}
    scheduler.add(seq("agent", 1000))
    for _ in range(3):
        assert run_step(scheduler) == {"agent": 64}


def cached_scheduler(num_blocks: int, block_size: int = 2, mode: str = "recompute"):
    return StepScheduler(
        BlockManager(num_blocks, block_size, PrefixCache()),
        max_num_seqs=64,
        max_num_batched_tokens=512,
        choose_preemption=lambda seq, num_blocks: mode,
    )


def cached_seq(name: str, token_ids: list[int]) -> Sequence:
    sequence = Sequence(name, token_ids, SamplingParams(max_tokens=8))
    sequence.cache_root = 1
    return sequence


def test_a_newcomers_cached_prefix_never_costs_a_running_sequence_its_blocks():
    """A newcomer's cached blocks are pinned before the running sequences grow: when the pool
    cannot hold both, the newcomer gives its pins back; it does not preempt, nor stall the
    worker (it did both: the pins made the running sequence's growth look impossible)."""
    scheduler = cached_scheduler(num_blocks=4)
    warm = cached_seq("warm", [1, 2, 3, 4])
    scheduler.add(warm)
    run_step(scheduler)
    cache_computed_blocks(warm, scheduler.block_manager)  # as the engine does after a step
    scheduler.finish(warm, SequenceStatus.FINISHED_STOPPED)  # [1,2] and [3,4] stay cached
    running = cached_seq("r", [9, 9, 9, 9])
    running.cache_root = None
    scheduler.add(running)
    run_step(scheduler)  # r: two blocks, four tokens computed, a fifth token to decode
    scheduler.add(cached_seq("n", [1, 2, 3, 4, 5]))  # its first two blocks are cached
    plan = scheduler.schedule()
    assert [(c.sequence.request_id, c.num_tokens) for c in plan.chunks] == [("r", 1)]
    assert scheduler.num_preemptions == 0
    scheduler.block_manager.check_invariants()
    steps = [run_step(scheduler) for _ in range(3)]
    assert all(steps), steps  # every step computes something


def test_a_later_newcomers_pins_do_not_keep_the_head_newcomer_out():
    scheduler = cached_scheduler(num_blocks=3)
    warm = cached_seq("warm", [1, 2, 3, 4])
    scheduler.add(warm)
    run_step(scheduler)
    cache_computed_blocks(warm, scheduler.block_manager)  # as the engine does after a step
    scheduler.finish(warm, SequenceStatus.FINISHED_STOPPED)  # two cached blocks of three
    head = cached_seq("head", [7, 7, 7, 7, 7])  # nothing cached: needs all three blocks
    scheduler.add(head)
    scheduler.add(cached_seq("later", [1, 2, 3, 4, 5]))
    assert run_step(scheduler) == {"head": 5}
    scheduler.block_manager.check_invariants()


def test_a_swapped_sequence_comes_back_with_room_for_its_next_token():
    scheduler = make_scheduler(num_blocks=3, mode="swap")
    a = seq("a", 32)
    scheduler.add(a)
    run_step(scheduler)  # two full blocks: its next token needs a third
    held = scheduler.block_manager.allocate(1)  # another holder (a reservation)
    scheduler.schedule()
    assert scheduler.swapped == [a]
    for _ in range(3):  # only two blocks free: it must not come back to go straight out
        plan = scheduler.schedule()
        assert not plan.swap_in and not plan.swap_out
    scheduler.block_manager.free(held)
    plan = scheduler.schedule()
    assert [s.request_id for s, _ in plan.swap_in] == ["a"] and not plan.swap_out
    assert [(c.sequence.request_id, c.num_tokens) for c in plan.chunks] == [("a", 1)]


def test_blocks_to_resume_keep_a_growth_block_for_every_sequence_a_resume_must_fit_beside():
    """What a worker promises new arrivals leaves the swapped-out sequences enough to come back
    (the swap-in asks for a growth block per running sequence beside their KV)."""
    scheduler = make_scheduler(num_blocks=12, mode="swap")
    for name in ("a", "b", "c", "s"):
        scheduler.add(seq(name, 32))
    run_step(scheduler)  # four sequences of two full blocks: 8 of 12 blocks
    s = scheduler.running[-1]
    scheduler.preempt(s)  # swapped out with 32 tokens computed
    promised = scheduler.block_manager.num_free_blocks - scheduler.blocks_to_resume()
    held = scheduler.block_manager.allocate(max(0, promised))  # a reservation takes all of it
    plan = scheduler.schedule()
    assert [x.request_id for x, _ in plan.swap_in] == ["s"] and not plan.swap_out
    scheduler.block_manager.free(held)


def test_recompute_victims_of_later_steps_wait_behind_more_urgent_ones():
    scheduler = make_scheduler(num_blocks=100)
    for name in ("old", "mid", "new"):
        scheduler.add(seq(name, 16))
    run_step(scheduler)
    old, mid, new = scheduler.running
    scheduler.preempt(mid)  # a step's victim
    scheduler.add(seq("later", 16))  # a newcomer: behind every preempted sequence
    scheduler.preempt(old)  # a later step's: older, so more urgent than mid
    scheduler.preempt(new)
    assert [s.request_id for s in scheduler.waiting] == ["old", "mid", "new", "later"]


def test_blocks_to_resume_bring_back_every_swapped_sequence_not_just_the_first():
    """Each sequence swapped in joins the running ones: the promise once left a growth block
    per running sequence beside all of them, and the second swap-in found one too few."""
    scheduler = make_scheduler(num_blocks=16, mode="swap")
    for name in ("a", "b", "s1", "s2"):
        scheduler.add(seq(name, 30))
    run_step(scheduler)  # two blocks each; every next token fits in the second
    s1, s2 = scheduler.running[2:]
    scheduler.preempt(s2)
    scheduler.preempt(s1)
    promised = scheduler.block_manager.num_free_blocks - scheduler.blocks_to_resume()
    scheduler.block_manager.allocate(max(0, promised))  # reservations take what is offered
    plan = scheduler.schedule()
    assert sorted(s.request_id for s, _ in plan.swap_in) == ["s1", "s2"] and not plan.swap_out


@settings(max_examples=150, deadline=None)
@given(
    st.lists(st.integers(1, 150), min_size=2, max_size=8),
    st.integers(1, 3),
    st.lists(st.booleans(), min_size=8, max_size=8),
    st.sampled_from([None, 64, 100]),
)
def test_blocks_to_resume_are_exactly_what_brings_every_swapped_sequence_back(
    prompt_lens, num_steps, swap_decoders, cap
):
    """Swapped sequences, some out mid-prompt, beside running decoding ones: a worker that
    promises away all but `blocks_to_resume` has every one back in the next step, without a
    swap-out; one block more promised away keeps one out."""

    def build() -> StepScheduler:
        scheduler = StepScheduler(BlockManager(400, 4), 64, 128, lambda s, n: "swap")
        scheduler.prompt_token_cap = cap
        for i, prompt_len in enumerate(prompt_lens):
            scheduler.add(Sequence(f"s{i}", [1] * prompt_len, SamplingParams(max_tokens=50)))
        for _ in range(num_steps):
            run_step(scheduler)
        running = list(scheduler.running)
        for victim, decoder in zip(running, swap_decoders[: len(running)], strict=True):
            if victim.num_uncomputed_tokens > 1 or decoder:  # running ones decode
                scheduler.preempt(victim)
        return scheduler

    for extra in (0, 1):
        scheduler = build()
        num_swapped = len(scheduler.swapped)
        promised = scheduler.block_manager.num_free_blocks - scheduler.blocks_to_resume() + extra
        if num_swapped == 0 or promised < 0:
            return
        scheduler.block_manager.allocate(promised)
        plan = scheduler.schedule()
        assert not plan.swap_out
        assert len(plan.swap_in) == (num_swapped if extra == 0 else num_swapped - 1)
        scheduler.block_manager.check_invariants()


def finish_at_max_tokens(scheduler: StepScheduler, plan: StepPlan) -> None:
    for chunk in plan.chunks:
        sequence = chunk.sequence
        if sequence.num_output_tokens >= sequence.params.max_tokens:
            scheduler.finish(sequence, SequenceStatus.FINISHED_LENGTH)


def test_a_sequence_swapped_out_mid_prompt_comes_back_to_room_for_its_next_chunk():
    """Swapped out mid-prompt, B came back to room for its KV and one token; its next step is
    a prompt chunk of several blocks, so it was the victim of its own step and went straight
    out again: a copy in and out every step, and no progress."""
    scheduler = StepScheduler(BlockManager(12, 4), 8, 16, lambda s, n: "swap")
    scheduler.add(Sequence("A", [1] * 17, SamplingParams(max_tokens=31), arrival_time=0.0))
    scheduler.add(Sequence("B", [1] * 33, SamplingParams(max_tokens=8), arrival_time=1.0))
    for _ in range(100):
        if not scheduler.has_work:
            break
        plan = scheduler.schedule()
        swapped_in = {s.request_id for s, _ in plan.swap_in}
        assert not swapped_in & {s.request_id for s, _ in plan.swap_out}
        for chunk in plan.chunks:  # what the engine does after the forward
            chunk.sequence.num_computed_tokens += chunk.num_tokens
            if chunk.sequence.num_uncomputed_tokens == 0:
                chunk.sequence.output_token_ids.append(7)
        if swapped_in:  # it comes back to run its chunk
            assert [c.num_tokens for c in plan.chunks if c.sequence.request_id == "B"] == [16]
        finish_at_max_tokens(scheduler, plan)
        scheduler.block_manager.check_invariants()
    assert not scheduler.has_work
    assert scheduler.num_preemptions_by_mode == {"swap": 1, "recompute": 0}


def test_a_swapped_in_sequence_a_more_urgent_chunk_needs_goes_back_uncopied():
    """A sequence swapped in whose blocks a more urgent prompt's chunk needs after all (the
    swap-in leaves it a growth block only) is sent back before anything is copied: swapped
    out again, it would be copied in and out, its host copy still counted against the room
    for the second copy."""
    scheduler = StepScheduler(BlockManager(16, 4), 8, 16, lambda s, n: "swap")
    s = Sequence("s", [1] * 8, SamplingParams(max_tokens=20), arrival_time=0.0)
    scheduler.add(s)
    run_step(scheduler)
    scheduler.add(Sequence("r", [1] * 40, SamplingParams(max_tokens=4), priority=5))
    assert run_step(scheduler) == {"s": 1, "r": 15}
    scheduler.preempt(s)  # three blocks of KV
    held = scheduler.block_manager.allocate(8)  # four free: s's KV, next token, r's growth
    plan = scheduler.schedule()  # s comes back; r's chunk needs four blocks
    assert not plan.swap_in and not plan.swap_out
    assert [(c.sequence.request_id, c.num_tokens) for c in plan.chunks] == [("r", 15)]
    assert scheduler.swapped == [s] and s.status == SequenceStatus.SWAPPED and not s.block_ids
    assert s.num_computed_tokens == 9 and scheduler.num_preemptions == 1
    scheduler.block_manager.check_invariants()
    scheduler.block_manager.free(held)
    for _ in range(3):
        plan = scheduler.schedule()
        if plan.swap_in:
            break
    assert [x.request_id for x, _ in plan.swap_in] == ["s"] and not plan.swap_out


def run_step_caching(scheduler: StepScheduler) -> None:
    for chunk in scheduler.schedule().chunks:  # what the engine does after the forward
        chunk.sequence.num_computed_tokens += chunk.num_tokens
        cache_computed_blocks(chunk.sequence, scheduler.block_manager)
        if chunk.sequence.num_uncomputed_tokens == 0:
            chunk.sequence.output_token_ids.append(7)


def retained_turn(scheduler: StepScheduler) -> None:
    """A finished turn of conversation X, its two full blocks cached until t=100."""
    x1 = cached_seq("x1", [1, 2, 3, 4, 9])
    scheduler.add(x1)
    run_step_caching(scheduler)
    scheduler.finish(x1, SequenceStatus.FINISHED_STOPPED, retain_until=100.0)  # think time


def test_a_returning_turns_prefix_keeps_its_protection_when_its_pins_are_given_back():
    """X's next turn pins its cached prefix but is not admitted (a running sequence needs the
    room): the pins went back as plain LRU, the think-time protection lost to its own turn."""
    cache = PrefixCache(clock=lambda: 0.0)
    scheduler = StepScheduler(BlockManager(5, 2, cache), 8, 64)
    retained_turn(scheduler)
    r = cached_seq("r", [20, 21])
    r.cache_root = None
    scheduler.add(r)
    run_step_caching(scheduler)  # r holds one block; its next token needs a second
    scheduler.block_manager.allocate(2)  # the rest of the free queue (a decode reservation)
    x2 = cached_seq("x2", [1, 2, 3, 4, 11, 12])  # X's next turn: two blocks cached
    scheduler.add(x2)
    scheduler.schedule()  # x2 pins both, r needs one: the pins go back, r takes X's second
    head = cache.lookup(x2.block_hashes[0])
    assert head is not None and cache.retain_until(head) == 100.0
    scheduler.block_manager.check_invariants()


def test_a_prefix_whose_pins_were_given_back_is_evicted_after_a_plain_block():
    cache = PrefixCache(clock=lambda: 0.0)
    manager = BlockManager(8, 2, cache)
    scheduler = StepScheduler(manager, 8, 64)
    retained_turn(scheduler)
    r = cached_seq("r", [20, 21])
    r.cache_root = None
    scheduler.add(r)
    run_step_caching(scheduler)
    held = manager.allocate(manager.num_free_blocks - 2)  # all but X's two cached blocks
    x2 = cached_seq("x2", [1, 2, 3, 4, 11, 12])
    scheduler.add(x2)
    scheduler.schedule()  # pins given back, r grows into X's second block
    head = cache.lookup(x2.block_hashes[0])
    manager.free(held)
    scheduler.waiting.clear()
    aborted = cached_seq("p", [50, 51, 9])  # its cached block is plain
    scheduler.add(aborted)
    run_step_caching(scheduler)
    scheduler.finish(aborted, SequenceStatus.FINISHED_ABORTED)
    manager.allocate(manager.num_free_blocks - 2)
    manager.allocate(1)  # one of the two cached blocks must go: the plain one
    assert cache.lookup(x2.block_hashes[0]) == head


def test_a_newcomer_held_back_by_a_swapped_sequence_leaves_its_prefix_protected():
    """A newcomer pins its prefix and gives it back every step a sequence is swapped out (no
    newcomer is admitted then); a decode worker's local prefill had just re-protected those
    blocks (`_prefill_here`), and the first step undid it."""
    cache = PrefixCache(clock=lambda: 0.0)
    manager = BlockManager(16, 2, cache)
    scheduler = StepScheduler(manager, 8, 64, lambda s, n: "swap")
    retained_turn(scheduler)
    s = cached_seq("s", [30, 31, 32, 33, 34, 35])
    s.cache_root = None
    scheduler.add(s)
    run_step_caching(scheduler)
    scheduler.preempt(s)  # swapped out, waiting for room
    manager.allocate(manager.num_free_blocks - 2)  # reservations: s cannot come back yet
    x2 = cached_seq("x2", [1, 2, 3, 4, 11, 12])
    scheduler.add(x2)
    scheduler.schedule()
    assert scheduler.waiting[0] is x2 and scheduler.swapped == [s]
    assert [cache.retain_until(cache.lookup(h)) for h in x2.block_hashes[:2]] == [100.0] * 2


class CompilingGrammar:
    """A sequence's grammar state as the scheduler sees it: `ready` once its compile ended."""

    def __init__(self) -> None:
        self.ready = False


def constrained_seq(name: str, prompt_len: int) -> Sequence:
    sequence = seq(name, prompt_len)
    sequence.grammar = CompilingGrammar()
    return sequence


def test_a_compiling_grammar_holds_back_only_its_sequences_sampling_chunk():
    """The step that brings a sequence to its next token samples it, which needs the matcher:
    while the grammar compiles, that chunk waits, the prompt's others run (the compile overlaps
    the prefill) and the rest of the batch steps on. The engine once ran the chunk and waited
    on the compile inside the step, every other sequence of the batch with it."""
    scheduler = make_scheduler()
    held, free = constrained_seq("held", 40), seq("free", 30)
    scheduler.add(held)
    scheduler.add(free)
    assert run_step(scheduler) == {"held": 39, "free": 30}  # all but held's last token
    assert run_step(scheduler) == {"free": 1}
    assert run_step(scheduler) == {"free": 1}
    assert held in scheduler.running and held.num_uncomputed_tokens == 1  # its blocks kept
    held.grammar.ready = True
    assert run_step(scheduler) == {"held": 1, "free": 1}
    assert held.output_token_ids == [7]
    held.grammar.ready = False  # (a decode step of a sequence that arrived prefilled)
    assert run_step(scheduler) == {"free": 1}


def test_a_waiting_sequence_with_only_its_sampling_token_left_takes_no_newcomer_seat():
    """A held prompt with nothing to run but its last token stays queued, holding no blocks,
    without keeping out the newcomers behind it; a held prompt in progress runs up to that
    token and then holds no share of the prompt budget."""
    scheduler = make_scheduler(budget=MIN_CHUNK)  # one newcomer a step
    one_token = constrained_seq("one", 1)
    scheduler.add(one_token)
    scheduler.add(seq("next", 40))
    assert run_step(scheduler) == {"next": 40}
    assert list(scheduler.waiting) == [one_token] and not one_token.block_ids
    held = constrained_seq("held", 30)
    scheduler.add(held)
    scheduler.add(seq("long", 1000))
    assert run_step(scheduler) == {"next": 1, "held": 29}
    assert run_step(scheduler) == {"next": 1, "long": MIN_CHUNK - 1}
    one_token.grammar.ready = held.grammar.ready = True
    assert run_step(scheduler) == {"next": 1, "held": 1, "one": 1, "long": MIN_CHUNK - 3}
