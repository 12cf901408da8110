"""The scheduler core at scale: decisions per second with a thousand workers per role, a hundred
thousand queued requests and ten thousand tenants, and the time each decision takes.

The core is driven directly (no sockets), the way the simulator drives it: workers register,
the queue is filled, then each round plays one request's life through the messages the service
would hand the core: a decode worker's reservation reply, the prefill's report (which frees its
window: the next request is dispatched), the decode's report (which frees a seat), a new submit
(so the queue stays full), and a heartbeat from a worker taken in turn. A *decision* is one
request dispatched (the policy's choice and its placement). The figures: decisions per second
over the time spent in the core's handlers, and the p50/p99 time of the handler calls that made
decisions, divided by the decisions each made; plus the time of a tick (timeouts and expiry).
Handler times are the thread's CPU time (`time.thread_time`), so that other processes on a
shared machine do not inflate them.

    .venv/bin/python -m loadtest.scheduler_scale [--prefill 1000 --decode 1000 --queued 100000
        --tenants 10000 --rounds 2000] [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time
from collections import deque

from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from shared import wire


def hello(peer_id: str, role: str) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=peer_id,
        model="m",
        address=f"sim://{peer_id}",
        num_kv_blocks=0 if role == "gateway" else 4096,
        block_size=0 if role == "gateway" else 16,
        max_num_seqs=0 if role == "gateway" else 64,
    )


class ScaleBench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.rng = random.Random(args.seed)
        limits = SchedulerLimits(
            max_queued_requests=args.queued * 2,
            max_queued_tokens=1 << 40,
            heartbeat_timeout_s=1e9,
            max_queue_time_s=1e9,
        )
        self.core = ClusterScheduler(limits)
        self.now = 0.0
        self.num_submitted = 0
        self.call_seconds: list[float] = []  # per handler call that made decisions, per decision
        self.busy_s = 0.0
        self.num_decisions = 0
        self.workers = [f"prefill{i}" for i in range(args.prefill)]
        self.workers += [f"decode{i}" for i in range(args.decode)]

    def call(self, handler, *args) -> list:
        before = len(self.core.dispatched)
        start = time.thread_time()
        out = handler(*args, self.now)
        elapsed = time.thread_time() - start
        decisions = len(self.core.dispatched) - before
        self.core.take_dispatched()
        self.busy_s += elapsed
        if decisions:
            self.num_decisions += decisions
            self.call_seconds.extend([elapsed / decisions] * decisions)
        return out

    def submit(self) -> None:
        index = self.num_submitted
        self.num_submitted += 1
        submit = wire.Submit(
            request_id=f"r{index}",
            prompt_token_ids=[0] * self.rng.choice((32, 64, 128, 256, 512, 1500)),
            sampling=wire.SamplingSpec(max_tokens=16),
            tenant=f"tenant{self.rng.randrange(self.args.tenants)}",
            priority=0,
            gateway_peer_id="g",
            arrival_time=self.now,
        )
        self.call(self.core.on_submit, b"g", submit)

    def setup(self) -> None:
        self.core.on_hello(b"g", hello("g", "gateway"), 0.0)
        for peer_id in self.workers:
            role = "prefill" if peer_id.startswith("prefill") else "decode"
            self.core.on_hello(peer_id.encode(), hello(peer_id, role), 0.0)
        in_flight_limit = sum(1 for _ in self.workers) * 64
        for _ in range(self.args.queued + min(in_flight_limit, self.args.queued)):
            self.submit()
            if len(self.core.queue) >= self.args.queued:
                break
        self.busy_s, self.num_decisions, self.call_seconds = 0.0, 0, []

    def by_phase(self) -> dict[Phase, deque[str]]:
        phases: dict[Phase, deque[str]] = {p: deque() for p in Phase}
        for request in self.core.requests.values():
            phases[request.phase].append(request.request_id)
        return phases

    def round(self, phases: dict[Phase, deque[str]], heartbeat_index: int) -> None:
        core = self.core
        self.now += 0.001
        if phases[Phase.RESERVING]:
            request = core.requests.get(phases[Phase.RESERVING].popleft())
            if request is not None and request.phase == Phase.RESERVING:
                reply = wire.ReserveReply(
                    request_id=request.request_id, ok=True, num_free_blocks=4096
                )
                self.call(core.on_reserve_reply, reply)
                phases[Phase.PREFILLING].append(request.request_id)
        if phases[Phase.PREFILLING]:
            request = core.requests.get(phases[Phase.PREFILLING].popleft())
            if request is not None and request.phase == Phase.PREFILLING:
                self.call(core.on_request_done, self.done(request, "prefill"))
                phases[Phase.DECODING].append(request.request_id)
        if len(phases[Phase.DECODING]) > 1000:
            request = core.requests.get(phases[Phase.DECODING].popleft())
            if request is not None:
                self.call(core.on_request_done, self.done(request, "decode"))
        self.submit()
        peer_id = self.workers[heartbeat_index % len(self.workers)]
        heartbeat = wire.Heartbeat(
            peer_id=peer_id,
            num_waiting=0,
            num_running=0,
            num_free_blocks=4096,
            num_total_blocks=4096,
            steps_completed=heartbeat_index,
            sent_at=self.now,
        )
        self.call(core.on_heartbeat, peer_id.encode(), heartbeat)

    def done(self, request, phase: str) -> wire.RequestDone:
        peer_id = request.prefill_peer_id if phase == "prefill" else request.decode_peer_id
        return wire.RequestDone(
            request_id=request.request_id,
            peer_id=peer_id,
            phase=phase,
            finish_reason=None if phase == "prefill" else "length",
            num_prompt_tokens=0,
            num_output_tokens=1 if phase == "prefill" else 15,
        )

    def run(self) -> dict:
        setup_start = time.perf_counter()
        self.setup()
        setup_s = time.perf_counter() - setup_start
        phases = self.by_phase()
        for index in range(self.args.rounds):
            for _ in range(4):  # new requests arrive and leave; the queue stays full
                self.round(phases, index)
        tick_start = time.perf_counter()
        self.core.tick(self.now)
        tick_s = time.perf_counter() - tick_start
        ordered = sorted(self.call_seconds)
        return {
            "num_prefill": self.args.prefill,
            "num_decode": self.args.decode,
            "num_queued": len(self.core.queue),
            "num_tenants": self.args.tenants,
            "num_decisions": self.num_decisions,
            "decisions_per_s": self.num_decisions / self.busy_s if self.busy_s else 0.0,
            "decision_p50_ms": statistics.median(ordered) * 1e3 if ordered else None,
            "decision_p99_ms": ordered[int(0.99 * (len(ordered) - 1))] * 1e3 if ordered else None,
            "tick_ms": tick_s * 1e3,
            "setup_s": setup_s,
        }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prefill", type=int, default=1000)
    parser.add_argument("--decode", type=int, default=1000)
    parser.add_argument("--queued", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--profile", action="store_true", help="cProfile the rounds: top 25")
    args = parser.parse_args(argv)
    for name in ("prefill", "decode", "queued", "tenants", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    bench = ScaleBench(args)
    if args.profile:
        profiler = cProfile.Profile()
        result = profiler.runcall(bench.run)
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)
    else:
        result = bench.run()
    for key, value in result.items():
        print(f"{key:>18}: {value:,.3f}" if isinstance(value, float) else f"{key:>18}: {value:,}")


if __name__ == "__main__":
    main()
