"""Fairness scenarios: the fair-share policy against FCFS, each on its own `tandem up`, one run.

    .venv/bin/python -m loadtest.fairness_bench flood [--duration 60] [--json OUT]
    .venv/bin/python -m loadtest.fairness_bench tenants [--duration 60] [--json OUT]

flood: closed-loop clients keep long prompts in the queue (prefill saturated), while short chat
requests arrive at a steady rate. Reports the shorts' TTFT p50/p99 with the flood under each
policy and alone (no flood, same cluster settings), and the longest queue wait the scheduler saw
(`/ready`'s `scheduler.max_queue_wait_s`), against the aging bound. The percentiles are over the
shorts that succeeded, reported with their number (n) and the shorts that failed: a run of 60 s
at one short per 1.5 s has about 40, so its p99 lies between the two largest (near the max), and
a p99 that a failed short would hold (see loadtest/metrics.py) reads "n/a".

tenants: tenant "heavy" sends ten times the request rate of tenant "light", both above what the
cluster serves, so both stay backlogged. Reports each tenant's token service after a warm-up until
the deadline (the scheduler's per-party counters), and Jain's fairness index of the two; requests
still queued at the deadline are cancelled.

All traffic goes to 127.0.0.1, bounded by the duration. Settings reach the cluster's children as
`TANDEM_*` environment variables (the policy, the prefill budget and step time target, the aging
bound).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx

from loadtest.client import send_one
from loadtest.metrics import Clock, RequestRecord, beyond_successes, percentile
from loadtest.served import ServedCluster, environment, tandem_up
from loadtest.workload import WorkloadRequest

MODEL = "smollm2"


@dataclass
class Traffic:
    """What one client-side run recorded, by label ("short", "long", a tenant)."""

    records: dict[str, list[RequestRecord]] = field(default_factory=dict)

    def add(self, label: str, record: RequestRecord) -> None:
        self.records.setdefault(label, []).append(record)

    def ttfts(self, label: str) -> list[float]:
        return [r.ttft for r in self.records.get(label, []) if r.ok and r.ttft is not None]

    def failed(self, label: str) -> int:
        return sum(1 for r in self.records.get(label, []) if not r.ok)

    def errors(self) -> int:
        return sum(1 for records in self.records.values() for r in records if not r.ok)


def ttft_figures(traffic: Traffic, label: str) -> dict[str, Any]:
    """A label's TTFT p50/p99 over its successes, their number and the failures."""
    ttfts, failed = traffic.ttfts(label), traffic.failed(label)
    return {
        f"{label}_requests": len(ttfts),  # the samples behind the percentiles
        f"{label}_failed": failed,
        f"{label}_ttft_p50_s": percentile(ttfts, 50),
        f"{label}_ttft_p99_s": percentile(ttfts, 99),
        f"{label}_ttft_p99_unknown": beyond_successes(len(ttfts), failed, 99),
    }


def prompt_ids(rng: random.Random, num_tokens: int) -> list[int]:
    return [rng.randrange(100, 20000) for _ in range(num_tokens)]


async def send(
    client: httpx.AsyncClient, clock: Clock, prompt: list[int], max_tokens: int, user: str
) -> RequestRecord:
    request = WorkloadRequest("", max_tokens, 0.0, prompt, ignore_eos=True)
    record = RequestRecord(0, max_tokens, len(prompt))
    await send_one(client, MODEL, request, record, clock, False, 600.0, False, user)
    return record


async def closed_loop(
    client: httpx.AsyncClient,
    clock: Clock,
    traffic: Traffic,
    label: str,
    user: str,
    num_tokens: int,
    max_tokens: int,
    deadline: float,
    seed: int,
) -> None:
    """One client that sends its next request as soon as the previous one finished."""
    rng = random.Random(seed)
    while clock() < deadline:
        traffic.add(label, await send(client, clock, prompt_ids(rng, num_tokens), max_tokens, user))


async def steady(
    client: httpx.AsyncClient,
    clock: Clock,
    traffic: Traffic,
    label: str,
    interval_s: float,
    num_tokens: int,
    max_tokens: int,
    deadline: float,
    user: str = "chat",
) -> None:
    """Requests at a fixed interval, each on its own task (open loop). Cancelled, it cancels
    the requests in flight (their connections close, and the cluster cancels them)."""
    rng = random.Random(f"{label}-{user}")
    tasks = []
    try:
        while clock() < deadline:
            prompt = prompt_ids(rng, num_tokens)
            tasks.append(asyncio.create_task(send(client, clock, prompt, max_tokens, user)))
            await asyncio.sleep(interval_s)
        for record in await asyncio.gather(*tasks):
            traffic.add(label, record)
    except asyncio.CancelledError:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


async def scheduler_status(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/ready")).json()["scheduler"]


@contextmanager
def cluster(args: argparse.Namespace, policy: str) -> Iterator[ServedCluster]:
    settings = {
        "TANDEM_POLICY": policy,
        "TANDEM_MAX_NUM_BATCHED_TOKENS": str(args.prefill_budget),
        "TANDEM_MAX_QUEUE_WAIT_S": str(args.aging_s),
    }
    if args.step_time_target is not None:  # otherwise the prefill worker's own default
        settings["TANDEM_STEP_TIME_TARGET_S"] = args.step_time_target
    with (
        environment(settings),
        tandem_up(1, 1, ["--kv-cache-bytes", str(args.kv_cache_bytes)]) as served,
    ):
        yield served


async def flood_run(url: str, args: argparse.Namespace, with_flood: bool) -> dict[str, Any]:
    clock = Clock()
    traffic = Traffic()
    deadline = args.duration if with_flood else args.alone_duration
    limits = httpx.Limits(max_connections=256)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as c:
        jobs = [
            steady(c, clock, traffic, "short", args.short_interval, args.short_tokens, 8, deadline)
        ]
        if with_flood:
            jobs += [
                closed_loop(c, clock, traffic, "long", "batch", args.long_tokens, 4, deadline, i)
                for i in range(args.long_clients)
            ]
        await asyncio.gather(*jobs)
        status = await scheduler_status(c)
    longs = traffic.ttfts("long")
    return {
        **ttft_figures(traffic, "short"),
        "long_requests": len(longs),
        "long_ttft_max_s": max(longs, default=None),
        "max_queue_wait_s": status["max_queue_wait_s"],
        "errors": traffic.errors(),
    }


async def tenants_run(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both tenants send open-loop above their share, so both stay backlogged; service is read
    from the scheduler between the end of the warm-up and the deadline, then the rest is
    cancelled."""
    clock = Clock()
    traffic = Traffic()
    limits = httpx.Limits(max_connections=2048)
    rates = {"heavy": 10 * args.light_rate, "light": args.light_rate}
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits, trust_env=False) as c:
        senders = [
            asyncio.create_task(
                steady(c, clock, traffic, tenant, 1 / rate, args.tenant_tokens, 8, 1e9, tenant)
            )
            for tenant, rate in rates.items()
        ]
        await asyncio.sleep(args.warmup)
        before = await scheduler_status(c)
        await asyncio.sleep(args.duration - args.warmup)
        after = await scheduler_status(c)
        for sender in senders:
            sender.cancel()
        await asyncio.gather(*senders, return_exceptions=True)
    served = {tenant: _served(after, tenant) - _served(before, tenant) for tenant in rates}
    values = list(served.values())
    jain = sum(values) ** 2 / (len(values) * sum(v * v for v in values)) if any(values) else None
    return {"served_tokens": served, "rates_per_s": rates, "jain_index": jain}


def _served(status: dict[str, Any], tenant: str) -> int:
    return sum(p["served_tokens"] for p in status["service"] if p["tenant"] == tenant)


def run_flood(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    with cluster(args, "fair") as served:
        results["alone"] = asyncio.run(flood_run(served.url, args, with_flood=False))
    for policy in ("fcfs", "fair"):
        with cluster(args, policy) as served:
            results[policy] = asyncio.run(flood_run(served.url, args, with_flood=True))
    alone_p99 = results["alone"]["short_ttft_p99_s"]
    alone_known = not results["alone"]["short_ttft_p99_unknown"]
    for policy in ("fcfs", "fair"):
        p99 = results[policy]["short_ttft_p99_s"]
        known = alone_known and not results[policy]["short_ttft_p99_unknown"]
        ratio = p99 / alone_p99 if known and p99 and alone_p99 else None
        results[policy]["short_p99_over_alone"] = ratio
    return results


def run_tenants(args: argparse.Namespace) -> dict[str, Any]:
    results = {}
    for policy in ("fcfs", "fair"):
        with cluster(args, policy) as served:
            results[policy] = asyncio.run(tenants_run(served.url, args))
    return results


def print_flood(results: dict[str, Any], aging_s: float) -> None:
    print(f"{'run':<6} {'shorts n':>8} {'failed':>6} {'TTFT p50 s':>10} {'p99 s':>7} "
          f"{'p99/alone':>9} {'longs':>5} {'max wait s':>10} {'errors':>6}")  # fmt: skip
    for name, r in results.items():
        ratio = r.get("short_p99_over_alone")
        p99 = "n/a" if r.get("short_ttft_p99_unknown") else _f(r["short_ttft_p99_s"])
        print(
            f"{name:<6} {r['short_requests']:>8} {r.get('short_failed', 0):>6} "
            f"{_f(r['short_ttft_p50_s']):>10} {p99:>7} {_f(ratio):>9} {r['long_requests']:>5} "
            f"{_f(r['max_queue_wait_s']):>10} {r['errors']:>6}"
        )
    fewest = min((r["short_requests"] for r in results.values()), default=0)
    if fewest <= 101:
        print(f"p99 of n <= 101 shorts (here as few as {fewest}): between the two largest TTFTs")
    if any(r.get("short_ttft_p99_unknown") for r in results.values()):
        print("n/a: a failed short would hold that p99 (failed ones are in no percentile)")
    print(f"aging bound: {aging_s:g} s")


def print_tenants(results: dict[str, Any]) -> None:
    print(f"{'policy':<6} {'heavy tokens':>12} {'light tokens':>12} {'Jain':>6}")
    for name, r in results.items():
        served = r["served_tokens"]
        print(f"{name:<6} {served['heavy']:>12} {served['light']:>12} {_f(r['jain_index'], 3):>6}")


def _f(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("scenario", choices=["flood", "tenants"])
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of traffic per run")
    parser.add_argument("--alone-duration", type=float, default=30.0, help="flood: shorts alone")
    parser.add_argument(
        "--prefill-budget", type=int, default=512, help="tokens per prefill step (the default's)"
    )
    parser.add_argument(
        "--step-time-target",
        help="seconds a prefill step may take, or none (default: the prefill worker's default)",
    )
    parser.add_argument("--aging-s", type=float, default=30.0, help="the scheduler's aging bound")
    parser.add_argument("--kv-cache-bytes", type=int, default=256 << 20)
    parser.add_argument("--long-tokens", type=int, default=1536)
    parser.add_argument("--long-clients", type=int, default=3)
    parser.add_argument("--short-tokens", type=int, default=48)
    parser.add_argument("--short-interval", type=float, default=1.5)
    parser.add_argument("--tenant-tokens", type=int, default=192)
    parser.add_argument("--light-rate", type=float, default=1.0, help="tenants: light req/s")
    parser.add_argument("--warmup", type=float, default=15.0, help="tenants: before measuring")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    positive = ("duration", "alone_duration", "short_interval", "light_rate")
    counts = ("prefill_budget", "kv_cache_bytes", "long_tokens", "long_clients", "short_tokens",
              "tenant_tokens")  # fmt: skip
    for name in (*positive, *counts):
        if not getattr(args, name) > 0:  # (NaN compares false)
            parser.error(f"--{name.replace('_', '-')} must be > 0")
    if args.scenario == "tenants" and not 0 <= args.warmup < args.duration:
        # Service is read between the warm-up's end and the duration's: an empty window
        # reported 0 tokens to each tenant and no Jain index, after a cluster run per policy.
        parser.error(f"--warmup must be >= 0 and below --duration ({args.duration:g} s)")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.scenario == "flood":
        results = run_flood(args)
        print_flood(results, args.aging_s)
    else:
        results = run_tenants(args)
        print_tenants(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"scenario": args.scenario, "args": vars(args), "results": results}, f, indent=2
            )


if __name__ == "__main__":
    main()
