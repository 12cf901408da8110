"""Scheduler shards by tenant, simulated: one scheduler for the whole cluster against N, each
owning a disjoint slice of the workers and the tenants hashed to it.

Where one scheduler process cannot carry a deployment, the gateway can hash a request's tenant
to one of N schedulers, each with its own workers (nothing is shared, the core is unchanged).
Fair share then holds within a shard only, and a shard's workers cannot help the other's queue:
this replays one workload through both layouts in the simulator (the real core in each shard) and
prints latency, errors and how the load split. `--skew` draws tenants from a Zipf law, so that a
few heavy tenants can make one shard busier than the other.

    .venv/bin/python -m loadtest.plan_shards --workload poisson:rate=0.1,n=200,prompt=8-512,\\
        output=1-64,tenants=100 --prefill 4 --decode 4 --shards 2 [--skew 1.2]
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import sys
import zlib

from loadtest.metrics import RequestRecord, Summary, summarize
from loadtest.plan import DEFAULT_PROFILE
from loadtest.plan_search import to_records
from services.planner.profile import ProfileError, WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import SimRequest, WorkloadError, load_workload


def shard_of(tenant: str, num_shards: int) -> int:
    """The shard a tenant's requests go to: a hash every gateway computes alike."""
    return zlib.crc32(tenant.encode()) % num_shards


def split(total: int, num_shards: int) -> list[int]:
    """Workers per shard, as even as they go (the first shards take the remainder)."""
    return [total // num_shards + (i < total % num_shards) for i in range(num_shards)]


def with_zipf_tenants(
    requests: list[SimRequest], num_tenants: int, skew: float, seed: int
) -> list[SimRequest]:
    """The same requests, tenants drawn with weight 1/rank**skew (0: uniformly)."""
    rng = random.Random(seed)
    weights = [1.0 / (rank**skew) for rank in range(1, num_tenants + 1)]
    tenants = rng.choices([f"tenant{i}" for i in range(num_tenants)], weights, k=len(requests))
    return [dataclasses.replace(r, tenant=t) for r, t in zip(requests, tenants, strict=True)]


@dataclasses.dataclass
class ShardedRun:
    summary: Summary  # all shards' requests together
    num_requests: list[int]  # per shard
    num_prompt_tokens: list[int]  # per shard
    num_events: int


def simulate(
    profile: WorkerProfile,
    requests: list[SimRequest],
    num_prefill: int,
    num_decode: int,
    num_shards: int,
) -> ShardedRun:
    """Each shard simulated on its own (its workers, its tenants' requests), then summed."""
    prefills, decodes = split(num_prefill, num_shards), split(num_decode, num_shards)
    if min(prefills + decodes) < 1:
        raise ValueError(
            f"{num_shards} shards need at least {num_shards} prefill and {num_shards} decode "
            f"workers, got {num_prefill} and {num_decode}"
        )
    by_shard: list[list[SimRequest]] = [[] for _ in range(num_shards)]
    for request in requests:
        by_shard[shard_of(request.tenant, num_shards)].append(request)
    records, num_events = [], 0
    for shard, shard_requests in enumerate(by_shard):
        if not shard_requests:
            continue
        config = SimConfig(prefills[shard], decodes[shard])
        result = Simulator(profile, config).run(shard_requests)
        records += on_workload_clock(to_records(result), result.clock_origin_s)
        num_events += result.num_events
    return ShardedRun(
        summary=summarize(records),
        num_requests=[len(r) for r in by_shard],
        num_prompt_tokens=[sum(r.num_prompt_tokens for r in rs) for rs in by_shard],
        num_events=num_events,
    )


def on_workload_clock(records: list[RequestRecord], origin_s: float) -> list[RequestRecord]:
    """A shard's records on the workload's clock (each shard's simulated clock starts at its
    own first arrival): merged, the run's wall time spans them all."""

    def moved(time_s: float | None) -> float | None:
        return None if time_s is None else time_s + origin_s

    return [
        dataclasses.replace(
            r,
            send_time=moved(r.send_time),
            first_token_time=moved(r.first_token_time),
            finish_time=moved(r.finish_time),
            failure_time=moved(r.failure_time),
        )
        for r in records
    ]


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def report(runs: dict[int, ShardedRun]) -> str:
    lines = [
        "shards  ttft p50/p99 s   tpot p50/p99 s   e2e p99 s  errors  out tok/s"
        "  requests per shard  prompt tokens per shard"
    ]
    for num_shards, run in runs.items():
        s = run.summary
        lines.append(
            f"{num_shards:>6}  {_s(s.ttft_p50):>6}/{_s(s.ttft_p99):<7}  "
            f"{_s(s.tpot_p50):>6}/{_s(s.tpot_p99):<7}  {_s(s.e2e_p99):>9}  {s.num_errors:>6}  "
            f"{s.output_tokens_per_s:>9.1f}  {'/'.join(map(str, run.num_requests)):>18}  "
            f"{'/'.join(map(str, run.num_prompt_tokens)):>23}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", required=True, help="poisson:... or a bench JSONL file")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument("--prefill", type=int, required=True, help="prefill workers in all")
    parser.add_argument("--decode", type=int, required=True, help="decode workers in all")
    parser.add_argument("--shards", type=int, default=2)
    parser.add_argument("--tenants", type=int, help="redraw the tenants: this many (with --skew)")
    parser.add_argument("--skew", type=float, default=0.0, help="Zipf exponent of the tenants")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.shards < 2:
        parser.error(f"--shards must be at least 2, got {args.shards}")
    if args.skew < 0 or (args.tenants is not None and args.tenants < 1):
        parser.error("--skew must be >= 0 and --tenants at least 1")
    try:
        profile = WorkerProfile.load(args.profile)
        requests = load_workload(args.workload)
    except (ProfileError, WorkloadError) as error:
        parser.error(str(error))
    if args.tenants is not None:
        requests = with_zipf_tenants(requests, args.tenants, args.skew, args.seed)
    try:
        runs = {
            n: simulate(profile, requests, args.prefill, args.decode, n) for n in (1, args.shards)
        }
    except ValueError as error:
        parser.error(str(error))
    print(report(runs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
