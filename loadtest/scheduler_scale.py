"""The scheduler core at scale: decisions per second with a thousand workers per role, a hundred
thousand queued requests and ten thousand tenants, and the time each decision takes.

The core is driven directly (no sockets), the way the simulator drives it: workers register,
the queue is filled, then each round plays the messages the service would hand the core in a
steady state: every reservation made since the last round answered, the report of every prefill
that began `--prefill-ms` rounds ago (which frees its window: the next requests are
dispatched), decode reports while more than 1,000 requests decode (or half the decode seats, if
fewer), new submits (as many as left the queue, so it stays full), and the heartbeats due (each
worker's every 500 rounds, as the service asks: four a round with 2,000 workers). So each request
dispatched lives its whole life in the core, nothing times out, and as many requests leave the
prefill windows a round as enter them: the rate the bench settles at is the cluster's, not the
bench's. (Until December 2026 it reported one prefill a round, whatever was dispatched: after a
few thousand rounds every window was full and the rounds made 0.6 decisions each, so the figure
fell with `--rounds`, the per-round heartbeat and tick spread over fewer decisions.)
A *decision* is one request dispatched (the policy's choice and its placement). The figures:
decisions per second over the time spent in the core's handlers (all of them), the p50/p99 time
of the handler calls that made decisions, divided by the decisions each made, the longest
handler call (a garbage collection of the heap lands in one), and each handler's mean time, the
tick's (timeouts and expiry, every 250 rounds: a round is a simulated millisecond) included.
Handler times are the thread's CPU time (`time.thread_time`), so that other processes on a shared
machine do not inflate them. `rounds_cpu_s` is the whole rounds' CPU time, the bench's own work
and the decoding of every SUBMIT included: a collection is charged to whatever allocation
triggers it, inside a handler or not, so what changes the collector's work shows there too.

`--token-ids distinct`: prompts of distinct token ids, as real ones are, instead of one id
repeated (the default). While the wire decoded a prompt to a list, a distinct id was an int object
the queue held and the core's forgetting freed (41 bytes a token in all, 1.6 GiB at 100,000
queued of ~415 tokens) and the repeated one the same small int throughout, which flattered the
core by some 13%; since prompts arrive as int32 arrays (`wire.TokenArray`, 4 bytes a token) the
two cost the same.

`--prefix-cache`: the workers keep prefix caches (as real workers do): each registers a cache
key and its heartbeats carry its whole set of cached block hashes, a few of the 64 system prompts
the requests start with (tenant-salted: tenants share them only with themselves), so the core's
cache-aware placement (`cache_placement.py`) is in play.

    .venv/bin/python -m loadtest.scheduler_scale [--prefill 1000 --decode 1000 --queued 100000
        --tenants 10000 --rounds 1000 --prefill-ms 20] [--prefix-cache] [--gc freeze|default]
        [--token-ids repeated|distinct]
        [--profile] [--indexes auto|native|python]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import resource
import statistics
import time
import zlib
from collections import Counter, deque

from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from services.scheduler.native_indexes import INDEXES
from shared import wire
from shared.engine.prefix_cache import CacheKey, worker_cache_key
from shared.gc_policy import SurvivorFreezer

CACHE_KEY = worker_cache_key(CacheKey("m", "float32", 16), shared_between_tenants=False)
NUM_SYSTEM_PROMPTS = 64  # with --prefix-cache, every prompt starts with one of these
SYSTEM_PROMPT_TOKENS = 32
MAX_NUM_SEQS = 64  # each decode worker's seats
VOCAB = 49152  # the default model's (`--token-ids distinct` draws below it)
FIRST_DISTINCT_ID = 257  # past CPython's cached small ints: every token an object of its own
TICK_EVERY_ROUNDS = 250  # a round is 1 ms: the service ticks every half heartbeat interval
HEARTBEAT_EVERY_ROUNDS = 500  # each worker's (the service's default interval, 0.5 s)


def measured_rate(peer_id: str, beat: int) -> float:
    """A worker's prefill rate as real heartbeats report it: a moving average, its own per
    worker (up to 20% apart: hosts differ) and never the same twice (1% of wobble)."""
    own = 500.0 * (1 + (zlib.crc32(peer_id.encode()) % 1000) / 5000)
    return own * (1 + ((beat * 7919) % 200 - 100) / 10_000)


def hello(peer_id: str, role: str, prefix_cache: bool = False) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=peer_id,
        model="m",
        address=f"sim://{peer_id}",
        num_kv_blocks=0 if role == "gateway" else 4096,
        block_size=0 if role == "gateway" else 16,
        max_num_seqs=0 if role == "gateway" else MAX_NUM_SEQS,
        cache_key=CACHE_KEY if prefix_cache and role != "gateway" else None,
    )


class ScaleBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        # Drawn once, apart from `rng` (the same requests either way); a prompt is a slice, and
        # the core gets fresh int objects anyway: a SUBMIT reaches it decoded from its frames.
        token_rng = random.Random(args.seed + 1)
        self.token_pool = [token_rng.randrange(FIRST_DISTINCT_ID, VOCAB) for _ in range(1 << 16)]
        limits = SchedulerLimits(
            max_queued_requests=args.queued * 2,
            max_queued_tokens=1 << 40,
            heartbeat_timeout_s=1e9,
            max_queue_time_s=1e9,
            indexes=args.indexes,
        )
        self.core = ClusterScheduler(limits)
        self.now = 0.0
        self.num_submitted = 0
        # Requests by where they stand in the play (the core's phases, as the messages went).
        self.reserving: deque[str] = deque()
        self.prefilling: deque[tuple[int, str]] = deque()  # (round it began, request id)
        self.decoding: deque[str] = deque()
        self.max_decoding = min(1000, args.decode * MAX_NUM_SEQS // 2)
        self.freezer: SurvivorFreezer | None = None  # --gc freeze: as the service runs
        self.reset_counts()
        self.cache_seq: dict[str, int] = {}
        self.workers = [f"prefill{i}" for i in range(args.prefill)]
        self.workers += [f"decode{i}" for i in range(args.decode)]

    def call(self, handler, *args) -> list:
        start = time.thread_time()
        out = handler(*args, self.now)
        elapsed = time.thread_time() - start
        dispatched = self.core.take_dispatched()
        self.reserving.extend(d.request_id for d in dispatched)
        self.busy_s += elapsed
        self.max_call_s = max(self.max_call_s, elapsed)
        self.handler_s[handler.__name__] += elapsed
        self.handler_calls[handler.__name__] += 1
        if dispatched:
            self.num_decisions += len(dispatched)
            self.call_seconds.extend([elapsed / len(dispatched)] * len(dispatched))
        return out

    def reset_counts(self) -> None:
        self.call_seconds: list[float] = []  # per handler call that made decisions, per decision
        self.busy_s = 0.0
        self.max_call_s = 0.0
        self.num_decisions = 0
        self.handler_s: Counter[str] = Counter()
        self.handler_calls: Counter[str] = Counter()

    def submit(self) -> None:
        index = self.num_submitted
        self.num_submitted += 1
        length = self.rng.choice((32, 64, 128, 256, 512, 1500))
        if self.args.token_ids == "distinct":
            start = index * 7919 % (len(self.token_pool) - length)
            prompt = self.token_pool[start : start + length]
        else:
            prompt = [0] * length
        tenant = f"tenant{self.rng.randrange(self.args.tenants)}"
        if self.args.prefix_cache:
            prompt[:SYSTEM_PROMPT_TOKENS] = self.system_prompt(tenant)
        submit = wire.Submit(
            request_id=f"r{index}",
            prompt_token_ids=prompt,
            sampling=wire.SamplingSpec(max_tokens=16),
            tenant=tenant,
            priority=0,
            gateway_peer_id="g",
            arrival_time=self.now,
        )
        # As the service receives it: decoded from its frames (outside the handler's time),
        # so the prompt is what the codec hands the core (a `TokenArray`).
        received = wire.decode(wire.encode(submit))
        assert isinstance(received, wire.Submit)
        self.call(self.core.on_submit, b"g", received)

    def system_prompt(self, tenant: str) -> list[int]:
        number = zlib.crc32(tenant.encode()) % NUM_SYSTEM_PROMPTS
        return [1 + number] * SYSTEM_PROMPT_TOKENS

    def cached_hashes(self, peer_id: str) -> list[int]:
        """A worker's cache: the system prompts of a few tenants (its own draw, fixed)."""
        rng = random.Random(peer_id)
        hashes = []
        for _ in range(4):
            tenant = f"tenant{rng.randrange(self.args.tenants)}"
            prompt = self.system_prompt(tenant) + [0]
            hashes += self.core.prefix_index.prompt_hashes(prompt, tenant)
        return hashes

    def setup(self) -> None:
        prefix_cache = self.args.prefix_cache
        self.core.on_hello(b"g", hello("g", "gateway"), 0.0)
        for peer_id in self.workers:
            role = "prefill" if peer_id.startswith("prefill") else "decode"
            self.core.on_hello(peer_id.encode(), hello(peer_id, role, prefix_cache), 0.0)
            if prefix_cache:
                self.core.on_heartbeat(peer_id.encode(), self.heartbeat(peer_id, 0), 0.0)
        in_flight_limit = len(self.workers) * MAX_NUM_SEQS
        for _ in range(self.args.queued + min(in_flight_limit, self.args.queued)):
            self.submit()
            if len(self.core.queue) >= self.args.queued:
                break
        self.round(0)  # the first reservations answered: the steady state from here
        if self.args.gc == "freeze":
            self.freezer = SurvivorFreezer()
        self.reset_counts()

    def beats_due(self, round_index: int) -> range:
        """The heartbeats (numbered from the first) that fall in this round: every worker's
        once in `HEARTBEAT_EVERY_ROUNDS`, spread evenly, taken in turn."""
        num_workers = len(self.workers)
        first = round_index * num_workers // HEARTBEAT_EVERY_ROUNDS
        return range(first, (round_index + 1) * num_workers // HEARTBEAT_EVERY_ROUNDS)

    def round(self, round_index: int) -> None:
        core = self.core
        self.now += 0.001
        reserving, self.reserving = self.reserving, deque()
        for request_id in reserving:
            request = core.requests.get(request_id)
            if request is not None and request.phase == Phase.RESERVING:
                reply = wire.ReserveReply(
                    request_id=request_id,
                    peer_id=request.decode_peer_id,
                    ok=True,
                    num_free_blocks=4096,
                )
                self.call(core.on_reserve_reply, reply)
                self.prefilling.append((round_index, request_id))
        prefilled_by = round_index - self.args.prefill_ms
        while self.prefilling and self.prefilling[0][0] <= prefilled_by:
            request = core.requests.get(self.prefilling.popleft()[1])
            if request is not None and request.phase == Phase.PREFILLING:
                self.call(core.on_request_done, self.done(request, "prefill"))
                self.decoding.append(request.request_id)
        while len(self.decoding) > self.max_decoding:
            request = core.requests.get(self.decoding.popleft())
            if request is not None:
                self.call(core.on_request_done, self.done(request, "decode"))
        while len(core.queue) < self.args.queued:
            self.submit()
        for beat in self.beats_due(round_index):
            peer_id = self.workers[beat % len(self.workers)]
            steps = beat // len(self.workers)
            self.call(core.on_heartbeat, peer_id.encode(), self.heartbeat(peer_id, steps))
        if round_index % TICK_EVERY_ROUNDS == 0:
            self.call(core.tick)
        if self.freezer is not None:  # the service does this on its timer: its time counts
            start = time.thread_time()
            self.freezer.after_collections()
            self.busy_s += time.thread_time() - start

    def heartbeat(self, peer_id: str, steps_completed: int) -> wire.Heartbeat:
        cache = {}
        if self.args.prefix_cache:  # the whole set every time: a full batch
            self.cache_seq[peer_id] = self.cache_seq.get(peer_id, 0) + 1
            cache = dict(
                cache_events_seq=self.cache_seq[peer_id],
                cache_full=True,
                cache_stored=self.cached_hashes(peer_id),
            )
        return wire.Heartbeat(
            peer_id=peer_id,
            num_waiting=0,
            num_running=0,
            num_free_blocks=4096,
            num_total_blocks=4096,
            steps_completed=steps_completed,
            sent_at=self.now,
            prefill_tokens_per_s=measured_rate(peer_id, steps_completed),
            request_ids=self.held_ids(peer_id),
            **cache,
        )

    def held_ids(self, peer_id: str) -> list[str]:
        """What a real worker lists: the requests it holds (every one the core gave it is; the
        core checks a decode worker's list against its own)."""
        worker = self.core.registry.get(peer_id)
        return list(worker.request_ids) if worker is not None else []

    def done(self, request, phase: str) -> wire.RequestDone:
        peer_id = request.prefill_peer_id if phase == "prefill" else request.decode_peer_id
        return wire.RequestDone(
            request_id=request.request_id,
            peer_id=peer_id,
            phase=phase,
            finish_reason=None if phase == "prefill" else "length",
            num_prompt_tokens=0,
            num_output_tokens=1 if phase == "prefill" else 15,
            output_length=None if phase == "prefill" else 16,  # as real workers say it
        )

    def run(self, profiler: cProfile.Profile | None = None) -> dict:
        setup_start = time.perf_counter()
        self.setup()
        setup_s = time.perf_counter() - setup_start
        if profiler is not None:
            profiler.enable()
        rounds_start = time.thread_time()
        try:
            for index in range(self.args.rounds):
                self.round(index)
        finally:
            self.rounds_s = time.thread_time() - rounds_start
            if profiler is not None:
                profiler.disable()
            if self.freezer is not None:
                self.freezer.close()  # the process as it was (a test runs the bench in its own)
        ordered = sorted(self.call_seconds)
        return {
            "num_prefill": self.args.prefill,
            "num_decode": self.args.decode,
            "num_queued": len(self.core.queue),
            "num_tenants": self.args.tenants,
            "prefix_cache": self.args.prefix_cache,
            "gc": self.args.gc,
            "queue_index": self.core.queue.index_kind,
            "decode_room": self.core.registry.decode_room_kind,
            "prefill_room": self.core.registry.prefill_room_kind,
            "num_decisions": self.num_decisions,
            "decisions_per_s": self.num_decisions / self.busy_s if self.busy_s else 0.0,
            "decision_p50_ms": statistics.median(ordered) * 1e3 if ordered else None,
            "decision_p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else None,
            "max_call_ms": self.max_call_s * 1e3,
            **{
                f"{name}_us": self.handler_s[name] / calls * 1e6
                for name, calls in sorted(self.handler_calls.items())
            },
            "setup_s": setup_s,
            "rounds_cpu_s": self.rounds_s,
            "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=1000)
    parser.add_argument("--decode", type=int, default=1000)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--prefill-ms",
        type=int,
        default=20,
        help="rounds (simulated ms) from a prefill's start to its report",
    )
    parser.add_argument("--prefix-cache", action="store_true", help="workers keep prefix caches")
    parser.add_argument(
        "--token-ids",
        choices=("repeated", "distinct"),
        default="repeated",
        help="prompts of one id repeated, or of distinct ids as real prompts are",
    )
    parser.add_argument(
        "--gc",
        choices=("freeze", "default"),
        default="freeze",
        help="garbage collection as the scheduler service runs it (survivors frozen, "
        "shared/gc_policy.py) or Python's default",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="cProfile the rounds: top 25, and the function calls per decision",
    )
    parser.add_argument(
        "--indexes",
        choices=INDEXES,
        default="auto",
        help="the fair queue's and the registry's rooms' indexes: C if it builds, C, or Python",
    )
    args = parser.parse_args(argv)
    for name in ("prefill", "decode", "queued", "tenants", "rounds", "prefill_ms"):
        if getattr(args, name) < 1:
            flag = name.replace("_", "-")
            parser.error(f"--{flag} must be at least 1, got {getattr(args, name)}")
    bench = ScaleBench(args)
    if args.profile:
        profiler = cProfile.Profile()
        result = bench.run(profiler)
        stats = pstats.Stats(profiler)
        stats.sort_stats("tottime").print_stats(25)
        # Noise-free, unlike the times: what a change saves shows here on a busy machine too.
        result["calls_per_decision"] = stats.total_calls / max(1, result["num_decisions"])
    else:
        result = bench.run()
    for key, value in result.items():
        if isinstance(value, (bool, str)):
            print(f"{key:>18}: {value}")
        else:
            print(
                f"{key:>18}: {value:,.3f}" if isinstance(value, float) else f"{key:>18}: {value:,}"
            )


if __name__ == "__main__":
    main()
