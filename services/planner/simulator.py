"""The discrete-event simulator: the real scheduler core, simulated workers, simulated time.

The simulator plays the part of the scheduler service's sockets (`services/scheduler/service.py`):
it hands the core every message a gateway or worker would send, with the simulated clock, and
delivers what the core answers to the simulated peers (after `network_latency_s`). It ticks the
core and sends every worker's heartbeat on the service's timers. Nothing of the scheduler is
re-implemented here: admission, fair share, placement, reservations and timeouts are the core's.

The gateway's part is played too: each request is submitted at its arrival time with the
gateway's first-token deadline (so the core's wait forecast refuses as it would), refused ones
(429, 400, 503) and failed ones (the core's timeout or loss messages) end with an error, one
without a first token `first_token_timeout_s` after its arrival ends with a 504 and is cancelled
in the core, and the first token and the finish come from the simulated workers. Every request
ends exactly once; one still unfinished `drain_s` after the last arrival ends as "unfinished".

The simulated clock starts (at 0) on the heartbeat interval at or before the first arrival: a
workload's arrival times may count from any origin, a production log's Unix timestamps too.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from services.planner.caches import SIM_CACHE_KEY, SimCache
from services.planner.events import EventQueue, Lane
from services.planner.profile import SharedCores, WorkerProfile
from services.planner.slo_watch import SloWatch
from services.planner.workers import SimDecodeWorker, SimPrefillWorker, WorkerStats
from services.planner.workload import SimRequest
from services.scheduler.core import ClusterScheduler, Outgoing, SchedulerLimits
from shared import wire
from shared.gc_policy import collector_paused

GATEWAY = "gateway"


@dataclass(frozen=True)
class SimConfig:
    num_prefill: int
    num_decode: int
    limits: SchedulerLimits = field(default_factory=SchedulerLimits)
    max_num_batched_tokens: int | None = None  # prefill chunk budget (None: the profile's)
    num_kv_blocks: int | None = None  # per decode worker (None: from the profile's pool bytes)
    heartbeat_interval_s: float = 0.5  # as the scheduler service's default
    network_latency_s: float = 0.0  # one way, every message through the scheduler
    drain_s: float = 3600.0  # simulated time after the last arrival before giving up
    # The gateway's limit (its default): no first token this long after arrival is a 504, and
    # the SUBMIT carries it as the deadline the core forecasts against. None: no limit.
    first_token_timeout_s: float | None = 300.0
    # Every worker keeps a prefix cache of its pool's size (`caches.py`), as `tandem up`'s do;
    # off, every prompt is computed whole on a prefill worker.
    prefix_cache: bool = False
    # Over a cluster with nothing to do, jump the clock to just before the next event instead
    # of ticking and heartbeating through (the same answers, tested: a log's quiet night).
    skip_idle: bool = True

    def __post_init__(self) -> None:
        if self.num_prefill < 1 or self.num_decode < 1:
            raise ValueError("a simulated cluster needs at least one prefill and one decode worker")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 16:
            raise ValueError("max_num_batched_tokens must be at least 16")
        if not (self.heartbeat_interval_s > 0 and self.network_latency_s >= 0 and self.drain_s > 0):
            raise ValueError("heartbeat_interval_s and drain_s must be > 0, latency >= 0")
        if self.first_token_timeout_s is not None and not self.first_token_timeout_s > 0:
            raise ValueError("first_token_timeout_s must be > 0 (or None: no limit)")


@dataclass
class SimRecord:
    """One request's lifecycle in simulated seconds (the shape of the bench's records)."""

    index: int
    num_prompt_tokens: int
    max_tokens: int
    label: str
    tenant: str
    send_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    completion_tokens: int | None = None
    error: str | None = None
    num_ends: int = 0  # how often it ended: exactly once, always (a conservation law)
    stream: bool = True  # else one response: its client sees no first token before its end


@dataclass
class SimResult:
    records: list[SimRecord]
    prefill_stats: dict[str, WorkerStats]
    decode_stats: dict[str, WorkerStats]
    wall_s: float  # simulated: first arrival to last end (a run cut short: to the cut)
    queue_timeline: list[tuple[float, int, int]]  # (time, queued, in flight) at each tick
    num_events: int
    real_s: float  # how long the simulation took
    # Stopped once its objectives could no longer be met (`run(objectives=...)`): why, and at
    # what simulated time. Its records are then partly open (no end), its figures a part's.
    cut_short: str | None = None
    cut_at_s: float | None = None
    # The workload's time at the simulated clock's 0 (every time above is on the simulated
    # clock): what to add to compare or merge them with the workload's arrival times.
    clock_origin_s: float = 0.0

    @property
    def num_preemptions(self) -> int:
        return sum(s.num_preemptions for s in self.decode_stats.values())

    def utilization(self, role: str) -> float:
        """Mean busy share of the role's workers over the simulated wall time."""
        stats = self.prefill_stats if role == "prefill" else self.decode_stats
        if self.wall_s <= 0:
            return 0.0
        return sum(s.busy_s for s in stats.values()) / (len(stats) * self.wall_s)

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.real_s if self.real_s > 0 else 0.0


class Simulator:
    def __init__(
        self, profile: WorkerProfile, config: SimConfig, shared_cores: SharedCores | None = None
    ):
        """`shared_cores`: the workers share one machine (a local cluster), each step timed by
        the profile measured with as many busy; None: each has hardware of its own, `profile`."""
        self.profile = profile
        self.config = config
        self.shared_cores = shared_cores
        self.events = EventQueue()
        self.core = ClusterScheduler(config.limits)
        budget = config.max_num_batched_tokens or profile.settings.max_num_batched_tokens
        num_blocks = config.num_kv_blocks or profile.num_kv_blocks
        self.num_kv_blocks = num_blocks  # each worker's, prefill and decode (as its HELLO says)
        self.prefills = {
            f"prefill{i}": SimPrefillWorker(
                f"prefill{i}", profile, self, budget, self._cache(num_blocks)
            )
            for i in range(config.num_prefill)
        }
        self.decodes = {
            f"decode{i}": SimDecodeWorker(
                f"decode{i}", profile, self, num_blocks, cache=self._cache(num_blocks)
            )
            for i in range(config.num_decode)
        }
        self.workers: tuple[SimPrefillWorker | SimDecodeWorker, ...] = (
            *self.prefills.values(),
            *self.decodes.values(),
        )
        self.records: dict[str, SimRecord] = {}
        self.num_open = 0
        self.at = self.events.at  # bound once: every event is scheduled through it
        # Events that come in time order wait in lanes, out of the heap (see events.py).
        self._arrivals = self.events.lane()
        self._first_token_deadlines = self.events.lane()  # a fixed time after each arrival
        self.watch: SloWatch | None = None  # with `run(objectives=...)`
        # Objective, target, its checks' lane, whether only streamed requests have its figure.
        self._waits: list[tuple[int, float, Lane, bool]] = []
        self.queue_timeline: list[tuple[float, int, int]] = []
        self._num_requests = 0
        # The ticks and heartbeats: what an idle cluster does, skipped over a quiet spell.
        self._periodic: set[Callable[..., None]] = {
            self._tick,
            self._heartbeats,
            self._deliver_heartbeats,
        }
        self._ticks_resume_at = 0.0  # (a tick due before it was skipped with the heartbeats)

    def _cache(self, num_blocks: int) -> SimCache | None:
        if not self.config.prefix_cache:
            return None
        return SimCache(self.profile.settings.block_size, num_blocks)

    # -- the Cluster interface the workers use ------------------------------------------------

    @property
    def now(self) -> float:
        return self.events.now

    def to_scheduler(self, message: wire.Message) -> None:
        self.at(self.now + self.config.network_latency_s, self._deliver_to_core, message)

    def first_token(self, request_id: str) -> None:
        record = self.records[request_id]
        # (One ended already, by the gateway's 504 while its cancel was on the way: its
        # stream is closed, the token dropped.)
        if record.first_token_time is None and not record.num_ends:
            record.first_token_time = self.now

    def token_finished(self, request_id: str, num_output_tokens: int) -> None:
        if self.records[request_id].error is not None:
            return  # failed at the gateway (a 504) before its worker heard of the cancel
        self._end(request_id, None, num_output_tokens)

    def kv_arrived(self, decode_peer_id: str, job: wire.PrefillJob) -> None:
        self.decodes[decode_peer_id].on_kv(job)

    def step_profile(self) -> WorkerProfile:
        if self.shared_cores is None:
            return self.profile
        num_busy = 1 + sum(w.stepping for w in self.workers)  # those in a step, and this one
        return self.shared_cores.profile_for(num_busy)

    # -- running ------------------------------------------------------------------------------

    def run(
        self, requests: list[SimRequest], objectives: Mapping[str, float] | None = None
    ) -> SimResult:
        """Plays the workload to its end; with `objectives` ({'ttft_p99': 2.0, ...}), only
        until they can no longer be met (`slo_watch.py`): what happened until then is what a
        whole run would have done."""
        started = time.perf_counter()
        if objectives:
            self._watch_objectives(objectives, requests)
        self._register()
        origin = self._clock_origin(requests)
        arrivals = [r.arrival_time - origin for r in requests]
        # In arrival order; same-time arrivals in the workload's (a stable sort), numbered as
        # they come, so they run in the order one heap entry each would.
        for index in sorted(range(len(requests)), key=arrivals.__getitem__):
            self._arrivals.at(arrivals[index], self._arrive, index, requests[index])
        self.num_open = self._num_requests = len(requests)
        last_arrival = max(arrivals, default=0.0)
        self.at(last_arrival + self.config.drain_s, self._give_up)
        self.at(0.0, self._tick)
        watch = self.watch
        with collector_paused():  # the simulator and the core make no cyclic garbage (tested)
            while self.num_open and self.events.run_next():
                if watch is not None and watch.verdict is not None:
                    break
        # (A whole run stops at its last end, a cut one at the cut: the steps then running
        # count up to the stop, as does the wall time.)
        for worker in self.workers:
            worker.stats.stop_at(self.now)
        records = sorted(self.records.values(), key=lambda r: r.index)
        first = min((r.send_time for r in records), default=0.0)
        return SimResult(
            records=records,
            prefill_stats={p: w.stats for p, w in self.prefills.items()},
            decode_stats={p: w.stats for p, w in self.decodes.items()},
            wall_s=max(self.now - first, 0.0),
            queue_timeline=self.queue_timeline,
            num_events=self.events.num_events,
            real_s=time.perf_counter() - started,
            cut_short=watch.verdict if watch is not None else None,
            cut_at_s=self.now if watch is not None and watch.verdict is not None else None,
            clock_origin_s=origin,
        )

    def _clock_origin(self, requests: list[SimRequest]) -> float:
        """The workload's time the simulated clock starts at: the whole heartbeat intervals
        before its first arrival. The cluster starts idle, and until the first arrival its ticks
        and heartbeats change nothing but the clock, so the answers are those of the workload
        as given (tested); but a production log's arrivals are Unix timestamps (1.7e9 s), which
        the ticks took days to reach, with an ever longer timeline. Whole intervals keep the
        arrivals' phase against the ticks, and (of the default 0.5 s, a binary fraction) come
        off an arrival time exactly."""
        first = min((r.arrival_time for r in requests), default=0.0)
        interval = self.config.heartbeat_interval_s
        origin = math.floor(first / interval) * interval
        return origin - interval if origin > first else origin  # (the division rounded up)

    def _watch_objectives(self, slo: Mapping[str, float], requests: list[SimRequest]) -> None:
        # A request not streamed has no TTFT or TPOT (as the bench's records): e2e alone.
        num_streamed = sum(r.stream for r in requests)
        num_multi_token = sum(r.stream and r.max_tokens >= 2 for r in requests)
        self.watch = SloWatch(slo, len(requests), num_multi_token, num_streamed)
        # Each waiting objective checks every request (streamed, for a TTFT) its target after
        # arrival: in arrival order, so a lane each.
        self._waits = [
            (index, objective.target_s, self.events.lane(), objective.metric == "ttft")
            for index, objective in enumerate(self.watch.objectives)
            if objective.waits
        ]

    def _check_waiting(self, index: int, request_id: str) -> None:
        """Objective `index`'s target has passed since the request arrived: without its first
        token (or its end, for e2e) then, it can only be over."""
        watch, record = self.watch, self.records[request_id]
        assert watch is not None, "only a watched run checks its waits"
        metric = watch.objectives[index].metric
        waiting = record.first_token_time is None if metric == "ttft" else record.num_ends == 0
        if waiting:
            watch.over(index)

    def _register(self) -> None:
        gateway = self._hello(GATEWAY, "gateway", 0)
        self._send(self.core.on_hello(GATEWAY.encode(), gateway, 0.0))
        for peer_id in self.prefills:
            hello = self._hello(peer_id, "prefill", self.num_kv_blocks)
            self._send(self.core.on_hello(peer_id.encode(), hello, 0.0))
        for peer_id, worker in self.decodes.items():
            hello = self._hello(peer_id, "decode", worker.num_total_blocks)
            self._send(self.core.on_hello(peer_id.encode(), hello, 0.0))
        self.at(self.config.heartbeat_interval_s, self._heartbeats)

    def _hello(self, peer_id: str, role: str, num_blocks: int) -> wire.Hello:
        settings = self.profile.settings
        return wire.Hello(
            schema_version=wire.SCHEMA_VERSION,
            role=role,  # type: ignore[arg-type]  # its callers name one of the three
            peer_id=peer_id,
            model="simulated",
            address=f"sim://{peer_id}",
            num_kv_blocks=num_blocks,
            block_size=settings.block_size if role != "gateway" else 0,
            max_num_seqs=settings.max_num_seqs if role != "gateway" else 0,
            cache_key=SIM_CACHE_KEY if self.config.prefix_cache and role != "gateway" else None,
        )

    def _arrive(self, index: int, request: SimRequest) -> None:
        request_id = f"r{index}"
        self.records[request_id] = SimRecord(
            index=index,
            num_prompt_tokens=request.num_prompt_tokens,
            max_tokens=request.max_tokens,
            label=request.label,
            tenant=request.tenant,
            send_time=self.now,
            stream=request.stream,
        )
        submit = wire.Submit(
            request_id=request_id,
            prompt_token_ids=request.prompt(index),
            sampling=wire.SamplingSpec(max_tokens=request.max_tokens, ignore_eos=True),
            tenant=request.tenant,
            priority=request.priority,
            gateway_peer_id=GATEWAY,
            arrival_time=self.now,
            first_token_deadline_s=self.config.first_token_timeout_s,
            bulk=request.bulk,
        )
        self.at(self.now + self.config.network_latency_s, self._deliver_to_core, submit)
        if self.config.first_token_timeout_s is not None:
            due = self.now + self.config.first_token_timeout_s
            self._first_token_deadlines.at(due, self._first_token_due, request_id)
        for index, target_s, lane, streamed_only in self._waits:
            if streamed_only and not request.stream:
                continue
            # Just after the target: a first token (or end) exactly at it is within it.
            due = math.nextafter(self.now + target_s, math.inf)
            lane.at(due, self._check_waiting, index, request_id)

    def _first_token_due(self, request_id: str) -> None:
        """The gateway's first-token limit: a 504, and the request cancelled in the cluster."""
        record = self.records[request_id]
        if record.first_token_time is not None or record.num_ends:
            return
        limit = self.config.first_token_timeout_s
        self._end(request_id, f"504: no first token within {limit:g} s", None)
        self.to_scheduler(wire.Cancel(request_id=request_id, reason="first token timeout"))

    def _tick(self) -> None:
        if self.now < self._ticks_resume_at:  # skipped with the heartbeats (`_next_round`)
            self.at(self._ticks_resume_at, self._tick)
            return
        self._send(self.core.tick(self.now))
        self.queue_timeline.append((self.now, len(self.core.queue), len(self.core.requests)))
        self.at(self.now + self.config.heartbeat_interval_s / 2, self._tick)

    def _heartbeats(self) -> None:
        """Every worker's heartbeat: their timers run in step (all start together), so one event
        sends them all and one delivers them all, in the order one event each would have."""
        beats = [worker.heartbeat() for worker in self.workers]
        self.at(self.now + self.config.network_latency_s, self._deliver_heartbeats, beats)
        self.at(self._next_round(beats), self._heartbeats)

    def _next_round(self, beats: list[wire.Heartbeat]) -> float:
        """When the next heartbeat round is due: an interval on; or, over a cluster with nothing
        to do, the last whole interval but one before the next event (an arrival, a timer), the
        ticks between skipped too. Nothing happens there but ticks and heartbeats that find
        nothing to do, and a production log's quiet night took minutes of them. The round at
        the landing is delivered before the first tick after it, so the core hears from every
        worker (it takes one silent past its heartbeat timeout for dead) before it ticks."""
        interval = self.config.heartbeat_interval_s
        due = self.now + interval
        # (A latency past half an interval would deliver the landing round after that tick.)
        if not self.config.skip_idle or self.config.network_latency_s >= interval / 2:
            return due
        if not self._idle(beats):
            return due
        next_event = self.events.earliest(self._periodic)
        if next_event is None:
            return due
        num_skipped = math.floor((next_event - self.now) / interval) - 1
        if num_skipped < 2:
            return due
        landing = self.now + num_skipped * interval
        self._ticks_resume_at = landing + interval / 2
        return landing

    def _idle(self, beats: list[wire.Heartbeat]) -> bool:
        """Whether the cluster has nothing to do: every request that arrived has ended, the
        core tracks none, and no worker holds one or is in a step."""
        num_ended = self._num_requests - self.num_open
        return (
            len(self.records) == num_ended
            and not self.core.requests
            and not any(b.request_ids or b.num_running or b.num_waiting for b in beats)
            and not any(b.num_swapped for b in beats)
            and not any(worker.stepping for worker in self.workers)
        )

    def _deliver_heartbeats(self, beats: list[wire.Heartbeat]) -> None:
        core = self.core
        for beat in beats:
            self._send(core.on_heartbeat(beat.peer_id.encode(), beat, self.now))

    def _give_up(self) -> None:
        for request_id, record in list(self.records.items()):
            if record.num_ends == 0:
                self._end(request_id, "unfinished when the simulation ended", None)

    # -- messages -----------------------------------------------------------------------------

    def _deliver_to_core(self, message: wire.Message) -> None:
        core, now = self.core, self.now
        match message:
            case wire.Submit():
                out = core.on_submit(GATEWAY.encode(), message, now)
            case wire.Heartbeat():
                out = core.on_heartbeat(message.peer_id.encode(), message, now)
            case wire.ReserveReply():
                out = core.on_reserve_reply(message, now)
            case wire.RequestDone():
                out = core.on_request_done(message, now)
            case wire.Cancel():
                out = core.on_cancel(message, now)
            case _:
                raise TypeError(f"the simulator sends no {type(message).__name__} to the core")
        self._send(out)

    def _send(self, outgoing: list[Outgoing]) -> None:
        self.core.take_dispatched()  # the service logs them; nothing to do here
        failures = self.core.take_placement_failures()
        if failures:  # the core's bug, which the service would log: a simulation stops on it
            raise failures[0][1]
        for item in outgoing:
            when = self.now + self.config.network_latency_s
            self.at(when, self._deliver_to_peer, item.identity.decode(), item.message)

    def _deliver_to_peer(self, peer_id: str, message: wire.Message) -> None:
        if peer_id == GATEWAY:
            self._to_gateway(message)
        elif peer_id in self.prefills:
            self._to_prefill(self.prefills[peer_id], message)
        else:
            self._to_decode(self.decodes[peer_id], message)

    def _to_gateway(self, message: wire.Message) -> None:
        match message:
            case wire.SubmitReply(accepted=False):
                self._end(message.request_id, f"{message.status_code}: {message.message}", None)
            case wire.Tokens():
                for delta in message.deltas:
                    if delta.error is not None:
                        self._end(delta.request_id, f"{delta.finish_reason}: {delta.error}", None)

    def _to_prefill(self, worker: SimPrefillWorker, message: wire.Message) -> None:
        match message:
            case wire.PrefillJob():
                worker.on_job(message)
            case wire.PrefillGrant():
                worker.on_grant(message)
            case wire.Cancel():
                worker.on_cancel(message.request_id)

    def _to_decode(self, worker: SimDecodeWorker, message: wire.Message) -> None:
        match message:
            case wire.Reserve():
                worker.on_reserve(message)
            case wire.PrefillJob():  # it holds all of the prompt but a short suffix
                worker.on_job(message)
            case wire.Cancel():
                worker.on_cancel(message.request_id)

    def _end(self, request_id: str, error: str | None, num_output_tokens: int | None) -> None:
        record = self.records[request_id]
        record.num_ends += 1
        if record.num_ends > 1:
            return  # counted, so a test sees it; the first end stands
        record.finish_time = self.now
        record.error = error
        record.completion_tokens = num_output_tokens
        self.num_open -= 1
        if self.watch is not None:
            if error is not None:
                self.watch.failed(error)
            elif (
                record.stream
                and record.first_token_time is not None
                and num_output_tokens is not None
                and num_output_tokens >= 2
            ):
                # Computed as the bench's records compute it, to the last bit.
                ttft, e2e = record.first_token_time - record.send_time, self.now - record.send_time
                self.watch.finished((e2e - ttft) / (num_output_tokens - 1))
