"""The scheduler-at-scale benchmark, tiny: it keeps the queue full and counts decisions."""

from __future__ import annotations

import argparse
import gc

import pytest

from loadtest import core_floor
from loadtest.scheduler_scale import (
    HEARTBEAT_EVERY_ROUNDS,
    TICK_EVERY_ROUNDS,
    ScaleBench,
    main,
)


def tiny(
    prefix_cache: bool = False, gc: str = "default", token_ids: str = "repeated"
) -> argparse.Namespace:
    return argparse.Namespace(
        prefill=4,
        decode=4,
        queued=300,
        tenants=20,
        rounds=600,
        seed=0,
        prefill_ms=20,
        prefix_cache=prefix_cache,
        gc=gc,
        indexes="auto",
        token_ids=token_ids,
    )


def test_a_tiny_run_plays_whole_lives_and_keeps_the_queue_full():
    bench = ScaleBench(tiny())
    result = bench.run()
    assert result["num_decisions"] > 0
    assert result["num_queued"] == 300  # new submits keep it at --queued
    assert result["decision_p99_ms"] >= result["decision_p50_ms"] > 0
    assert result["max_call_ms"] >= result["decision_p99_ms"]
    # Every reservation is answered in the round after it: the ticks find nothing timed out.
    assert bench.handler_calls["tick"] == 600 // TICK_EVERY_ROUNDS + 1
    assert bench.handler_calls["on_reserve_reply"] >= result["num_decisions"] - 8 * 64
    assert all(f"{name}_us" in result for name in ("on_submit", "on_heartbeat", "tick"))


def test_distinct_token_ids_change_what_the_queue_holds_not_what_the_core_decides():
    """Without prefix caches the core never reads a prompt's ids: the same decisions."""
    runs = {kind: ScaleBench(tiny(token_ids=kind)) for kind in ("repeated", "distinct")}
    results = {kind: bench.run() for kind, bench in runs.items()}
    assert results["distinct"]["num_decisions"] == results["repeated"]["num_decisions"] > 0
    held = {
        kind: {t for r in bench.core.requests.values() for t in r.submit.prompt_token_ids}
        for kind, bench in runs.items()
    }
    assert held["repeated"] == {0} and len(held["distinct"]) > 1000


def test_prefills_report_after_their_time_and_every_worker_beats_at_the_service_interval():
    """As many requests leave the prefill windows a round as enter them: each prefill reports
    `prefill_ms` rounds after it began, none earlier, so the decisions keep coming after the
    windows first fill; each worker beats once every `HEARTBEAT_EVERY_ROUNDS` rounds."""
    args = tiny()
    args.rounds = HEARTBEAT_EVERY_ROUNDS
    bench = ScaleBench(args)
    bench.setup()
    began: dict[str, int] = {}
    reported: dict[str, int] = {}
    for index in range(args.rounds):
        bench.round(index)
        began.update((r, i) for i, r in bench.prefilling if r not in began)
        reported.update((r, index) for r in bench.decoding if r not in reported)
    assert reported
    assert all(reported[r] - began[r] == args.prefill_ms for r in reported if r in began)
    late = [r for r, i in reported.items() if i >= args.rounds // 2]
    assert len(late) > 4 * 64  # the second half still turns requests over, not a trickle
    assert bench.handler_calls["on_heartbeat"] == len(bench.workers)


def test_frozen_survivors_as_the_service_runs_leave_the_process_thawed():
    bench = ScaleBench(tiny(gc="freeze"))
    result = bench.run()
    assert result["gc"] == "freeze" and bench.freezer is not None
    assert result["num_decisions"] > 0
    assert gc.get_freeze_count() == 0


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
    with pytest.raises(SystemExit) as exit_info:
        main(["--prefill-ms", "0"])
    assert exit_info.value.code == 2
    assert "--prefill-ms must be at least 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--token-ids", "random"])
    assert exit_info.value.code == 2
    assert "--token-ids: invalid choice: 'random'" in capsys.readouterr().err


def test_the_profile_counts_function_calls_per_decision(capsys):
    flags = "--prefill 4 --decode 4 --queued 300 --tenants 20 --rounds 300 --profile"
    main(flags.split())
    printed = capsys.readouterr().out
    calls = float(printed.split("calls_per_decision:")[1].split()[0].replace(",", ""))
    assert calls > 10  # a decision is many calls: the figure is per decision, not in total
    assert "tottime" in printed  # the profile's table came first


def test_the_core_floor_plays_every_life_through_and_refuses_no_requests(capsys):
    """The FIFO core's floor: every request's life ends (the measure asserts it), in some
    microseconds; a request count below 1 exits 2 naming it."""
    assert 0 < core_floor.measure(200) < 0.01
    assert core_floor.main(["--requests", "50"]) == 0
    assert "us per request life" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exited:
        core_floor.main(["--requests", "0"])
    assert exited.value.code == 2 and "--requests must be at least 1" in capsys.readouterr().err
