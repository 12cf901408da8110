"""`tandem bench`: an open-loop benchmark client for any OpenAI-compatible server.

A workload (a JSONL file, or a built-in generator: chat, long, bulk, mix, agents, json; see
loadtest/generators.py) is sent as a burst, as a Poisson process at `--rate`, or once per rate of
a `--sweep`, through `/v1/completions` with greedy decoding and EOS ignored (so every server
generates the same number of tokens; the `json` workload's constrained outputs end with their
structure instead, and send OpenAI's `response_format`). Each run
reports output and request throughput, TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99,
each with its number of samples, overall and per request class, and goodput under the
`--slo-ttft`/`--slo-tpot` objectives. Failed requests are in no latency: beside the count and
share of failures, a percentile that a failed request would hold (counted as slower than every
success) reads "n/a" (see loadtest/metrics.py). Each run also reports the share of prompt tokens
the server took from its prefix cache (when its usage says), and how late the client sent the
requests against their schedule, with a warning when it fell behind.

Every run (each rate of a sweep, each repetition of a command) puts a fresh nonce ahead of every
prompt (a few token ids drawn from the workload's own, or a few of its words for text prompts;
the same for all requests of the run, recorded in the run's `prompt_nonce`), so a server's prefix
cache holds nothing from an earlier run: the first run would otherwise warm the cache for the
next. `--reuse-prompts` sends the prompts as they are, to measure cache effects on purpose.
Before the first run, `--warmup` requests (the workload's first, shortened, under a nonce of
their own) are sent and measured in no run: the server's cold start stays out of the figures.

Results go to `--out`: `result.json` (settings, summaries, per-request records, timelines) and
PNG plots: latency CDFs per class, output tokens/s over time, and, when the server is tandem
(its `/ready` lists workers), the decode batch occupancy over time (each decode step's batch
size, as the workers' heartbeats report it): continuous batching at work, requests joining and
leaving. `--compare A.json B.json ...` lays finished results side by side in a table and a plot.

    tandem bench --url http://127.0.0.1:8000 --generator mix --num 64 --rate 4 --out out/mix
    tandem bench --workload loadtest/workloads/mixed64.jsonl --sweep 1,2,4 --slo-ttft 2
    tandem bench --compare out/a/result.json out/b/result.json --out out/a-vs-b

Traffic goes only to `--url`; every request is bounded by `--timeout` and the run by
`--deadline`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import run_workload
from loadtest.generators import (
    GENERATORS,
    generate,
    prompt_nonce,
    with_arrivals,
    with_prompt_nonce,
)
from loadtest.metrics import Clock, Result, Summary, summarize_by_label, token_timeline
from loadtest.summary_text import client_warnings, format_ms, format_summary
from loadtest.workload import WorkloadError, WorkloadRequest, read_workload

RESULT_VERSION = 1
DEFAULT_WARMUP = 2  # requests sent before the runs, in none of them (--warmup)
WARMUP_MAX_TOKENS = 16  # each warm-up request's output at most: enough to step decode, quick
SUMMARY_FIELDS = (  # (row, summary key, format; "ms": a percentile, "n/a" if a failure's)
    ("requests ok", "num_ok", "{:.0f}"),
    ("errors", "num_errors", "{:.0f}"),
    ("failed", "error_share", "{:.1%}"),
    ("output tok/s", "output_tokens_per_s", "{:.1f}"),
    ("requests/s", "requests_per_s", "{:.2f}"),
    ("goodput req/s", "goodput_rps", "{:.2f}"),
    ("TTFT p50 ms", "ttft_p50", "ms"),
    ("TTFT p90 ms", "ttft_p90", "ms"),
    ("TTFT p99 ms", "ttft_p99", "ms"),
    ("TPOT p50 ms", "tpot_p50", "ms"),
    ("TPOT p90 ms", "tpot_p90", "ms"),
    ("TPOT p99 ms", "tpot_p99", "ms"),
    ("ITL p50 ms", "itl_p50", "ms"),
    ("ITL p99 ms", "itl_p99", "ms"),
    ("e2e p50 ms", "e2e_p50", "ms"),
    ("e2e p99 ms", "e2e_p99", "ms"),
    ("TTFT n", "ttft_n", "{:.0f}"),
    ("TPOT n", "tpot_n", "{:.0f}"),
    ("e2e n", "e2e_n", "{:.0f}"),
    ("cached prompt", "cache_hit_share", "{:.1%}"),
    ("late p99 ms", "lateness_p99", "ms"),
    ("late max ms", "lateness_max", "ms"),
)


class BenchError(ValueError):
    """Settings the bench refuses; the message says which and why."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default="smollm2", help="the `model` field of each request")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="sent as `Authorization: Bearer` (default: $OPENAI_API_KEY; none if unset)",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--workload", help="a JSONL workload file (see loadtest/workload.py)")
    source.add_argument(
        "--generator", choices=GENERATORS, help="a built-in workload (default: mix)"
    )
    parser.add_argument("--num", type=int, default=64, help="requests a generator makes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", default="smollm2", help="whose tokens the generator uses")
    arrivals = parser.add_mutually_exclusive_group()
    arrivals.add_argument("--burst", action="store_true", help="every request at once")
    arrivals.add_argument("--rate", type=float, help="Poisson arrivals, requests per second")
    arrivals.add_argument("--sweep", help="comma-separated rates: one run per rate")
    parser.add_argument("--slo-ttft", type=float, help="goodput objective: TTFT, seconds")
    parser.add_argument("--slo-tpot", type=float, help="goodput objective: TPOT, seconds")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--deadline", type=float, default=3600.0, help="per run, seconds")
    parser.add_argument("--send-text", action="store_true", help="prompts as text, not token ids")
    parser.add_argument(
        "--reuse-prompts",
        action="store_true",
        help="no per-run nonce ahead of the prompts: a later run may hit the server's cache",
    )
    parser.add_argument(
        "--warmup",
        type=int,
        default=DEFAULT_WARMUP,
        help="requests sent before the measured runs, measured in none: the server's cold start "
        "(first allocations and compiles) stays out of the first requests' TTFT (0: none)",
    )
    parser.add_argument("--poll-interval", type=float, default=0.5, help="tandem /ready polling")
    parser.add_argument("--name", help="the result's name in comparisons (default: --out's)")
    parser.add_argument("--out", default="bench-results", help="folder for result.json and PNGs")
    parser.add_argument("--no-plots", action="store_true")
    parser.add_argument("--compare", nargs="+", metavar="RESULT", help="result.json files")


def run(args: argparse.Namespace) -> int:
    try:
        if args.compare:
            return compare(args)
        return bench(args)
    except (BenchError, WorkloadError) as error:
        print(f"tandem bench: {error}", file=sys.stderr)
        return 2


# -- one benchmark ------------------------------------------------------------------------------


def rates_of(args: argparse.Namespace) -> list[float | None]:
    """The runs' rates: None is a burst, or the file's own arrival times for --workload."""
    if args.sweep is not None:
        try:
            rates = [float(part) for part in args.sweep.split(",") if part.strip()]
        except ValueError:
            raise BenchError(f"--sweep takes rates like 1,2,4; got {args.sweep!r}") from None
        if not rates or any(not 0 < rate < math.inf for rate in rates):  # (NaN compares false)
            raise BenchError(f"--sweep rates must be > 0; got {args.sweep!r}")
        return rates
    if args.rate is not None and not 0 < args.rate < math.inf:
        raise BenchError(f"--rate must be > 0; got {args.rate}")
    return [args.rate]


def check_settings(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--num", args.num),
        ("--timeout", args.timeout),
        ("--deadline", args.deadline),
        ("--poll-interval", args.poll_interval),
        ("--slo-ttft", args.slo_ttft),
        ("--slo-tpot", args.slo_tpot),
    ):
        if value is not None and not 0 < value < math.inf:  # nan timed out every request
            raise BenchError(f"{flag} must be > 0; got {value}")
    if args.warmup < 0:
        raise BenchError(f"--warmup must be >= 0; got {args.warmup}")
    if not args.url.startswith(("http://", "https://")):
        raise BenchError(f"--url must be an http(s) URL; got {args.url!r}")
    # The server's root, as OpenAI clients' base URL also reads it (`.../v1`): every request
    # went to /v1/v1/completions, a 404 each.
    args.url = args.url.rstrip("/").removesuffix("/v1")


def out_folder(path: str) -> Path:
    """`--out`, made if missing; refused by name where it cannot be (a file of that name,
    no permission), before any request is sent."""
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise BenchError(f"--out {path!r} cannot be a folder of results: {error}") from None
    return Path(path)


def load_requests(args: argparse.Namespace) -> list[WorkloadRequest]:
    if args.workload:
        return read_workload(args.workload)
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir(args.tokenizer)[0])
    return generate(tokenizer, args.generator or "mix", args.num, args.seed)


def bench(args: argparse.Namespace) -> int:
    check_settings(args)
    rates = rates_of(args)
    requests = load_requests(args)
    out = out_folder(args.out)
    warmup = warm_up(args, requests)
    runs = []
    for rate in rates:
        arrivals, timed = arrivals_for(args, requests, rate)
        nonce = None if args.reuse_prompts else prompt_nonce(requests)
        if nonce is not None:
            timed = with_prompt_nonce(timed, nonce)
        prompt = {"prompt_nonce": None if nonce is None else asdict(nonce)}
        runs.append({"arrivals": arrivals, **prompt, **asyncio.run(one_run(args, timed, rate))})
        print(describe_run(runs[-1]), flush=True)
    result = {
        "tool": "tandem bench",
        "version": RESULT_VERSION,
        "name": args.name or out.name,
        "url": args.url,
        "model": args.model,
        "workload": args.workload or f"generator:{args.generator or 'mix'}",
        "num_requests": len(requests),
        "seed": args.seed,
        "reuse_prompts": args.reuse_prompts,
        "warmup": warmup,
        "slo": {"ttft_s": args.slo_ttft, "tpot_s": args.slo_tpot},
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    written = [] if args.no_plots else plot_result(result, out)
    print(f"wrote {out / 'result.json'}" + "".join(f", {p}" for p in written))
    return 0 if all(run["summary"]["num_errors"] == 0 for run in runs) else 1


def warm_up(args: argparse.Namespace, requests: list[WorkloadRequest]) -> dict[str, Any] | None:
    """Sends the workload's first `--warmup` requests at once, before any run and measured in
    none: the server's cold start (first allocations, kernel compiles, a schema's grammar)
    landed in the first measured requests' TTFT. Under a nonce of their own, even with
    --reuse-prompts, so no measured prompt finds theirs in the server's prefix cache. Returns
    what the result records of it (None: no warm-up)."""
    if args.warmup == 0:
        return None
    chosen = [
        dataclasses.replace(r, max_tokens=min(r.max_tokens, WARMUP_MAX_TOKENS))
        for r in requests[: args.warmup]
    ]
    chosen = with_prompt_nonce(with_arrivals(chosen, None), prompt_nonce(requests))
    started = time.perf_counter()
    result = asyncio.run(
        run_workload(
            args.url,
            args.model,
            chosen,
            honor_arrivals=False,
            timeout_s=args.timeout,
            deadline_s=args.deadline,
            send_text=args.send_text,
            api_key=args.api_key,
            name="warm-up",
        )
    )
    errors = [r.error for r in result.records if r.error]
    warmup = {
        "requests": len(chosen),
        "errors": len(errors),
        "seconds": round(time.perf_counter() - started, 3),
    }
    print(f"warm-up: {len(chosen)} requests, not measured, {warmup['seconds']:.2f} s", flush=True)
    if errors:  # (the runs that follow report their own failures; this may say why early)
        print(f"WARNING: {len(errors)} warm-up request(s) failed: {errors[0]}", flush=True)
    return warmup


def arrivals_for(
    args: argparse.Namespace, requests: list[WorkloadRequest], rate: float | None
) -> tuple[str, list[WorkloadRequest]]:
    if rate is None and args.workload and not args.burst:
        return "file", requests  # the workload's own arrival times
    return ("burst" if rate is None else "poisson"), with_arrivals(requests, rate, args.seed)


async def one_run(
    args: argparse.Namespace, requests: list[WorkloadRequest], rate: float | None
) -> dict[str, Any]:
    clock = Clock()
    sampler = BatchSampler(args.url, args.poll_interval, clock)
    poller = asyncio.create_task(sampler.run())
    with progress_bar(len(requests), f"rate {rate:g}/s" if rate else "burst") as advance:
        result: Result = await run_workload(
            args.url,
            args.model,
            requests,
            honor_arrivals=True,
            timeout_s=args.timeout,
            deadline_s=args.deadline,
            send_text=args.send_text,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
            on_done=lambda _: advance(),
            clock=clock,
            api_key=args.api_key,
        )
    if sampler.samples:  # tandem: the last steps' heartbeat reaches /ready within a second
        await asyncio.sleep(max(1.0, 2 * args.poll_interval))
    poller.cancel()
    await asyncio.gather(poller, return_exceptions=True)
    classes = summarize_by_label(result.records, args.slo_ttft, args.slo_tpot)
    return {
        "rate": rate,
        "summary": result.summary.to_dict(),
        "warnings": client_warnings(result.summary),
        "classes": {label or "all": s.to_dict() for label, s in classes.items()},
        "throughput": token_timeline(result.records),
        "batch": sampler.samples,
        "records": [r.to_dict() for r in result.records],
    }


def progress_bar(total: int, description: str):
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    progress = Progress(
        "[progress.description]{task.description}",
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    )
    return _Bar(progress, total, description)


@dataclass
class _Bar:
    progress: Any
    total: int
    description: str

    def __enter__(self):
        self.progress.start()
        task = self.progress.add_task(self.description, total=self.total)
        return lambda: self.progress.advance(task)

    def __exit__(self, *_: object) -> None:
        self.progress.stop()


@dataclass
class BatchSampler:
    """Polls tandem's /ready for each decode worker's recent step batch sizes. A heartbeat's
    sizes are taken once (by its step count) and spread over the time since the last sample.
    Against a server without tandem's /ready, it finds nothing and stops."""

    url: str
    interval_s: float
    clock: Clock
    samples: list[dict[str, Any]] = field(default_factory=list)
    _last: dict[str, tuple[int, float]] = field(default_factory=dict)

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, trust_env=False, timeout=2.0) as client:
            while True:
                try:
                    workers = (await client.get("/ready")).json().get("workers")
                except (httpx.HTTPError, ValueError, AttributeError):
                    workers = None
                if workers is None and not self.samples:
                    return  # not tandem (or not up): no batch picture
                self.take(workers or [], self.clock())
                await asyncio.sleep(self.interval_s)

    def take(self, workers: list[dict[str, Any]], now: float) -> None:
        for worker in workers:
            if worker.get("role") != "decode":
                continue
            peer, steps = worker["peer_id"], worker["steps_completed"]
            last_steps, last_time = self._last.get(peer, (None, now - self.interval_s))
            self._last[peer] = (steps, now)
            # No step since the last look: the worker was idle (an empty batch), not busy.
            sizes = (
                [s for s in worker["recent_batch_sizes"] if s > 0] if steps != last_steps else []
            )
            self.samples.append({"peer": peer, "t0": last_time, "t1": now, "sizes": sizes or [0]})


def describe_run(run: dict[str, Any]) -> str:
    head = run["arrivals"] if run["rate"] is None else f"rate {run['rate']:g} req/s"
    lines = [f"== {head}", format_summary(Summary.from_dict(run["summary"]))]
    failures = failure_line(run["records"])
    lines += [failures] if failures else []
    if len(run["classes"]) > 1:
        for label, summary in run["classes"].items():
            text = format_summary(Summary.from_dict(summary))
            lines.append(f"-- {label}: " + text.replace("\n", "; "))
    return "\n".join(lines)


def failure_line(records: list[dict[str, Any]]) -> str | None:
    """The commonest cause of the run's failures; None if none failed. Without it a run
    against an unreachable server said only "0/64 ok", its cause in result.json alone."""
    causes = Counter(record["error"] for record in records if record["error"])
    if not causes:
        return None
    error, count = causes.most_common(1)[0]
    others = causes.total() - count
    return f"{count} failed: {error}" + (f" ({others} more: see result.json)" if others else "")


def plot_result(result: dict[str, Any], out: Path) -> list[Path]:
    from loadtest import plots

    written = []
    for index, run in enumerate(result["runs"]):
        suffix = "" if len(result["runs"]) == 1 else f"-{index}"
        written.append(plots.latency_cdfs(run, out / f"latency_cdf{suffix}.png"))
        written.append(plots.throughput(run, out / f"throughput{suffix}.png"))
        if run["batch"]:
            written.append(plots.batch_occupancy(run, out / f"batch{suffix}.png"))
    if len(result["runs"]) > 1:
        written.append(plots.sweep(result, out / "sweep.png"))
    return written


# -- comparison ---------------------------------------------------------------------------------


def load_result(path: str) -> dict[str, Any]:
    try:
        result = json.loads(Path(path).read_text())
    except (OSError, ValueError) as error:
        raise BenchError(f"{path}: cannot read a result: {error}") from None
    if not isinstance(result, dict) or result.get("tool") != "tandem bench":
        raise BenchError(f"{path}: not a `tandem bench` result.json")
    if result.get("version") != RESULT_VERSION:
        raise BenchError(f"{path}: result version {result.get('version')} != {RESULT_VERSION}")
    return result


def compared_runs(results: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any]]]:
    """(column name, run) for every run of every result."""
    columns = []
    for result in results:
        for run in result["runs"]:
            name = result["name"]
            if len(result["runs"]) > 1:
                name += f" @{run['rate']:g}/s" if run["rate"] else " burst"
            columns.append((name, run))
    return columns


def summary_cell(summary: Summary, key: str, fmt: str) -> str:
    """A percentile that a failed request would hold reads "n/a: X% failed"."""
    share = summary.num_errors / summary.num_requests if summary.num_requests else 0.0
    if fmt == "ms" and summary.unknown(key):
        return f"n/a: {share:.0%} failed"
    if fmt == "ms":
        return format_ms(getattr(summary, key))
    value = share if key == "error_share" else getattr(summary, key)  # (older results lack it)
    return "-" if value is None else fmt.format(value)


def compare_table(columns: list[tuple[str, dict[str, Any]]]) -> str:
    summaries = [Summary.from_dict(run["summary"]) for _, run in columns]
    rows = [
        (label, [summary_cell(s, key, fmt) for s in summaries])
        for label, key, fmt in SUMMARY_FIELDS
    ]
    width = max(14, *(len(name) + 2 for name, _ in columns),
                *(len(cell) + 2 for _, cells in rows for cell in cells))  # fmt: skip
    lines = ["metric".ljust(16) + "".join(name.rjust(width) for name, _ in columns)]
    for label, cells in rows:
        lines.append(label.ljust(16) + "".join(cell.rjust(width) for cell in cells))
    return "\n".join(lines)


def compare(args: argparse.Namespace) -> int:
    if len(args.compare) < 2:
        raise BenchError("--compare needs two or more result.json files")
    columns = compared_runs([load_result(path) for path in args.compare])
    table = compare_table(columns)
    print(table)
    out = out_folder(args.out)
    (out / "compare.txt").write_text(table + "\n")
    written = [out / "compare.txt"]
    if not args.no_plots:
        from loadtest import plots

        written.append(plots.compare(columns, out / "compare.png"))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0
