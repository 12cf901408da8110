"""The scheduler-at-scale benchmark, tiny: it keeps the queue full and counts decisions."""

from __future__ import annotations

import argparse

import pytest

from loadtest.scheduler_scale import ScaleBench, main


def test_a_tiny_run_dispatches_and_keeps_the_queue_full():
    args = argparse.Namespace(prefill=4, decode=4, queued=300, tenants=20, rounds=40, seed=0)
    result = ScaleBench(args).run()
    assert result["num_decisions"] > 0
    assert result["num_queued"] >= 250  # new submits keep it near --queued
    assert result["decision_p99_ms"] >= result["decision_p50_ms"] > 0


def test_wrong_values_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--prefill", "0"])
    assert exit_info.value.code == 2
    assert "--prefill must be at least 1" in capsys.readouterr().err


def test_a_token_range_skips_classes_and_chooses_as_without_it():
    from services.scheduler.fair_share import FairQueue, FairShareConfig, QueuedRequest

    def filled() -> FairQueue:
        queue = FairQueue(FairShareConfig())
        for index in range(40):
            num_tokens = 100 if index % 3 else 1500  # short and long classes (threshold 1,024)
            queue.push(QueuedRequest(f"r{index}", f"t{index % 7}", num_tokens, 0, float(index)))
        return queue

    def long_only(item: QueuedRequest) -> bool:
        return item.num_prompt_tokens > 1024

    plain, ranged = filled(), filled()
    chosen = [plain.pop_next(1.0, long_only) for _ in range(5)]
    assert chosen == [ranged.pop_next(1.0, long_only, (1025, 4096)) for _ in range(5)]
    assert all(item.num_prompt_tokens == 1500 for item in chosen)
    assert ranged.pop_next(1.0, token_range=(1, 1023)).num_prompt_tokens == 100
    assert ranged.pop_next(1.0, long_only, token_range=(1, 1023)) is None
