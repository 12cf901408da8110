"""The scheduler-at-scale benchmark, tiny: it keeps the queue full and counts decisions."""

from __future__ import annotations

import argparse

import pytest

from loadtest.scheduler_scale import ScaleBench, main


def tiny(prefix_cache: bool = False) -> argparse.Namespace:
    return argparse.Namespace(
        prefill=4, decode=4, queued=300, tenants=20, rounds=40, seed=0, prefix_cache=prefix_cache
    )


def test_a_tiny_run_dispatches_and_keeps_the_queue_full():
    result = ScaleBench(tiny()).run()
    assert result["num_decisions"] > 0
    assert result["num_queued"] >= 250  # new submits keep it near --queued
    assert result["decision_p99_ms"] >= result["decision_p50_ms"] > 0


def test_with_prefix_caches_the_placement_counts_cached_prompts():
    bench = ScaleBench(tiny(prefix_cache=True))
    result = bench.run()
    assert result["num_decisions"] > 0 and result["prefix_cache"]
    assert bench.core.placement.active
    assert bench.core.num_predicted_cached_tokens > 0  # some prompts went where they are cached


def test_wrong_values_exit_2(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--prefill", "0"])
    assert exit_info.value.code == 2
    assert "--prefill must be at least 1" in capsys.readouterr().err
