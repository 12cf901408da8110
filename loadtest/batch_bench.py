"""The bulk scenario: N short prompts as one batch job, with a trickle of interactive chats beside.

    python -m loadtest.batch_bench [--num-prompts 10000] [--max-tokens 16] [--url URL]

Against a running cluster (`--url`) or one started here (`tandem up`, on a free port). In one
run, on the same prompts:

1. `alone`: the interactive trickle on an idle cluster: its TTFT p50/p99, and its time per
   output token after the first (TPOT) p50/p99 (`--chat-max-tokens` tokens a chat, 8 by default).
2. `burst`: the first `--burst-prompts` of the prompts (default 1,000: fewer than the
   scheduler's queue holds) fired at once at /v1/completions: the output tokens/s of a burst
   at these lengths, which the batch is compared with. The wait forecast refuses those it
   expects past its share of their first-token limit; the served ones' throughput is the
   reference (how many it admits moves it: see the README).
3. `batch`: the prompts as one batch (Files + Batches API) while the trickle runs: drain time,
   output tokens/s, the trickle's TTFT and TPOT p50/p99, lines lost or duplicated in the output,
   and each worker role's busy fraction from submission to drain
   (`tandem:engine_busy_seconds_total`, the time inside engine steps, over the wall time) and the
   machine's: its cores' time busy
   (user, system, interrupts) over their time, from submission to drain, whatever ran on them,
   so it measures the hardware only for a cluster on this machine with nothing else running.
   With a cluster started here, the trickle's
   TTFT during the job is then split into its parts from the cluster's log
   (`loadtest.ttft_breakdown`).
4. `naive`: the same prompts fired at once at /v1/completions, as a new user would: how many
   were refused (429), how many failed otherwise and how (by the client's exception or the
   HTTP status and message), and, with a second pass that retries each refusal after its
   Retry-After, the drain time and output tokens/s. `--naive-only` runs just this phase.

Prints one JSON object per phase, then the ratios the targets are stated in (the batch's output
tokens/s over the burst's, its interactive TTFT p99 and TPOT p50 over alone's). Timing figures
on a shared machine are noisy: compare phases of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import sys
import time
from collections import Counter
from typing import Any

import httpx
import psutil

from loadtest.served import tandem_up
from loadtest.ttft_breakdown import breakdown
from loadtest.worker_metrics import worker_counters

TRICKLE_PROMPTS = ["Hi! How are you?", "Name a colour.", "What is 2 + 2?", "Say hello."]


def prompts(num: int, phase: str) -> list[str]:
    """Short distinct prompts of a few dozen tokens. Each phase's differ from the second token on,
    so no phase finds another's prompts in the prefix cache."""
    topics = ["rivers", "stars", "bread", "music", "trains", "forests", "numbers", "cities"]
    return [
        f"{phase.capitalize()} class: write one short sentence about {topics[i % len(topics)]}, "
        f"the way a teacher would explain it to pupil number {i}."
        for i in range(num)
    ]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def chat_timing(
    http: httpx.AsyncClient, model: str, prompt: str, max_tokens: int
) -> tuple[float, float | None]:
    """A streamed chat's (TTFT, time per output token after the first; None under two events
    with content)."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True}  # fmt: skip
    started = time.monotonic()
    first = last = None
    num_events = 0
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end: the request completes
            if line.startswith("data:") and '"content"' in line:
                last = time.monotonic() - started
                first = last if first is None else first
                num_events += 1
    if first is None or last is None:
        raise RuntimeError("the stream ended without content")
    return first, (last - first) / (num_events - 1) if num_events > 1 else None


async def trickle(
    http: httpx.AsyncClient, model: str, stop: asyncio.Event, every_s: float, max_tokens: int
) -> list[tuple[float, float | None]]:
    """One interactive chat every `every_s` until `stop`; their (TTFT, TPOT)s."""
    timings: list[tuple[float, float | None]] = []
    tasks = []
    i = 0
    while not stop.is_set():
        prompt = TRICKLE_PROMPTS[i % len(TRICKLE_PROMPTS)]
        tasks.append(asyncio.create_task(chat_timing(http, model, prompt, max_tokens)))
        i += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, tuple):
            timings.append(result)
        else:
            print(f"interactive request failed: {result!r}", file=sys.stderr)
    return timings


def summary(timings: list[tuple[float, float | None]]) -> dict[str, Any]:
    ttfts = [ttft for ttft, _ in timings]
    tpots = [tpot for _, tpot in timings if tpot is not None]

    def rounded(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return value if value is None else round(value, 3)

    return {"num_interactive": len(ttfts),
            "ttft_p50_s": rounded(ttfts, 0.5), "ttft_p99_s": rounded(ttfts, 0.99),
            "tpot_p50_s": rounded(tpots, 0.5), "tpot_p99_s": rounded(tpots, 0.99)}  # fmt: skip


async def busy_seconds(http: httpx.AsyncClient) -> dict[str, tuple[str, float]]:
    """Each worker's time inside engine steps so far, by peer: (role, seconds)."""
    text = (await http.get("/metrics")).text  # the gateway federates every peer's metrics
    return {peer: (c.role, c.busy_s) for peer, c in worker_counters(text).items()}


def busy_fractions(
    before: dict[str, tuple[str, float]], after: dict[str, tuple[str, float]], wall_s: float
) -> dict[str, float]:
    """Each role's mean busy fraction over `wall_s`, from workers present at both ends."""
    by_role: dict[str, list[float]] = {}
    for peer, (role, end) in after.items():
        if peer in before:
            by_role.setdefault(role, []).append((end - before[peer][1]) / wall_s)
    return {
        f"busy_fraction_{role}": round(sum(values) / len(values), 3)
        for role, values in sorted(by_role.items())
    }


def machine_cpu_busy_fraction(before: Any, after: Any) -> float:
    """The share of the machine's core time spent busy between two `psutil.cpu_times()`:
    user, nice, system and interrupts; idle, I/O wait and time stolen by a hypervisor count as
    not busy. (Linux's guest time is already inside user.)"""
    busy_fields = ("user", "nice", "system", "irq", "softirq")
    idle_fields = ("idle", "iowait", "steal")

    def spent(times: Any, fields: tuple[str, ...]) -> float:
        return sum(getattr(times, field, 0.0) for field in fields)

    busy = spent(after, busy_fields) - spent(before, busy_fields)
    idle = spent(after, idle_fields) - spent(before, idle_fields)
    return round(busy / (busy + idle), 3) if busy + idle > 0 else 0.0


async def phase_alone(http: httpx.AsyncClient, model: str, args) -> dict[str, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(
        trickle(http, model, stop, args.trickle_every_s, args.chat_max_tokens)
    )
    await asyncio.sleep(args.alone_s)
    stop.set()
    return {"phase": "alone", **summary(await task)}


async def phase_batch(http: httpx.AsyncClient, model: str, args) -> dict[str, Any]:
    lines = [
        json.dumps(
            {
                "custom_id": f"p{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": model,
                    "prompt": p,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )  # fmt: skip
        for i, p in enumerate(prompts(args.num_prompts, "batch"))
    ]
    data = ("\n".join(lines) + "\n").encode()
    files = {"file": ("bench.jsonl", io.BytesIO(data))}
    uploaded = (await http.post("/v1/files", files=files, data={"purpose": "batch"})).json()
    busy_before = await busy_seconds(http)
    cpu_before = psutil.cpu_times()
    started_at = time.time()
    started = time.monotonic()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}  # fmt: skip
    batch = (await http.post("/v1/batches", json=body)).json()
    stop = asyncio.Event()
    task = asyncio.create_task(
        trickle(http, model, stop, args.trickle_every_s, args.chat_max_tokens)
    )
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.5)
        batch = (await http.get(f"/v1/batches/{batch['id']}")).json()
    drain_s = time.monotonic() - started
    ended_at = time.time()
    busy = busy_fractions(busy_before, await busy_seconds(http), drain_s)
    busy["machine_cpu_busy_fraction"] = machine_cpu_busy_fraction(cpu_before, psutil.cpu_times())
    stop.set()
    timings = await task
    output = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text.splitlines()
    custom_ids = [json.loads(x)["custom_id"] for x in output]
    expected = {f"p{i}" for i in range(args.num_prompts)}
    output_tokens = batch["usage"]["output_tokens"]
    return {
        "phase": "batch", "status": batch["status"], "drain_s": round(drain_s, 1),
        "started_at": round(started_at, 3), "ended_at": round(ended_at, 3),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / drain_s, 1),
        "lines_lost": len(expected - set(custom_ids)),
        "lines_duplicated": len(custom_ids) - len(set(custom_ids)),
        **busy,
        **summary(timings),
    }  # fmt: skip


async def phase_naive(
    http: httpx.AsyncClient, model: str, args, retry: bool, num_prompts: int | None = None
) -> dict[str, Any]:
    """The prompts fired at once; with `retry`, each 429 is sent again after its Retry-After.
    `num_prompts` (default all) takes the first ones: the burst phase."""
    refused = 0
    output_tokens = 0
    failures: Counter[str] = Counter()  # by kind: the client's exception, or the HTTP status

    async def one(prompt: str) -> None:
        nonlocal refused, output_tokens
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        while True:
            try:
                response = await http.post("/v1/completions", json=body)
            except httpx.HTTPError as error:
                failures[type(error).__name__] += 1
                return
            if response.status_code == 429:
                refused += 1
                if not retry:
                    return
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                continue
            if response.status_code != 200:
                failures[f"HTTP {response.status_code}: {error_message(response)}"] += 1
                return
            output_tokens += response.json()["usage"]["completion_tokens"]
            return

    started = time.monotonic()
    name = "burst" if num_prompts else "naive+retry" if retry else "naive"
    await asyncio.gather(*(one(p) for p in prompts(num_prompts or args.num_prompts, name)))
    elapsed = time.monotonic() - started
    return {
        "phase": name, "drain_s": round(elapsed, 1),
        "refused_429": refused, "failed": sum(failures.values()),
        "failures": dict(failures.most_common()), "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
    }  # fmt: skip


def error_message(response: httpx.Response) -> str:
    """The OpenAI-shaped error's message, cut short (kinds of failure, not each one's text)."""
    try:
        return str(response.json()["error"]["message"])[:80]
    except (ValueError, KeyError, TypeError):
        return response.text[:80]


async def run_phases(url: str, args) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        burst = functools.partial(
            phase_naive, retry=False, num_prompts=min(args.burst_prompts, args.num_prompts)
        )
        phases = [] if args.naive_only else [phase_alone, burst, phase_batch]
        if args.naive_only or not args.skip_naive:
            phases.append(functools.partial(phase_naive, retry=False))
            if not args.skip_naive_retry:
                phases.append(functools.partial(phase_naive, retry=True))
        results = []
        for phase in phases:  # one after another: each phase has the cluster to itself
            results.append(await phase(http, model, args))
            print(json.dumps(results[-1]), flush=True)
        if not args.naive_only:
            print(json.dumps(ratios({r["phase"]: r for r in results})), flush=True)
        return results


def ratios(by_phase: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The batch against the burst (throughput) and against the trickle alone (TTFT p99, TPOT
    p50)."""
    batch, burst, alone = by_phase["batch"], by_phase["burst"], by_phase["alone"]
    throughput = batch["output_tokens_per_s"] / burst["output_tokens_per_s"]

    def against_alone(key: str) -> float | None:
        if not alone.get(key) or batch.get(key) is None:
            return None
        return round(batch[key] / alone[key], 2)

    return {"phase": "ratios", "batch_throughput_vs_burst": round(throughput, 3),
            "batch_ttft_p99_vs_alone": against_alone("ttft_p99_s"),
            "batch_tpot_p50_vs_alone": against_alone("tpot_p50_s")}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running cluster (default: start one)")
    parser.add_argument("--num-prompts", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--trickle-every-s", type=float, default=2.0)
    parser.add_argument(
        "--chat-max-tokens", type=int, default=8, help="each interactive chat's max_tokens"
    )
    parser.add_argument("--alone-s", type=float, default=20.0)
    parser.add_argument("--burst-prompts", type=int, default=1_000)
    parser.add_argument("--skip-naive", action="store_true", help="no naive phase at all")
    parser.add_argument(
        "--naive-only", action="store_true", help="only the naive phase (and its retry pass)"
    )
    parser.add_argument(
        "--skip-naive-retry", action="store_true", help="the naive burst once, without retries"
    )
    args = parser.parse_args(argv)
    counts = (args.num_prompts, args.max_tokens, args.burst_prompts, args.chat_max_tokens)
    if min(counts) < 1 or args.trickle_every_s <= 0:
        parser.error(
            "--num-prompts, --max-tokens, --burst-prompts, --chat-max-tokens and "
            "--trickle-every-s must be positive"
        )
    if args.naive_only and args.skip_naive:
        parser.error("--naive-only and --skip-naive exclude each other")
    if args.url is not None:
        asyncio.run(run_phases(args.url, args))
        return 0
    with tandem_up() as cluster:
        results = asyncio.run(run_phases(cluster.url, args))
    if args.naive_only:
        return 0
    batch = next(r for r in results if r["phase"] == "batch")
    with open(cluster.log_path, encoding="utf-8", errors="replace") as log:
        parts = breakdown(log, "chatcmpl-", batch["started_at"], batch["ended_at"])
    print(json.dumps({"phase": "trickle TTFT parts during the job (s)", **parts}), flush=True)
    print(f"cluster log: {cluster.log_path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
