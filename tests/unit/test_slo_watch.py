"""The planner's watch over a simulation's objectives: it calls a miss exactly when the bench's
percentile must be over the target, never sooner; a watched simulation is the whole one, cut."""

from __future__ import annotations

import pytest

from loadtest.metrics import percentile
from loadtest.plan_search import evaluate, parse_slo
from services.planner.simulator import SimConfig, Simulator
from services.planner.slo_watch import SloWatch, num_over_to_miss, objectives
from services.planner.workload import load_workload
from services.scheduler.core import SchedulerLimits
from tests.unit.test_planner_sim import cpu_like_profile

BUSY = "poisson:rate=8,n=80,prompt=8-512,output=4-64,seed=2"  # 1P1D cannot keep up


@pytest.mark.parametrize("q", [0, 1, 50, 90, 99, 99.9, 100])
def test_the_count_over_a_target_that_settles_a_percentile_is_exact(q):
    """With `num_over_to_miss` values over the target the percentile is over it however the
    rest lie; with one fewer, some values keep it within (the rest low, the over ones just
    over): the watch needs no more than certainty."""
    target = 1.0
    for n in range(1, 120):
        needed = num_over_to_miss(n, q)
        assert 1 <= needed <= n
        for under in (0.0, target):  # the rest as low as can be, and at the target
            values = [target + 1.0] * needed + [under] * (n - needed)
            assert percentile(values, q) > target
        if needed > 1:
            fewer = [target + 1e-12] * (needed - 1) + [0.0] * (n - needed + 1)
            assert percentile(fewer, q) <= target


def test_objectives_read_tandem_plans_slo_keys():
    parsed = objectives(parse_slo("ttft_p99=2s,tpot_p50=100ms,e2e_p90=30s"))
    assert [(o.metric, o.percentile, o.target_s) for o in parsed] == [
        ("ttft", 99.0, 2.0),
        ("tpot", 50.0, 0.1),
        ("e2e", 90.0, 30.0),
    ]
    assert [o.waits for o in parsed] == [True, False, True]
    assert parsed[0].name == "ttft_p99"
    for wrong, message in [
        ({"itl_p99": 1.0}, "ttft|tpot|e2e"),
        ({"ttft_p101": 1.0}, "0-100"),
        ({"ttft_pX": 1.0}, "0-100"),
        ({"ttft_p99": 0.0}, "must be > 0"),
    ]:
        with pytest.raises(ValueError, match=message):
            objectives(wrong)


def test_the_watch_counts_time_per_token_only_over_the_multi_token_requests():
    watch = SloWatch({"tpot_p50": 0.1}, num_requests=10, num_multi_token=4)
    # Of 4 values the median is over 0.1 once 4 - floor(3 * 0.5) = 3 are.
    for tpot in (0.2, None, 0.05, 0.3):  # None: a one-token output, no time per token
        watch.finished(tpot)
    assert watch.verdict is None
    watch.finished(0.11)
    assert watch.verdict == "tpot_p50 can no longer be within 0.1 s (3 requests over it)"
    watch.failed("429: queue full")  # the first verdict stands
    assert watch.verdict.startswith("tpot_p50")
    failing = SloWatch({"ttft_p99": 1.0}, 10, 10)
    failing.failed("504: no first token within 300 s")
    assert failing.verdict == "a request failed (504: no first token within 300 s)"


def test_a_watched_simulation_is_the_whole_one_cut_where_it_can_no_longer_meet():
    """The overloaded 1P1D is cut short, every request that ended before the cut as it ended in
    the whole run, the requests over the target accounted for; a configuration that meets its
    objectives is simulated to the end, exactly as without the watch."""
    requests = load_workload(BUSY)
    slo = parse_slo("ttft_p99=2s")
    whole = Simulator(cpu_like_profile(), SimConfig(1, 1)).run(requests)
    cut = Simulator(cpu_like_profile(), SimConfig(1, 1)).run(requests, slo)
    assert whole.cut_short is None and cut.cut_short.startswith("ttft_p99 can no longer")
    assert cut.cut_at_s < whole.wall_s and cut.num_events < whole.num_events / 2
    ended = [r for r in cut.records if r.num_ends]
    assert 0 < len(ended) < len(requests)
    for record in ended:
        assert record == whole.records[record.index]
    late = [r for r in whole.records if r.first_token_time - r.send_time > 2.0]
    over_by_the_cut = [r for r in late if r.send_time + 2.0 < cut.cut_at_s]
    assert len(over_by_the_cut) == num_over_to_miss(len(requests), 99)
    roomy = SimConfig(4, 4, SchedulerLimits())
    watched = evaluate(cpu_like_profile(), requests, roomy, parse_slo("ttft_p99=60s"), True)
    unwatched = evaluate(cpu_like_profile(), requests, roomy, parse_slo("ttft_p99=60s"))
    assert watched.meets and watched.cut_short is None
    assert watched.summary == unwatched.summary


@pytest.mark.parametrize("slo", ["e2e_p90=8s", "tpot_p50=150ms", "ttft_p50=1s,e2e_p99=60s"])
def test_every_kind_of_objective_cuts_only_a_run_that_misses_it(slo):
    """Whatever the objectives, a cut run is one whose whole run misses them: the verdict names
    an objective the whole run's figure is over."""
    requests = load_workload(BUSY)
    objectives_s = parse_slo(slo)
    whole = evaluate(cpu_like_profile(), requests, SimConfig(1, 1), objectives_s)
    cut = evaluate(cpu_like_profile(), requests, SimConfig(1, 1), objectives_s, True)
    assert not whole.meets and cut.cut_short is not None and not cut.meets
    missed = cut.cut_short.split(" ")[0]
    assert getattr(whole.summary, missed) > objectives_s[missed]
    assert cut.num_events < whole.num_events
