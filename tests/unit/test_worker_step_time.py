"""The moving average of a worker's step durations, which its heartbeats report."""

from __future__ import annotations

import pytest

from shared.engine.pace import STEP_SMOOTHING, smoothed


def test_the_first_step_stands_alone_and_later_ones_move_the_average_by_their_weight():
    assert smoothed(0.0, 0.4) == 0.4
    assert smoothed(0.4, 1.4) == pytest.approx(0.4 + STEP_SMOOTHING * 1.0)
    average = 0.4
    for _ in range(50):  # a steady step time is where the average settles
        average = smoothed(average, 0.1)
    assert average == pytest.approx(0.1, abs=1e-6)


class _Events:
    def __init__(self) -> None:
        self.steps: list[tuple[float, int, int]] = []

    def step(self, duration_s: float, num_sequences: int, num_context_tokens: int) -> None:
        self.steps.append((duration_s, num_sequences, num_context_tokens))


class _Link:
    def heartbeat_due(self, now: float) -> bool:
        return False


class _Poller:
    def poll(self, timeout_ms: float) -> list:
        return []


def test_a_step_that_only_waited_on_a_grammar_compile_counts_as_a_turn_not_as_a_step():
    """While a request's grammar compiles and nothing else can run, the engine's steps wait on
    the compile a little each: the loop counts them (the scheduler reads progress from the
    count) but they are neither busy time nor batches, nor samples of the step time that
    routing reads."""
    from types import SimpleNamespace

    from services.worker.loop import WorkerLoop

    class Loop(WorkerLoop):
        _handle = _abandon = held_request_ids = _close = None

        def _step(self) -> None:
            self.engine.last_step_idle, self.engine.last_step_num_seqs = self.next_step

        def _on_timers(self, now: float) -> None:
            pass

    loop = Loop.__new__(Loop)
    loop.engine = SimpleNamespace(has_unfinished=True, last_step_context_tokens=40)
    loop.events, loop.link, loop.poller = _Events(), _Link(), _Poller()
    loop.steps_completed, loop.step_s, loop._recent_batch_sizes = 0, 0.0, []
    for loop.next_step in [(False, 2), (True, 0), (True, 0), (False, 1)]:
        loop.run_once()
    assert loop.steps_completed == 4
    assert [num_seqs for _, num_seqs, _ in loop.events.steps] == [2, 1]
    assert loop._recent_batch_sizes == [2, 1] and loop.step_s > 0
