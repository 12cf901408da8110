"""The bulk benchmark's arithmetic and its refusal of wrong arguments, without a cluster."""

from __future__ import annotations

import time

import pytest

from loadtest import batch_bench


def test_busy_fractions_average_each_role_over_the_wall_time():
    before = {"p1": ("prefill", 10.0), "d1": ("decode", 5.0), "d2": ("decode", 0.0)}
    after = {
        "p1": ("prefill", 15.0),
        "d1": ("decode", 14.0),
        "d2": ("decode", 10.0),
        "d3": ("decode", 3.0),  # joined during the run: no start, left out
    }
    assert batch_bench.busy_fractions(before, after, wall_s=10.0) == {
        "busy_fraction_decode": 0.95,
        "busy_fraction_prefill": 0.5,
    }


def test_machine_cpu_busy_fraction_counts_idle_wait_and_steal_as_not_busy():
    from collections import namedtuple

    Times = namedtuple("Times", "user nice system idle iowait irq softirq steal")
    before = Times(100.0, 0.0, 20.0, 50.0, 5.0, 1.0, 1.0, 0.0)
    # 10 s of two cores: 15 user, 2 system, 1 softirq busy; 1 idle, 0.5 iowait, 0.5 stolen
    after = Times(115.0, 0.0, 22.0, 51.0, 5.5, 1.0, 2.0, 0.5)
    assert batch_bench.machine_cpu_busy_fraction(before, after) == 0.9
    assert batch_bench.machine_cpu_busy_fraction(before, before) == 0.0


def test_machine_cpu_busy_fraction_reads_this_machine():
    import psutil

    before = psutil.cpu_times()
    spin_until = time.monotonic() + 0.2  # some clock ticks of busy time (they come at 100 Hz)
    while time.monotonic() < spin_until:
        pass
    assert 0.0 < batch_bench.machine_cpu_busy_fraction(before, psutil.cpu_times()) <= 1.0


def test_ratios_compare_the_batch_with_the_burst_and_the_trickle_alone():
    phases = {
        "alone": {"ttft_p99_s": 0.2, "tpot_p50_s": 0.05},
        "burst": {"output_tokens_per_s": 100.0},
        "batch": {"output_tokens_per_s": 93.0, "ttft_p99_s": 0.3, "tpot_p50_s": 0.06},
    }
    assert batch_bench.ratios(phases) == {
        "phase": "ratios",
        "batch_throughput_vs_burst": 0.93,
        "batch_ttft_p99_vs_alone": 1.5,
        "batch_tpot_p50_vs_alone": 1.2,
    }
    phases["alone"]["tpot_p50_s"] = None  # (chats of one token: no time per token)
    assert batch_bench.ratios(phases)["batch_tpot_p50_vs_alone"] is None


def test_the_summary_gives_each_chats_ttft_and_time_per_token_percentiles():
    timings = [(0.1, 0.05), (0.3, None), (0.2, 0.07)]
    assert batch_bench.summary(timings) == {
        "num_interactive": 3,
        "ttft_p50_s": 0.2,
        "ttft_p99_s": 0.3,
        "tpot_p50_s": 0.07,
        "tpot_p99_s": 0.07,
    }
    assert batch_bench.summary([])["tpot_p50_s"] is None


@pytest.mark.parametrize(
    "argv",
    [
        ["--num-prompts", "0"],
        ["--max-tokens", "-1"],
        ["--burst-prompts", "0"],
        ["--trickle-every-s", "0"],
        ["--chat-max-tokens", "0"],
        ["--naive-only", "--skip-naive"],
    ],
)
def test_wrong_arguments_exit_2_before_any_cluster_starts(argv):
    with pytest.raises(SystemExit) as exit_info:
        batch_bench.main(argv)
    assert exit_info.value.code == 2


def test_each_phase_has_its_own_prompts_from_the_second_word_on():
    batch, burst = batch_bench.prompts(3, "batch"), batch_bench.prompts(3, "burst")
    assert len(set(batch)) == 3
    assert {p.split()[0] for p in batch} == {"Batch"} and {p.split()[0] for p in burst} == {"Burst"}
    assert [p.split()[1:] for p in batch] == [p.split()[1:] for p in burst]  # the same lengths


def test_a_failure_is_told_by_the_errors_message():
    import httpx

    refused = httpx.Response(503, json={"error": {"message": "no decode worker " * 20}})
    assert batch_bench.error_message(refused) == ("no decode worker " * 20)[:80]
    assert batch_bench.error_message(httpx.Response(502, text="bad gateway")) == "bad gateway"
