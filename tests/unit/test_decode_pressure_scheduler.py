"""The step scheduler under memory pressure: preempted sequences and newcomers that share a step
never keep one another out for good."""

from __future__ import annotations

from shared.engine.block_manager import BlockManager
from shared.engine.sampling_params import SamplingParams
from shared.engine.scheduler import StepScheduler
from shared.engine.sequence import Sequence, SequenceStatus
from tests.unit.test_step_scheduler import run_step


def test_a_preempted_bulk_line_sitting_out_a_step_does_not_hold_back_the_prompt_behind_it():
    """Under a step time cap a bulk prompt gets nothing in a step that brings an interactive
    prompt to its first token. A bulk line preempted for recompute keeps the head of the
    queue; the chat prompt behind it was the one finishing, so the bulk line sat out, and
    admission stopped at the bulk line's empty share: neither ever ran again."""
    scheduler = StepScheduler(BlockManager(8, 16), max_num_seqs=8, max_num_batched_tokens=512)
    scheduler.prompt_token_cap = 128  # a prefill worker's step time target
    scheduler.add(Sequence("chat0", [1] * 60, SamplingParams(max_tokens=100)))
    scheduler.add(Sequence("bulk", [2] * 60, SamplingParams(max_tokens=100), bulk=True))
    for _ in range(12):  # both grow past the pool: the bulk line is the first victim
        run_step(scheduler)
        if scheduler.num_preemptions:
            break
    (bulk,) = scheduler.waiting
    assert bulk.request_id == "bulk" and bulk.num_preemptions == 1
    scheduler.finish(scheduler.running[0], SequenceStatus.FINISHED_STOPPED)  # room again
    scheduler.add(Sequence("chat1", [3] * 20, SamplingParams(max_tokens=4)))
    assert [s.request_id for s in scheduler.waiting] == ["bulk", "chat1"]
    assert run_step(scheduler) == {"chat1": 20}  # its first token, the bulk line sits out
    steps = [run_step(scheduler) for _ in range(3)]
    assert any("bulk" in step for step in steps)  # and then goes on
    assert scheduler.block_manager.num_free_blocks < 8
