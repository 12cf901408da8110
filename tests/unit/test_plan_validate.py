"""The validation script's pure parts: configurations, the simulated side, the table, the
workers' step counters and the slow-down they give, refusals."""

from __future__ import annotations

import dataclasses
import statistics

import pytest

from loadtest.metrics import summarize
from loadtest.plan_validate import (
    StepTimes,
    ValidateError,
    batch_factors,
    batch_table,
    caching_default,
    cpu_table,
    main,
    median_run,
    parse_configs,
    ranking,
    role_steps,
    simulated,
    slow_down,
    steps_table,
    table,
    within,
)
from loadtest.worker_metrics import WorkerCounters, worker_counters
from loadtest.workload import read_workload
from services.planner.profile import ProfileError
from shared.metrics import STEP_BUCKETS
from tests.unit.test_planner_sim import cpu_like_profile


def test_parse_configs():
    assert parse_configs("1P1D,1P2D, 2P1D") == [(1, 1), (1, 2), (2, 1)]
    for text in ("1P", "0P1D", "PD", "1D1P"):
        with pytest.raises(ValidateError, match="look like 1P2D"):
            parse_configs(text)


def test_a_prompt_given_as_text_alone_is_simulated_at_its_length():
    # A workload line with the prompt text and no token ids (the bench sends the text, the
    # server tokenizes it) was simulated as a one-token prompt: prefills took no time.
    with_ids = read_workload("loadtest/workloads/mixed64.jsonl")[:8]
    as_text = [dataclasses.replace(r, prompt_token_ids=None) for r in with_ids]
    by_ids, by_text = (simulated(cpu_like_profile(), rs, 1, 1)[1] for rs in (with_ids, as_text))
    assert by_text["prefill"].busy_s == pytest.approx(by_ids["prefill"].busy_s, rel=0.5)


def test_the_simulated_side_on_the_shipped_workload():
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    (one, one_steps), (two, two_steps) = (
        simulated(cpu_like_profile(), requests, 1, 1),
        simulated(cpu_like_profile(), requests, 2, 2),
    )
    decode = one_steps["decode"]
    assert decode.worker_steps == (decode.steps,)
    for steps in two_steps.values():  # each worker's, most first, adding up to the role's
        assert len(steps.worker_steps) == 2 and sum(steps.worker_steps) == steps.steps
        assert steps.worker_steps[0] >= steps.worker_steps[1]
    shown = steps_table({"2P2D": (two_steps, two_steps)})
    assert "steps per worker" in shown.splitlines()[0]
    worker_cells = "+".join(f"{s:.0f}" for s in two_steps["decode"].worker_steps)
    assert f"{worker_cells} / {worker_cells}" in shown
    assert decode.sequences == sum(r.max_tokens - 1 for r in requests)  # the first: prefill's
    assert 1 <= decode.mean_batch <= 64 and decode.mean_step_s > 0
    assert sum(decode.step_counts) == decode.steps
    assert 0 < decode.step_quantile(0.5) <= decode.step_quantile(0.9)
    assert "decode" in steps_table({"1P1D": (one_steps, one_steps)})
    # The simulated decode steps by batch size range add up to the whole, contexts included.
    ranges = decode.by_batch.values()
    assert sum(r[0] for r in ranges) == decode.steps
    assert sum(r[1] for r in ranges) == pytest.approx(decode.busy_s)
    assert sum(r[2] for r in ranges) == decode.sequences
    prompt_tokens = min(r.num_prompt_tokens for r in requests)
    assert all(r[3] >= r[2] * prompt_tokens for r in ranges)  # a context holds its prompt
    shown = batch_table({"1P1D": (one_steps, one_steps)}).splitlines()
    assert len(shown) == 1 + len(decode.by_batch) and "context/seq" in shown[0]
    assert one.num_ok == two.num_ok == len(requests)
    assert two.ttft_p90 <= one.ttft_p90
    rows = {"1P1D": (one, one), "2P2D": (two, one)}
    assert "1P1D" in table(rows) and "+0%" in table(rows)
    assert ranking(rows, 0) == ["2P2D", "1P1D"]
    assert within({"1P1D": (one, one)}) and not within({"x": (one, summarize([]))})


def test_repeated_runs_compare_by_their_medians():
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    summary, steps = simulated(cpu_like_profile(), requests, 1, 1)
    slower = dataclasses.replace(summary, ttft_p50=3 * summary.ttft_p50, tpot_p90=None)
    faster = dataclasses.replace(summary, ttft_p50=summary.ttft_p50 / 2)
    median, median_steps = median_run([(slower, steps), (summary, steps), (faster, steps)])
    assert median.ttft_p50 == summary.ttft_p50 and median_steps is steps
    assert median.tpot_p90 == statistics.median([summary.tpot_p90, faster.tpot_p90])
    assert median.num_ok == slower.num_ok  # the rest: the first run's


def test_wrong_values_exit_2(capsys, monkeypatch):
    for wrong in (["--prefix-cache", "maybe"], ["--configs", "1P1D", "--repeats", "x"]):
        with pytest.raises(SystemExit):
            main(wrong)
    capsys.readouterr()
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "sometimes")
    assert main([]) == 2
    assert "TANDEM_ENABLE_PREFIX_CACHING: expected a boolean" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_ENABLE_PREFIX_CACHING", "false")
    assert caching_default() == "off"
    monkeypatch.delenv("TANDEM_ENABLE_PREFIX_CACHING")
    assert caching_default() == "on"
    assert main(["--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err
    assert main(["--profile", "measure", "--profile-repeats", "0"]) == 2
    assert "--profile-repeats must be at least 1" in capsys.readouterr().err
    assert main(["--shared-cores", "/nonexistent.json"]) == 2
    assert "cannot read profile /nonexistent.json" in capsys.readouterr().err
    assert main(["--configs", "1P"]) == 2
    assert "look like 1P2D" in capsys.readouterr().err
    assert main(["--profile", "/nonexistent.json"]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    assert main(["--profile", "1P1D=/nonexistent.json", "--configs", "1P2D"]) == 2
    assert "no file for 1P2D" in capsys.readouterr().err
    # (An entry without NAME= read "dictionary update sequence element #1 has length 1".)
    assert main(["--profile", "1P1D=a.json,b.json", "--configs", "1P1D"]) == 2
    assert "--profile entries look like 1P2D=FILE; got 'b.json'" in capsys.readouterr().err


METRICS = """\
tandem:engine_steps_total{peer="prefill-0"} 10
tandem:engine_busy_seconds_total{peer="prefill-0"} 4
tandem:prefill_tokens_total{peer="prefill-0"} 900
tandem:engine_steps_total{peer="decode-0"} 100
tandem:engine_busy_seconds_total{peer="decode-0"} 30
tandem:decode_batch_size_sum{peer="decode-0"} 800
tandem:decode_batch_size_count{peer="decode-0"} 100
tandem:decode_generated_tokens_total{peer="decode-0"} 800
tandem:engine_steps_total{peer="decode-1"} 50
tandem:engine_busy_seconds_total{peer="decode-1"} 10
tandem:decode_batch_size_sum{peer="decode-1"} 200
tandem:decode_generated_tokens_total{peer="decode-1"} 200
tandem:num_requests_running{peer="scheduler"} 3
"""
# decode-0's steps by duration: 20 at most 0.1 s, 80 at most 0.2 s, 100 in all.
STEP_LINES = (
    "".join(
        f'tandem:engine_step_seconds_bucket{{peer="decode-0",le="{bound}"}} '
        f"{0 if bound < 0.1 else 20 if bound < 0.2 else 80}\n"
        for bound in STEP_BUCKETS
    )
    + 'tandem:engine_step_seconds_bucket{peer="decode-0",le="+Inf"} 100\n'
)
BY_BATCH_LINES = (
    'tandem:decode_steps_by_batch_total{peer="decode-0",batch="4"} 60\n'
    'tandem:decode_step_seconds_by_batch_total{peer="decode-0",batch="4"} 12\n'
    'tandem:decode_step_sequences_by_batch_total{peer="decode-0",batch="4"} 210\n'
    'tandem:decode_steps_by_batch_total{peer="decode-0",batch="16"} 40\n'
    'tandem:decode_step_seconds_by_batch_total{peer="decode-0",batch="16"} 18\n'
    'tandem:decode_step_sequences_by_batch_total{peer="decode-0",batch="16"} 590\n'
    'tandem:decode_step_context_tokens_by_batch_total{peer="decode-0",batch="16"} 118000\n'
)


def test_the_workers_steps_are_read_from_their_counters():
    after = worker_counters(METRICS + STEP_LINES)
    assert set(after) == {"prefill-0", "decode-0", "decode-1"}  # the scheduler has no steps
    decode = after["decode-0"]
    assert (decode.role, decode.steps, decode.busy_s, decode.batch_sequences) == (
        "decode",
        100,
        30,
        800,
    )
    assert decode.step_buckets[STEP_BUCKETS.index(0.1)] == 20 and decode.step_buckets[-1] == 100
    before = {"decode-0": WorkerCounters("decode", 20, 6, 160, 20)}
    steps = role_steps(before, after)
    assert (steps["prefill"].steps, steps["prefill"].busy_s) == (10, 4)
    assert steps["prefill"].step_quantile(0.5) is None  # no bucket lines: durations unknown
    decode = steps["decode"]  # decode-1 was not there before: all new
    assert (decode.steps, decode.busy_s, decode.sequences) == (130, 34, 840)
    assert decode.worker_steps == (80, 50)  # each worker's, most first
    assert decode.mean_batch == pytest.approx(840 / 130)
    counts = decode.step_counts  # back from cumulated to per bucket
    assert counts[STEP_BUCKETS.index(0.1)] == 20 and counts[STEP_BUCKETS.index(0.2)] == 60
    assert counts[-1] == 20 and sum(counts) == 100
    # The median: the 50th of 100, the 30th of the 60 in (0.15, 0.2].
    assert decode.step_quantile(0.5) == pytest.approx(0.15 + 0.05 * 30 / 60)
    assert decode.step_quantile(0.95) == STEP_BUCKETS[-1]  # beyond the last bound


def test_the_slow_down_sets_the_run_against_the_profile():
    profile = cpu_like_profile()
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    context = sum(r.num_prompt_tokens + r.max_tokens / 2 for r in requests) / len(requests)
    step_s = profile.decode_time(8, context)
    real = {"prefill": StepTimes(10, 6.0), "decode": StepTimes(100, 100 * 1.25 * step_s, 800)}
    sim = {"prefill": StepTimes(12, 4.0), "decode": StepTimes(90, 1.0, 700)}
    prefill, decode = slow_down(profile, real, sim, requests)
    assert prefill == pytest.approx(1.5) and decode == pytest.approx(1.25)
    slowed = profile.slowed(prefill, decode)
    assert slowed.decode_time(8, context) == pytest.approx(1.25 * step_s)
    assert slowed.prefill_time(100) == pytest.approx(1.5 * profile.prefill_time(100))
    assert slowed.transfer_time(100) == profile.transfer_time(100)
    with pytest.raises(ProfileError, match="positive"):
        profile.slowed(decode=0)


def test_the_cpu_table_splits_the_workers_from_the_rest():
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    summary = dataclasses.replace(simulated(cpu_like_profile(), requests, 1, 1)[0],
                                  wall_s=10.0, output_tokens=1000)  # fmt: skip
    cpu = {"prefill": 8.0, "decode": 9.0, "gateway": 2.0, "scheduler": 1.0, "client": 1.0,
           "up": 0.5, "batch": 0.5}  # fmt: skip
    (header, row) = cpu_table({"1P1D": (summary, cpu)}, num_cores=2).splitlines()
    # The rest: 5 core-seconds of 20, 5 ms per output token.
    assert row.split() == ["1P1D", "10.0", "17.0", "2.0", "1.0", "1.0", "1.0", "25%", "5.00"]
    assert "rest/cores" in header


def test_decode_steps_by_batch_are_read_and_fit_the_profile_batch_by_batch():
    after = worker_counters(METRICS + BY_BATCH_LINES)
    # A worker older than the context counter reports none for "4" (read as 0).
    assert after["decode-0"].by_batch == {"4": (60, 12, 210, 0), "16": (40, 18, 590, 118000)}
    before = {"decode-0": WorkerCounters("decode", by_batch={"4": (10, 2, 35, 0)})}
    decode = role_steps(before, after)["decode"]
    assert decode.by_batch == {"4": (50, 10, 175, 0), "16": (40, 18, 590, 118000)}
    profile = cpu_like_profile()
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    context = sum(r.num_prompt_tokens + r.max_tokens / 2 for r in requests) / len(requests)
    factors = dict(batch_factors(profile, decode, requests))
    # (4, 3.5): 0.2 s a step, at the workload's mean context (the range's is not known);
    # (16, 14.75): 0.45 s a step, at the range's own 200 tokens a sequence.
    assert factors[3.5] == pytest.approx(0.2 / profile.decode_time(3.5, context))
    assert factors[14.75] == pytest.approx(0.45 / profile.decode_time(14.75, 200))
    assert profile.decode_time(14.75, 200) != pytest.approx(profile.decode_time(14.75, context))
    few = StepTimes(0, 0, by_batch={"4": (4, 1, 14, 400)})
    assert batch_factors(profile, few, requests) == []  # too few steps to fit by
