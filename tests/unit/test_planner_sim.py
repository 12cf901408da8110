"""The capacity simulator: the real scheduler core driven by simulated workers and time."""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import signal

import pytest

from services.planner.events import EventQueue
from services.planner.profile import (
    ProfileError,
    SharedCores,
    WorkerProfile,
    WorkerSettings,
    _interpolate,
)
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import SimRequest, WorkloadError, load_workload
from services.scheduler import lazy_heap
from services.scheduler.core import SchedulerLimits


def fixed_profile(**settings) -> WorkerProfile:
    """Constant times: a prefill step 0.5 s, a decode step 0.375 s, a transfer 0.125 s latency
    plus 1,024 tokens/s (binary fractions, so the hand-computed answers are exact)."""
    return WorkerProfile(
        prefill_tokens=[16],
        prefill_seconds=[0.5],
        decode_batch_sizes=[1],
        decode_contexts=[16],
        decode_seconds=[[0.375]],
        kv_bytes_per_token=1,
        transfer_latency_s=0.125,
        transfer_bytes_per_s=1024.0,
        settings=WorkerSettings(step_time_target_s=None, **settings),
    )


def cpu_like_profile(**settings) -> WorkerProfile:
    return WorkerProfile(
        prefill_tokens=[16, 128, 512],
        prefill_seconds=[0.05, 0.35, 1.4],
        decode_batch_sizes=[1, 8, 32, 64],
        decode_contexts=[128, 1024],
        decode_seconds=[[0.08, 0.09], [0.15, 0.2], [0.4, 0.5], [0.7, 0.9]],
        kv_bytes_per_token=46080,
        transfer_latency_s=0.002,
        transfer_bytes_per_s=2e9,
        settings=WorkerSettings(**settings),
    )


def test_a_tiny_scenario_answered_by_hand():
    requests = [
        SimRequest(arrival_time=0.0, num_prompt_tokens=128, max_tokens=4),
        SimRequest(arrival_time=0.125, num_prompt_tokens=128, max_tokens=2),
        SimRequest(arrival_time=2.0, num_prompt_tokens=16, max_tokens=1),
    ]
    result = Simulator(fixed_profile(), SimConfig(1, 1)).run(requests)
    a, b, c = result.records
    # A: prefill 0-0.5 (first token), KV 0.5-0.75, decode steps end 1.125, 1.5, 1.875.
    assert (a.first_token_time, a.finish_time, a.completion_tokens) == (0.5, 1.875, 4)
    # B waits for A's prefill step: 0.5-1.0; KV arrives at 1.25, mid-step; joins at 1.5.
    assert (b.first_token_time, b.finish_time, b.completion_tokens) == (1.0, 1.875, 2)
    # C finishes at its first token: no decode at all.
    assert (c.first_token_time, c.finish_time, c.completion_tokens) == (2.5, 2.5, 1)
    assert result.wall_s == 2.5
    assert result.prefill_stats["prefill0"].busy_s == 1.5
    assert result.decode_stats["decode0"].num_steps == 3
    assert result.decode_stats["decode0"].busy_s == 3 * 0.375
    assert result.utilization("prefill") == 1.5 / 2.5
    assert all(r.error is None and r.num_ends == 1 for r in result.records)


@contextlib.contextmanager
def within_seconds(seconds: float):
    """Fails what runs longer (a simulation that would tick for days fails, not hangs)."""

    def expire(*_: object) -> None:
        raise TimeoutError(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def lifecycles(result) -> list[tuple]:
    """Each request's latencies and outcome, whenever its clock started."""
    return [
        (
            r.first_token_time - r.send_time,
            r.finish_time - r.send_time,
            r.completion_tokens,
            r.error,
        )
        for r in result.records
    ]


def rounded(lives: list[tuple]) -> list[tuple]:
    return [tuple(round(x, 9) if isinstance(x, float) else x for x in life) for life in lives]


@pytest.mark.parametrize("offset", [1024.0, 1_700_000_000.0])
def test_arrivals_given_as_unix_timestamps_are_simulated_from_the_first(offset):
    # A production log's arrival times are Unix timestamps: the idle cluster ticked and
    # heartbeated its way to 1.7e9 s (some 8,500 simulated seconds per CPU second: days).
    given = [(0.0, 128, 4), (0.125, 128, 2), (2.0, 16, 1)]
    base = Simulator(fixed_profile(), SimConfig(1, 1)).run(
        [SimRequest(t, prompt, out) for t, prompt, out in given]
    )
    with within_seconds(10):
        late = Simulator(fixed_profile(), SimConfig(1, 1)).run(
            [SimRequest(offset + t, prompt, out) for t, prompt, out in given]
        )
    # The same answers, to the bit: the same lives, steps and timeline from the first arrival.
    assert lifecycles(late) == lifecycles(base)
    assert (late.wall_s, late.num_events) == (base.wall_s, base.num_events)
    assert late.prefill_stats == base.prefill_stats and late.decode_stats == base.decode_stats
    assert len(late.queue_timeline) == len(base.queue_timeline)


def test_a_quiet_night_in_a_log_is_jumped_not_ticked_through():
    # A log of two busy spells a week apart: the idle cluster's ticks and heartbeats took
    # minutes of CPU for the week between (and more with every worker).
    spells = [(0.0, 128, 4), (0.125, 128, 2), (2.0, 16, 1)]
    week = 7 * 24 * 3600.0
    requests = [SimRequest(t + start, n, m) for start in (0.0, week) for t, n, m in spells]
    with within_seconds(10):
        result = Simulator(fixed_profile(), SimConfig(4, 4)).run(requests)
    assert all(r.error is None for r in result.records)
    assert result.num_events < 1000 and result.wall_s > week


@pytest.mark.parametrize("latency_s", [0.0, 0.125])
def test_jumping_the_idle_clock_changes_no_answer(latency_s):
    """Over a quiet cluster nothing happens but ticks and heartbeats, so jumping them changes
    nothing: the same lives, steps and statistics as ticking through, in fewer events."""
    base = load_workload("poisson:rate=4,n=30,prompt=16-512,output=1-32,tenants=3,prefix=64")
    later = load_workload("poisson:rate=4,n=30,prompt=16-512,output=1-32,tenants=3,seed=1")
    gaps = [dataclasses.replace(r, arrival_time=r.arrival_time + 900.0) for r in later]
    results = [
        Simulator(
            cpu_like_profile(),
            SimConfig(2, 2, network_latency_s=latency_s, prefix_cache=True, skip_idle=skip),
        ).run(base + gaps)
        for skip in (False, True)
    ]
    ticked, jumped = results
    assert lifecycles(jumped) == lifecycles(ticked)
    assert [r.send_time for r in jumped.records] == [r.send_time for r in ticked.records]
    assert jumped.prefill_stats == ticked.prefill_stats
    assert jumped.decode_stats == ticked.decode_stats
    assert jumped.wall_s == ticked.wall_s and jumped.num_events < ticked.num_events / 2


def test_idle_time_before_the_first_arrival_changes_no_answer():
    # What the clock skips (whole heartbeat intervals of an idle cluster) is what the ticks
    # did before: the overloaded Poisson run, late by 100 s, is the run on time.
    requests = load_workload("poisson:rate=4,n=40,prompt=16-512,output=1-32,tenants=3")
    shifted = [dataclasses.replace(r, arrival_time=r.arrival_time + 100.0) for r in requests]
    base = Simulator(cpu_like_profile(), SimConfig(1, 1)).run(requests)
    late = Simulator(cpu_like_profile(), SimConfig(1, 1)).run(shifted)
    assert rounded(lifecycles(late)) == rounded(lifecycles(base))
    assert late.num_events == base.num_events


def test_a_chunk_after_context_takes_longer_by_the_profiles_cost_per_pair():
    # 48 prompt tokens in chunks of 16: after 0, 16 and 32 tokens of context. At 1/1024 s a
    # pair the steps take 0.5, 0.75 and 1.0 s (0.5 s each without the cost).
    profile = dataclasses.replace(fixed_profile(), prefill_s_per_context_pair=1 / 1024)
    config = SimConfig(1, 1, max_num_batched_tokens=16)
    request = SimRequest(arrival_time=0.0, num_prompt_tokens=48, max_tokens=1)
    (record,) = Simulator(profile, config).run([request]).records
    assert record.first_token_time == 0.5 + 0.75 + 1.0
    (record,) = Simulator(fixed_profile(), config).run([request]).records
    assert record.first_token_time == 1.5
    assert profile.slowed(prefill=2.0).prefill_time(16, 16 * 16) == 2 * 0.75


def test_shared_cores_time_a_step_by_how_many_are_busy():
    """The tiny scenario with a profile twice as slow whenever two workers step at once."""
    alone = fixed_profile()
    shared = SharedCores((alone, alone.slowed(prefill=2.0, decode=2.0)))
    assert shared.profile_for(3) is shared.profiles[1] and shared.profile_for(1) is alone
    requests = [
        SimRequest(arrival_time=0.0, num_prompt_tokens=128, max_tokens=4),
        SimRequest(arrival_time=0.125, num_prompt_tokens=128, max_tokens=2),
        SimRequest(arrival_time=2.0, num_prompt_tokens=16, max_tokens=1),
    ]
    result = Simulator(alone, SimConfig(1, 1), shared).run(requests)
    a, b, c = result.records
    # A's first decode step starts at 0.75 while B's prefill runs (0.5-1.0): twice as long,
    # 0.75-1.5; the next two alone: 1.875, 2.25.
    assert (a.first_token_time, a.finish_time) == (0.5, 2.25)
    assert (b.first_token_time, b.finish_time) == (1.0, 1.875)  # its prefill began alone
    # C's prefill starts at 2.0, inside A's last decode step: 1.0 s instead of 0.5.
    assert (c.first_token_time, c.finish_time) == (3.0, 3.0)
    assert result.decode_stats["decode0"].busy_s == 0.75 + 2 * 0.375
    with pytest.raises(ProfileError, match="alone"):
        SharedCores(())
    # Profiles of other settings or another model: the workers' blocks, budget and pool are
    # the first's, and the others' times would be of different work.
    for other in (fixed_profile(block_size=32), dataclasses.replace(alone, kv_bytes_per_token=2)):
        with pytest.raises(ProfileError, match="settings"):
            SharedCores((alone, other))


def test_a_decode_worker_answers_reservations_between_its_steps():
    """B arrives at 0.875, inside A's first decode step (0.75-1.125): without speculative
    prefill its prefill waits for the reservation, answered at that step's end."""
    requests = [
        SimRequest(arrival_time=0.0, num_prompt_tokens=128, max_tokens=4),
        SimRequest(arrival_time=0.875, num_prompt_tokens=16, max_tokens=2),
    ]
    config = SimConfig(1, 1, limits=SchedulerLimits(speculative_prefill=False))
    a, b = Simulator(fixed_profile(), config).run(requests).records
    assert (a.first_token_time, a.finish_time) == (0.5, 1.875)
    # Prefill 1.125-1.625; KV (16 tokens) lands at 1.765625, mid-step; decodes 1.875-2.25.
    assert (b.first_token_time, b.finish_time) == (1.625, 2.25)


def test_the_gateways_first_token_limit_is_played():
    requests = [
        SimRequest(arrival_time=0.0, num_prompt_tokens=128, max_tokens=4),
        SimRequest(arrival_time=0.125, num_prompt_tokens=128, max_tokens=2),
    ]
    config = dataclasses.replace(SimConfig(1, 1), first_token_timeout_s=0.75)
    sim = Simulator(fixed_profile(), config)
    a, b = sim.run(requests).records
    # A as in the tiny scenario; B's first token would come at 1.0, 0.875 s after it arrived.
    assert (a.first_token_time, a.finish_time, a.error) == (0.5, 1.875, None)
    assert b.error.startswith("504") and b.finish_time == 0.125 + 0.75
    assert b.first_token_time is None and b.num_ends == 1
    assert "r1" not in sim.core.requests and "r1" in sim.core.abandoned  # cancelled there too


@pytest.mark.parametrize(("latency_s", "limit_s"), [(0.0, 0.5), (0.125, 0.875)])
def test_a_token_after_the_gateways_504_ends_nothing_again(latency_s, limit_s):
    """A one-token request whose prefill ends at its 504, or after it while the cancel is still
    on its way to the worker: the gateway has closed its stream and drops the token, so the
    request ends once, a 504 without a first token."""
    requests = [
        SimRequest(arrival_time=0.0, num_prompt_tokens=16, max_tokens=1),
        SimRequest(arrival_time=0.25, num_prompt_tokens=16, max_tokens=1),  # keeps it running
    ]
    config = SimConfig(1, 1, network_latency_s=latency_s, first_token_timeout_s=limit_s)
    timed_out = Simulator(fixed_profile(), config).run(requests).records[0]
    assert timed_out.error.startswith("504") and timed_out.finish_time == limit_s
    assert timed_out.num_ends == 1 and timed_out.first_token_time is None


def test_the_core_refuses_what_would_outwait_the_deadline_in_simulation_too():
    limits = SchedulerLimits(max_queued_requests=10_000, refuse_past_deadline=True)
    config = SimConfig(1, 1, limits=limits, first_token_timeout_s=10.0)
    # 16 a second for 25 s where about 6 a second are served: without the limit all are
    # served, the last first tokens 46 s late; with it (10 s), 169 served within 7.3 s and
    # 231 refused at once, none timed out.
    requests = [
        SimRequest(arrival_time=i / 16, num_prompt_tokens=64, max_tokens=4) for i in range(400)
    ]
    result = Simulator(cpu_like_profile(max_num_seqs=32), config).run(requests)
    errors = [r.error for r in result.records if r.error]
    assert sum("429" in e and "deadline" in e for e in errors) > 150, errors[:3]
    assert not any("504" in e for e in errors)
    assert all(r.num_ends == 1 for r in result.records)
    no_limit = dataclasses.replace(config, first_token_timeout_s=None)
    result = Simulator(cpu_like_profile(max_num_seqs=32), no_limit).run(requests)
    assert not any(r.error for r in result.records)  # all queued, all served, late
    assert max(r.first_token_time - r.send_time for r in result.records) > 30


def busy_workload(seed: int) -> list[SimRequest]:
    spec = f"poisson:rate=6,n=240,prompt=8-1024,output=1-256,tenants=5,seed={seed}"
    return load_workload(spec)


def run_busy(seed: int, **config) -> object:
    # A small KV pool (preemptions) and a short queue bound (refusals) exercise every path.
    limits = SchedulerLimits(max_queued_requests=64, max_queue_time_s=30.0)
    defaults = dict(num_prefill=2, num_decode=2, limits=limits, num_kv_blocks=160)
    sim = Simulator(cpu_like_profile(max_num_seqs=32), SimConfig(**{**defaults, **config}))
    return sim.run(busy_workload(seed))


def test_deterministic_for_a_seed():
    first, again, other = run_busy(1), run_busy(1), run_busy(2)
    assert first.records == again.records
    assert first.num_events == again.num_events
    assert first.queue_timeline == again.queue_timeline
    assert first.records != other.records


def test_conservation_laws():
    result = run_busy(3)
    assert len(result.records) == 240
    assert all(r.num_ends == 1 for r in result.records), "every request ends exactly once"
    errors = {r.error.split(":")[0] for r in result.records if r.error}
    assert errors, "the scenario is meant to overload the cluster"
    assert result.num_preemptions > 0, "the scenario is meant to fill the KV pools"
    for stats in [*result.prefill_stats.values(), *result.decode_stats.values()]:
        assert 0 < stats.busy_s <= result.wall_s
    for record in result.records:
        if record.error is None:
            assert record.completion_tokens == record.max_tokens
            assert record.send_time <= record.first_token_time <= record.finish_time


def test_busy_time_counts_only_the_simulated_time():
    """A step still running when the simulation stops (its request ended by the gateway's limit,
    or the run cut short) counts up to the stop: no worker is busy longer than the wall time,
    and no role above 100%."""
    requests = [SimRequest(arrival_time=0.0, num_prompt_tokens=16, max_tokens=2)]
    config = dataclasses.replace(SimConfig(1, 1), first_token_timeout_s=0.25)
    timed_out = Simulator(fixed_profile(), config).run(requests)  # its prefill takes 0.5 s
    assert timed_out.records[0].error.startswith("504") and timed_out.wall_s == 0.25
    assert timed_out.prefill_stats["prefill0"].busy_s == 0.25
    cut = Simulator(cpu_like_profile(), SimConfig(1, 1)).run(busy_workload(3), {"ttft_p99": 2.0})
    assert cut.cut_short is not None and cut.wall_s == cut.cut_at_s - cut.records[0].send_time
    for result in (timed_out, cut):
        for stats in [*result.prefill_stats.values(), *result.decode_stats.values()]:
            assert stats.busy_s <= result.wall_s
        assert 0 < result.utilization("prefill") <= 1 and result.utilization("decode") <= 1


def test_every_worker_heartbeats_on_the_services_timer():
    """The heartbeats of all workers go out in one event a round: each reaches the core every
    interval, the last round's after the simulation's end is never played."""
    interval = 0.25
    sim = Simulator(cpu_like_profile(), SimConfig(3, 2, heartbeat_interval_s=interval))
    requests = [
        SimRequest(arrival_time=0.1 * i, num_prompt_tokens=64, max_tokens=8) for i in range(6)
    ]
    result = sim.run(requests)
    last_round = (sim.now // interval) * interval
    heard = {w.peer_id: w.last_heartbeat for w in sim.core.registry.workers.values()}
    assert set(heard) == {*sim.prefills, *sim.decodes}
    assert set(heard.values()) == {last_round} and last_round >= interval
    assert all(r.error is None for r in result.records)


def test_a_lane_runs_its_events_when_the_heap_would():
    """Events in a lane run in the order (time, then scheduling order) they would from the
    heap, ties with heap events included, also when scheduled while others run."""

    def play(use_lane: bool) -> list[tuple[str, float]]:
        events = EventQueue()
        lane = events.lane() if use_lane else events
        ran: list[tuple[str, float]] = []

        def note(name: str) -> None:
            ran.append((name, events.now))
            if name == "a1":  # scheduled mid-run: after the same-time ones scheduled before
                events.at(events.now, note, "h-late")
                lane.at(events.now + 1.0, note, "a-late")

        events.at(1.0, note, "h1")
        for name, time in (("a0", 0.5), ("a1", 1.0), ("a2", 1.0), ("a3", 2.0)):
            lane.at(time, note, name)
        events.at(1.0, note, "h2")
        events.at(0.5, note, "h0")
        while events.run_next():
            pass
        return ran

    assert play(use_lane=True) == play(use_lane=False)
    assert [name for name, _ in play(use_lane=True)] == [
        "a0",
        "h0",
        "h1",
        "a1",
        "a2",
        "h2",
        "h-late",
        "a3",
        "a-late",
    ]
    events = EventQueue()
    lane = events.lane()
    lane.at(2.0, print)
    with pytest.raises(ValueError, match="time order"):
        lane.at(1.0, print)


def test_finished_requests_leave_no_deadlines_piling_up_in_the_core():
    """The core's phase deadlines (a prefill's is 300 s away) are a lazy heap: a finished
    request's entry is stale, and the heap is rebuilt from the live ones, not left to grow
    with every request served."""
    sim = Simulator(cpu_like_profile(), SimConfig(2, 2))
    requests = [
        SimRequest(arrival_time=0.05 * i, num_prompt_tokens=32, max_tokens=2) for i in range(600)
    ]
    result = sim.run(requests)
    assert all(r.error is None for r in result.records)
    assert len(sim.core._deadlines) <= 2 * len(sim.core.requests) + lazy_heap.REBUILD_SLACK


def test_the_decode_curve_is_bilinear_on_the_measured_grid():
    profile = cpu_like_profile()

    def every_row_then_across(batch_size: float, context: float) -> float:
        rows = profile.decode_seconds
        by_context = [_interpolate(profile.decode_contexts, row, context) for row in rows]
        return max(_interpolate(profile.decode_batch_sizes, by_context, batch_size), 1e-6)

    assert profile.decode_time(8, 1024) == 0.2
    assert profile.decode_time(1, 576) == pytest.approx(0.085)  # halfway along the contexts
    assert profile.decode_time(20, 576) == pytest.approx((0.175 + 0.45) / 2)
    for batch_size in (1, 3, 8, 50, 64, 100):
        for context in (1, 128, 500.5, 1024, 4000):
            expected = every_row_then_across(batch_size, context)
            assert profile.decode_time(batch_size, context) == expected
    one_context = dataclasses.replace(
        profile, decode_contexts=[512], decode_seconds=[[0.1], [0.3], [0.5], [0.9]]
    )
    assert one_context.decode_time(8, 5000) == 0.3
    assert one_context.decode_time(4.5, 10) == pytest.approx(0.2)


def test_a_falling_end_segment_is_not_extended_past_the_measured_range():
    """A noisy profile can time its longest point faster than the one before: extended along
    that segment, a long context's decode step (or a big prefill) came out near zero. Past the
    measured range such a curve stays at its end's value."""
    noisy = dataclasses.replace(
        cpu_like_profile(),
        prefill_tokens=[16, 128, 512, 1024],
        prefill_seconds=[0.05, 0.35, 1.4, 1.3],
        decode_seconds=[[0.093, 0.081], [0.15, 0.2], [0.4, 0.5], [0.7, 0.9]],
    )
    assert noisy.decode_time(1, 8192) == 0.081 and noisy.decode_time(1, 16) == 0.093
    assert noisy.prefill_time(8192) == 1.3
    assert noisy.decode_time(8, 8192) > noisy.decode_time(8, 1024)  # rising: extended
    assert _interpolate([1, 2], [3.0, 1.0], 1.5) == 2.0  # within the range: as measured


def test_more_workers_serve_more():
    small, large = (
        run_busy(4, num_prefill=1, num_decode=1),
        run_busy(4, num_prefill=4, num_decode=4),
    )
    ok_small = sum(r.error is None for r in small.records)
    ok_large = sum(r.error is None for r in large.records)
    assert ok_large > ok_small


@pytest.mark.parametrize(
    "config, message",
    [
        (dict(num_prefill=0, num_decode=1), "at least one prefill"),
        (dict(num_prefill=1, num_decode=1, max_num_batched_tokens=8), "at least 16"),
        (dict(num_prefill=1, num_decode=1, heartbeat_interval_s=0), "heartbeat_interval_s"),
        (dict(num_prefill=1, num_decode=1, first_token_timeout_s=0), "first_token_timeout_s"),
    ],
)
def test_wrong_config_values_are_refused(config, message):
    with pytest.raises(ValueError, match=message):
        SimConfig(**config)


def test_a_profile_slowed_batch_by_batch():
    profile = cpu_like_profile()  # batch sizes 1, 8, 32, 64
    fitted = profile.slowed_by_batch([(16.0, 3.0), (4.0, 2.0)])
    # Constant below the first point and beyond the last; linear between (batch 8: 2 + 1/3).
    assert [row[0] / base[0] for row, base in zip(
        fitted.decode_seconds, profile.decode_seconds, strict=True
    )] == pytest.approx([2.0, 2.0 + 4 / 12, 3.0, 3.0])  # fmt: skip
    assert fitted.prefill_seconds == profile.prefill_seconds
    assert fitted.metadata["slowed_by_batch"] == [[4.0, 2.0], [16.0, 3.0]]
    for bad in ([], [(4.0, 0.0)], [(4.0, 1.0), (4.0, 2.0)]):
        with pytest.raises(ProfileError):
            profile.slowed_by_batch(bad)


def test_the_median_of_profiles_measured_at_once():
    base = cpu_like_profile()
    # One run caught a slow moment at one point, another at another: the median has neither.
    slow_prefill = dataclasses.replace(base, prefill_seconds=[0.05, 0.9, 1.4])
    slow_decode = dataclasses.replace(
        base, decode_seconds=[[0.3, 0.09], *base.decode_seconds[1:]], transfer_latency_s=0.004
    )
    median = WorkerProfile.median_of([slow_prefill, base, slow_decode])
    assert median.prefill_seconds == base.prefill_seconds
    assert median.decode_seconds == base.decode_seconds
    assert median.transfer_latency_s == 0.002 and median.metadata["median_of"] == 3
    # Two: their mean, point by point.
    assert WorkerProfile.median_of([base, slow_prefill]).prefill_seconds[1] == pytest.approx(0.625)
    other_grid = dataclasses.replace(base, prefill_tokens=[16, 128, 1024])
    for wrong in ([], [base, other_grid], [base, cpu_like_profile(block_size=32)]):
        with pytest.raises(ProfileError):
            WorkerProfile.median_of(wrong)


def test_profile_round_trips_and_refuses_bad_files(tmp_path):
    profile = cpu_like_profile()
    path = tmp_path / "p.json"
    profile.save(path)
    assert WorkerProfile.load(path) == profile
    assert profile.prefill_time(320) == pytest.approx(0.35 + (1.4 - 0.35) * 192 / 384)
    assert profile.decode_time(8, 128) == pytest.approx(0.15)
    data = json.loads(path.read_text())
    for change, message in [
        ({"version": 99}, "version"),
        ({"prefill_tokens": [512, 16, 128]}, "increasing"),
        ({"decode_seconds": [[0.1]]}, "decode_seconds"),
        ({"transfer_bytes_per_s": 0}, "positive"),
        ({"surprise": 1}, "fields"),
        ({"prefill_s_per_context_pair": -1e-6}, "non-negative"),
        ({"prefill_s_per_context_pair": float("nan")}, "non-negative"),
        # Settings read as they came: each divided by zero, or failed deep in a simulation.
        ({"settings": {"block_size": 0}}, "settings.block_size"),
        ({"settings": {"max_num_seqs": 0}}, "settings.max_num_seqs"),
        ({"settings": {"max_num_batched_tokens": 8}}, "settings.max_num_batched_tokens"),
        ({"settings": {"kv_cache_bytes": 0}}, "settings.kv_cache_bytes"),
        ({"settings": {"step_time_target_s": -1}}, "settings.step_time_target_s"),
        ({"transfer_latency_s": float("nan")}, "transfer_latency_s"),
        ({"transfer_bytes_per_s": float("inf")}, "positive"),
        # Each ran: a fractional byte count crashed the core, a NaN on an axis timed every
        # step as NaN, a zero batch size or context means nothing.
        ({"kv_bytes_per_token": 46080.5}, "kv_bytes_per_token"),
        ({"kv_bytes_per_token": True}, "kv_bytes_per_token"),
        ({"decode_contexts": [128, float("nan")]}, "decode_contexts"),
        ({"decode_contexts": [128, float("inf")]}, "decode_contexts"),
        ({"decode_batch_sizes": [0, 8, 32, 64]}, "decode_batch_sizes"),
        ({"prefill_tokens": [16, 128, "512"]}, "prefill_tokens"),
    ]:
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(ProfileError, match=message):
            WorkerProfile.load(path)
    del data["prefill_s_per_context_pair"]  # a profile older than the field: no context cost
    path.write_text(json.dumps(data))
    assert WorkerProfile.load(path).prefill_s_per_context_pair == 0.0
    path.write_text("[1, 2]")
    with pytest.raises(ProfileError, match="not a JSON object"):
        WorkerProfile.load(path)


def test_workloads_read_and_refused(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [
        {"prompt": "x" * 40, "max_tokens": 3, "arrival_time": 1.0, "label": "chat"},
        {"prompt": "", "prompt_token_ids": [1, 2, 3], "max_tokens": 2},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines))
    first, second = load_workload(str(path))
    assert (first.num_prompt_tokens, first.max_tokens, first.arrival_time) == (3, 2, 0.0)
    assert (second.num_prompt_tokens, second.label) == (10, "chat")
    generated = load_workload("poisson:rate=2,n=50,prompt=8-64,output=4-4,seed=1")
    assert len(generated) == 50 and all(r.max_tokens == 4 for r in generated)
    assert all(8 <= r.num_prompt_tokens <= 64 for r in generated)
    assert generated == load_workload("poisson:rate=2,n=50,prompt=8-64,output=4-4,seed=1")
    for spec, message in [
        ("poisson:rate=0", "positive"),
        ("poisson:speed=2", "key=value"),
        ("poisson:prompt=9-3", "LOW <= HIGH"),
        ("poisson:n=ten", "workload"),
        (str(tmp_path / "missing.jsonl"), "cannot read"),
    ]:
        with pytest.raises(WorkloadError, match=message):
            load_workload(spec)
    path.write_text('{"prompt": "x", "max_tokens": 0}\n')
    with pytest.raises(WorkloadError, match="w.jsonl:1"):
        load_workload(str(path))
    # Each named the line, but read "w.jsonl:2: 'max_tokens'" or "list indices must be ...".
    for line, message in [
        ('{"prompt": "x"}', r"w.jsonl:2: missing field 'max_tokens'"),
        ('{"max_tokens": 2}', "w.jsonl:2: missing field 'prompt'"),
        ("[1, 2]", r"w.jsonl:2: a request is a JSON object, got list"),
        # A string is true to `bool`: a request marked not streamed was planned as streamed.
        ('{"prompt": "x", "max_tokens": 1, "stream": "false"}', "w.jsonl:2: stream must be"),
    ]:
        path.write_text('{"prompt": "x", "max_tokens": 1}\n' + line + "\n")
        with pytest.raises(WorkloadError, match=message):
            load_workload(str(path))


def test_a_prompt_of_token_ids_is_read_as_its_tokens(tmp_path):
    # The completions API (and `tandem bench`, which sends `prompt` as given) takes a prompt
    # as token ids: counted as text at four characters a token, 2,000 tokens were 500.
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt": list(range(2000)), "max_tokens": 2}) + "\n")
    (request,) = load_workload(str(path))
    assert request.num_prompt_tokens == 2000 and request.prompt(0) == list(range(2000))
    for prompt in ({"text": "x" * 400}, [[1, 2], [3]], 7):  # (no prompt: a dict counted 1)
        path.write_text(json.dumps({"prompt": prompt, "max_tokens": 2}) + "\n")
        with pytest.raises(WorkloadError, match="w.jsonl:1: "):
            load_workload(str(path))


def test_network_latency_delays_first_tokens():
    requests = [SimRequest(arrival_time=0.0, num_prompt_tokens=16, max_tokens=2)]
    near = Simulator(fixed_profile(), SimConfig(1, 1)).run(requests).records[0]
    config = dataclasses.replace(SimConfig(1, 1), network_latency_s=0.125)
    far = Simulator(fixed_profile(), config).run(requests).records[0]
    # submit, reserve, reserve reply and the prefill job each cross the network once
    assert far.first_token_time - near.first_token_time == pytest.approx(4 * 0.125)


def test_a_simulation_makes_no_cyclic_garbage_and_leaves_the_collector_as_it_was():
    """A run pauses the cyclic collector (`shared.gc_policy.collector_paused`): sound only while
    nothing the simulator or the core lets go is in a reference cycle. Overload (refusals,
    queue timeouts, swap preemptions), the gateway's first-token limit (cancels), prefix caches
    (local prefills, grants), network latency and objectives that cut a run short: the
    unreachable objects after each run, the simulator still held, are none."""
    cached = "poisson:rate=2,n=120,prompt=600-1200,output=4-64,prefix=512,tenants=3"
    scenarios = [
        (SimConfig(2, 2, limits=SchedulerLimits(max_queued_requests=64, max_queue_time_s=30.0),
                   num_kv_blocks=160), busy_workload(4), None),
        (SimConfig(1, 1, first_token_timeout_s=2.0), busy_workload(5), None),
        (SimConfig(3, 2, prefix_cache=True, network_latency_s=0.003), load_workload(cached), None),
        (SimConfig(1, 1), busy_workload(6), {"ttft_p99": 0.5}),
    ]  # fmt: skip
    for config, requests, objectives in scenarios:
        sim = Simulator(cpu_like_profile(max_num_seqs=32), config)
        gc.collect()  # the last simulation, let go (its workers and it refer to each other)
        result = sim.run(requests, objectives=objectives)
        assert gc.isenabled()
        assert gc.collect() == 0, config
    assert result.cut_short  # the last one was stopped by its objective
    gc.disable()
    try:
        Simulator(cpu_like_profile(), SimConfig(1, 1)).run(busy_workload(7)[:20])
        assert not gc.isenabled()  # left off, as it was
    finally:
        gc.enable()


def test_when_a_placement_raises_the_simulation_stops_with_its_error():
    """The core fails such a request and goes on (the service logs the error); a simulation,
    which has no log to read, stops on it as on any other bug of the core's."""
    sim = Simulator(fixed_profile(), SimConfig(1, 1))

    def pick_raises(*args):
        raise RuntimeError("injected")

    sim.core.registry.pick_decode = pick_raises  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="injected"):
        sim.run([SimRequest(arrival_time=0.0, num_prompt_tokens=16, max_tokens=2)])
