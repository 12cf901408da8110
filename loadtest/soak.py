"""A soak: a fixed time at twice the cluster's capacity, with a worker killed and restarted in it.

    .venv/bin/python -m loadtest.soak [--duration 120] [--kill decode|prefill] [--kill-at 0.4]
        [--prefill 1 --decode 2] [--max-queued 32] [--json OUT]

It starts its own `tandem up` on a free local port, then measures capacity: `--clients` closed-loop
clients for `--calibration-s` seconds, counting the requests completed after a warm-up. Then an
open-loop Poisson process sends requests at twice that rate for `--duration` seconds (short random
prompts, a few output tokens, EOS ignored so every length is known), each bounded by
`--request-timeout-s`, the whole run by the duration plus that timeout. At `--kill-at` of the
duration it SIGKILLs `<role>-0`, a child of `tandem up`; `tandem up` starts it again, and the
soak polls `/ready` until the new process has registered (an entry for it whose heartbeat is
younger than the kill).

Every request ends in one outcome: completed ([DONE] and exactly `max_tokens` tokens), refused
(429 with Retry-After; counted, not retried), failed (any other HTTP status, an error event, a
stream cut short, a wrong count: the reason is kept) or lost (no outcome within its timeout or
by the run's deadline: a hang). The scheduler's queue is bounded with `--max-queued`, so the
overload shows as 429s rather than as a queue that grows for the whole run.

The report: the outcomes, each service's RSS (/proc VmRSS) after calibration and at the end (a
restarted worker is a new pid), completed tokens/s and requests/s before the kill, from the kill
until `--settle-s` after the worker rejoined, and from then to the end of the arrivals (a
completed request counts when it finished, its tokens when each arrived), and the gateway's
`tandem:requests_resumed_total`. Exits 1 when a request was lost or the killed worker never
rejoined. Traffic goes only to 127.0.0.1.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import COMPLETIONS_PATH, sse_events
from loadtest.metrics import Clock
from loadtest.served import environment, tandem_up
from loadtest.soak_measures import (
    MAX_REASON_CHARS,
    RESUMED_METRIC,
    Attempt,
    completions,
    error_message,
    has_rejoined,
    memory_rows,
    memory_snapshot,
    metric_total,
    pauses_across,
    service_pids,
    tally,
    throughput,
    windows,
)
from loadtest.workload import arrival_times

MODEL = "smollm2"


# --- traffic -----------------------------------------------------------------------------------


def request_body(rng: random.Random, prompt_tokens: int, max_tokens: int) -> dict[str, Any]:
    return {
        "model": MODEL,
        "prompt": [rng.randrange(100, 20000) for _ in range(prompt_tokens)],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def send(
    client: httpx.AsyncClient, clock: Clock, attempt: Attempt, body: dict, timeout_s: float
) -> None:
    """Fills `attempt` in; never raises but for cancellation."""
    try:
        async with asyncio.timeout(timeout_s):
            async with client.stream("POST", COMPLETIONS_PATH, json=body) as response:
                attempt.status = response.status_code
                if response.status_code != 200:
                    attempt.retry_after = response.headers.get("retry-after")
                    attempt.body = (await response.aread()).decode(errors="replace")
                else:
                    await read_stream(response, attempt, clock)
    except TimeoutError:
        attempt.timed_out_after_s = timeout_s
    except Exception as error:  # recorded, not raised: the run goes on
        attempt.exception = f"{type(error).__name__}: {error}"[:MAX_REASON_CHARS]
    attempt.finish_time = clock()


async def read_stream(response: httpx.Response, attempt: Attempt, clock: Clock) -> None:
    async for data in sse_events(response):
        if data == "[DONE]":
            attempt.done = True
            return
        event = json.loads(data)
        if event.get("choices"):
            attempt.chunk_times.append(clock())
        if "error" in event and attempt.error_event is None:
            attempt.error_event = error_message(json.dumps(event))
        if event.get("usage"):
            attempt.num_tokens = int(event["usage"]["completion_tokens"])


def new_client(url: str, max_connections: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=64)
    return httpx.AsyncClient(
        base_url=url, trust_env=False, follow_redirects=False, limits=limits, timeout=None
    )


async def calibrate(url: str, args: argparse.Namespace) -> dict[str, Any]:
    """Closed loop: `--clients` clients, each sending its next request when one ends; capacity
    is what completed between the warm-up and the end."""
    clock, attempts = Clock(), []

    async def loop(seed: int) -> None:
        rng = random.Random(seed)
        while clock() < args.calibration_s:
            attempt = Attempt(clock())
            attempts.append(attempt)
            body = request_body(rng, args.prompt_tokens, args.max_tokens)
            await send(client, clock, attempt, body, args.request_timeout_s)

    async with new_client(url, args.clients) as client:
        await asyncio.gather(*(loop(i) for i in range(args.clients)))
    span = (min(args.calibration_warmup_s, args.calibration_s / 2), args.calibration_s)
    rates = throughput(completions(attempts, args.max_tokens), span)
    return {"clients": args.clients, **rates, "outcomes": tally(attempts, args.max_tokens)}


@dataclass
class KillRecord:
    victim: str
    old_pid: int | None = None
    new_pid: int | None = None
    kill_s: float | None = None
    rejoin_s: float | None = None
    error: str | None = None  # why it could not be killed


async def kill_and_watch(
    client: httpx.AsyncClient,
    clock: Clock,
    parent: int,
    kill: KillRecord,
    at_s: float,
    end_s: float,
) -> None:
    """SIGKILLs the victim at `at_s`, then polls `/ready` until it rejoined or `end_s`."""
    await asyncio.sleep(max(0.0, at_s - clock()))
    kill.old_pid = service_pids(parent).get(kill.victim)
    try:
        if kill.old_pid is None:
            raise ProcessLookupError(f"no child of {parent} is {kill.victim}")
        os.kill(kill.old_pid, signal.SIGKILL)
    except ProcessLookupError as error:  # not there, or gone by itself meanwhile
        kill.error = str(error)
        return
    kill.kill_s = clock()
    while clock() < end_s:
        await asyncio.sleep(0.5)
        try:
            ready = (await client.get("/ready", timeout=5)).json()
        except (httpx.HTTPError, ValueError):
            continue
        if has_rejoined(ready, kill.victim, clock() - kill.kill_s):
            kill.rejoin_s = clock()
            kill.new_pid = service_pids(parent).get(kill.victim)
            return


async def soak(url: str, parent: int, rate: float, args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    arrivals = [t for t in arrival_times(rng, args.max_requests, rate) if t < args.duration]
    deadline_s = args.duration + args.request_timeout_s
    clock, attempts, tasks = Clock(), [], []
    kill = KillRecord(f"{args.kill}-0")
    async with new_client(url, args.max_connections) as client:
        resumed_before = metric_total((await client.get("/metrics")).text, RESUMED_METRIC)
        watcher = asyncio.create_task(
            kill_and_watch(client, clock, parent, kill, args.kill_at * args.duration, deadline_s)
        )
        for at in arrivals:
            await asyncio.sleep(max(0.0, at - clock()))
            attempts.append(Attempt(clock()))
            body = request_body(rng, args.prompt_tokens, args.max_tokens)
            tasks.append(
                asyncio.create_task(send(client, clock, attempts[-1], body, args.request_timeout_s))
            )
        _, pending = await asyncio.wait(tasks, timeout=max(0.0, deadline_s - clock()))
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        drained_s = clock()
        if not watcher.done():  # the requests are over: give the worker the rest of the time
            await asyncio.wait([watcher], timeout=max(1.0, deadline_s - clock()))
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        resumed = metric_total((await client.get("/metrics")).text, RESUMED_METRIC)
    spans = windows(kill.kill_s or args.duration, kill.rejoin_s, args.duration, args.settle_s)
    done = completions(attempts, args.max_tokens)
    return {
        "rate_per_s": rate,
        "outcomes": tally(attempts, args.max_tokens),
        "kill": vars(kill),
        "throughput": {name: throughput(done, span) for name, span in spans.items()},
        "pauses": pauses_across(done, kill.kill_s or args.duration),
        "drained_s": drained_s,
        "requests_resumed": resumed - resumed_before,
    }


# --- the run -----------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {
        "TANDEM_MAX_QUEUED_REQUESTS": str(args.max_queued),
        "TANDEM_HEARTBEAT_TIMEOUT_S": str(args.heartbeat_timeout_s),
    }
    cluster_args = ["--kv-cache-bytes", str(args.kv_cache_bytes)]
    with (
        environment(settings),
        tandem_up(args.prefill, args.decode, cluster_args, log_path=args.log) as served,
    ):
        parent = served.process.pid
        print(f"cluster ready in {served.startup_s:.0f} s; calibrating", file=sys.stderr)
        calibration = asyncio.run(calibrate(served.url, args))
        if calibration["requests_per_s"] <= 0:
            raise RuntimeError(f"nothing completed during calibration: {calibration}")
        rate = args.overload * calibration["requests_per_s"]
        print(
            f"capacity {calibration['requests_per_s']:.2f} req/s; soak at {rate:.2f} req/s",
            file=sys.stderr,
        )
        memory_start = memory_snapshot(parent)
        result = asyncio.run(soak(served.url, parent, rate, args))
        memory_end = memory_snapshot(parent)
    return {
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "log": str(served.log_path),
        "calibration": calibration,
        **result,
        "memory": memory_rows(memory_start, memory_end),
    }


def passed(report: Mapping[str, Any]) -> bool:
    return report["outcomes"]["lost"] == 0 and report["kill"]["rejoin_s"] is not None


def format_report(report: Mapping[str, Any]) -> str:
    s, c, o, k = report["settings"], report["calibration"], report["outcomes"], report["kill"]
    lines = [
        f"soak: {s['duration']:g} s at {report['rate_per_s']:.2f} req/s "
        f"({s['overload']:g} x {c['requests_per_s']:.2f} req/s, {c['tokens_per_s']:.1f} tok/s "
        f"measured with {c['clients']} clients); {s['prompt_tokens']}-token prompts, "
        f"{s['max_tokens']} output tokens",
        f"calibration requests: {_counts(c['outcomes'])}",
        f"soak requests: {_counts(o)}",
    ]
    for kind in ("failed", "lost"):
        lines += [f"  {kind} {n:>5}  {reason}" for reason, n in o[f"{kind}_reasons"].items()]
    rejoin = "never rejoined" if k["rejoin_s"] is None else f"rejoined at {k['rejoin_s']:.1f} s"
    if k["error"] is not None:
        rejoin = f"not killed: {k['error']}"
    lines.append(
        f"kill: {k['victim']} (pid {k['old_pid']}) at {_f(k['kill_s'], 1)} s, {rejoin} "
        f"(pid {k['new_pid']}); requests resumed: {report['requests_resumed']:g}; "
        f"drained at {report['drained_s']:.1f} s"
    )
    pauses = report["pauses"]
    lines.append(
        f"streams across the kill: {pauses['streams']}, their longest pause p50 "
        f"{_f(pauses['p50_s'], 2)} s, max {_f(pauses['max_s'], 2)} s"
    )
    lines.append(f"{'window':<8} {'from s':>7} {'to s':>7} {'req/s':>7} {'tok/s':>8}")
    for name, t in report["throughput"].items():
        lines.append(
            f"{name:<8} {t['start_s']:>7.1f} {t['end_s']:>7.1f} {t['requests_per_s']:>7.2f} "
            f"{t['tokens_per_s']:>8.1f}"
        )
    lines.append(
        f"{'service':<10} {'pid':>8} {'RSS MiB':>8} {'pid':>8} {'RSS MiB':>8}  (start, end)"
    )
    for row in report["memory"]:
        note = "  restarted (new pid)" if row["restarted"] else ""
        lines.append(
            f"{row['service']:<10} {_f(row['pid_start'], 0):>8} {_mib(row['rss_start_bytes']):>8} "
            f"{_f(row['pid_end'], 0):>8} {_mib(row['rss_end_bytes']):>8}{note}"
        )
    if not passed(report):
        lines.append("FAIL: a request was lost, or the killed worker did not come back")
    lines.append(f"cluster log: {report['log']}")
    return "\n".join(lines)


def _counts(o: Mapping[str, Any]) -> str:
    return (
        f"sent {o['sent']}, completed {o['completed']}, refused (429) {o['refused']}, "
        f"failed {o['failed']}, lost {o['lost']}"
    )


def _f(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.0f}"


def _fraction(text: str) -> float:
    value = _number(float, text)
    if not 0 < value < 1:
        raise argparse.ArgumentTypeError(f"must be strictly between 0 and 1, got {text}")
    return value


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = _number(kind, text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number ({kind.__name__}): {text!r}") from None


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    pos_int, pos_float = _positive(int), _positive(float)
    p = argparse.ArgumentParser(prog="python -m loadtest.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=pos_float, default=120.0, help="seconds of arrivals")
    p.add_argument(
        "--kill", choices=["decode", "prefill"], default="decode", help="role of <role>-0"
    )
    p.add_argument("--kill-at", type=_fraction, default=0.4, help="fraction of the duration")
    p.add_argument("--prefill", type=pos_int, default=1, help="prefill workers")
    p.add_argument("--decode", type=pos_int, default=2, help="decode workers")
    p.add_argument("--overload", type=pos_float, default=2.0, help="arrival rate / capacity")
    p.add_argument("--clients", type=pos_int, default=64, help="calibration: closed-loop clients")
    p.add_argument("--calibration-s", type=pos_float, default=20.0)
    p.add_argument("--calibration-warmup-s", type=pos_float, default=5.0)
    p.add_argument("--prompt-tokens", type=pos_int, default=32)
    p.add_argument("--max-tokens", type=pos_int, default=16)
    p.add_argument("--request-timeout-s", type=pos_float, default=120.0)
    p.add_argument("--max-queued", type=pos_int, default=32, help="the scheduler's queue bound")
    p.add_argument("--heartbeat-timeout-s", type=pos_float, default=10.0)
    p.add_argument("--settle-s", type=pos_float, default=5.0, help="after the rejoin")
    p.add_argument("--max-requests", type=pos_int, default=20000, help="bound on arrivals")
    p.add_argument("--max-connections", type=pos_int, default=1024)
    p.add_argument("--kv-cache-bytes", type=pos_int, default=256 << 20, help="per worker")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--log", type=Path, default=None, help="tandem up's output (default: a temp file)"
    )
    p.add_argument("--json", help="write the report here")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = run(args)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0 if passed(report) else 1


if __name__ == "__main__":
    sys.exit(main())
