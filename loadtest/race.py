"""tandem against llama.cpp's server, each at its defaults, on one burst, in one run.

The workload (default: the 64 long-tailed requests of `loadtest/workloads/mixed64.jsonl`: greedy,
EOS ignored, so both servers generate exactly the same number of tokens) goes in one burst to
(1) `tandem up` with no flags but a port (what a user gets: `--dtype auto`, one prefill and one
decode worker), then, when a llama.cpp server binary and a GGUF are given, (2) `llama-server`
with `--parallel` slots (16 by default, its usual serving setup), continuous batching and all
cores. Prompts go as token ids, so both see the same tokens (SmolLM2's GGUF carries the same
vocabulary). The table gives output tokens/s, tandem's ratio to llama.cpp, and the latency
percentiles.

    .venv/bin/python -m loadtest.race [--llama-server BIN --llama-gguf MODEL.gguf]
        [--llama-quantize BIN]  # makes an F16 GGUF from the default model's, if none is given
        [--slots 16] [--workload W] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from loadtest.client import run_workload
from loadtest.metrics import Result, Summary
from loadtest.served import free_port, tandem_up
from loadtest.summary_text import client_warnings, format_ms, percentile_ms
from loadtest.worker_metrics import WorkerCounters, worker_counters
from loadtest.workload import WorkloadRequest, read_workload

DEFAULT_WORKLOAD = "loadtest/workloads/mixed64.jsonl"


def f16_gguf(quantize_bin: str, out_dir: Path) -> Path:
    """The default model's GGUF requantized to F16 (its Q4_1 weights dequantized: the same
    numbers tandem serves), made once into `out_dir`."""
    from shared.engine.model_files import default_gguf_path

    target = out_dir / "SmolLM2-135M-Instruct.F16.gguf"
    if not target.is_file():
        command = [quantize_bin, "--allow-requantize", str(default_gguf_path()), str(target), "F16"]
        subprocess.run(command, check=True, capture_output=True)
    return target


@contextmanager
def llama_server(
    binary: str, gguf: Path, slots: int, context_per_slot: int, ready_timeout_s: float = 300.0
) -> Iterator[str]:
    """llama.cpp's server on a free local port; yields its base URL."""
    port = free_port()
    log_path = Path(tempfile.mkstemp(prefix="llama-server-", suffix=".log")[1])
    command = [
        binary, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
        "--parallel", str(slots), "--ctx-size", str(slots * context_per_slot),
        "--threads", str(os.cpu_count() or 1), "--cont-batching",
    ]  # fmt: skip
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"llama-server exited: {log_path.read_text()[-2000:]}")
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise TimeoutError(f"llama-server not ready in {ready_timeout_s:.0f} s")
        yield url
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()


def burst(url: str, model: str, requests: Sequence[WorkloadRequest], name: str) -> Result:
    return asyncio.run(
        run_workload(url, model, requests, honor_arrivals=False, timeout_s=1800.0, name=name)
    )


def _pair(summary: Summary, metric: str) -> str:
    p50, p99 = (percentile_ms(summary, f"{metric}_p{q}") for q in (50, 99))
    return "-" if p50 == p99 == "-" else f"{p50}/{p99}"


def race_table(results: dict[str, Result]) -> str:
    """One row per server; a percentile that a failed request would hold reads "n/a" (see
    loadtest/metrics.py), explained under the table with the figure over the successes."""
    base = results.get("llama.cpp")
    header = (
        f"{'server':<10} {'ok':>7} {'wall s':>7} {'out tok/s':>10} {'vs llama.cpp':>13} "
        f"{'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} {'failed':>7}"
    )
    rows = [header, "-" * len(header)]
    for name, result in results.items():
        s = result.summary
        ratio = "-"
        if base is not None and base.summary.output_tokens_per_s > 0:
            ratio = f"{s.output_tokens_per_s / base.summary.output_tokens_per_s:.2f}x"
        rows.append(
            f"{name:<10} {f'{s.num_ok}/{s.num_requests}':>7} {s.wall_s:>7.1f} "
            f"{s.output_tokens_per_s:>10.1f} {ratio:>13} "
            f"{_pair(s, 'ttft'):>16} {_pair(s, 'tpot'):>16} {s.error_share:>7.1%}"
        )
    for name, result in results.items():
        s = result.summary
        hidden = [k for k in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99") if s.unknown(k)]
        if hidden:
            over_ok = ", ".join(f"{k} {format_ms(getattr(s, k))}" for k in hidden)
            rows.append(
                f"{name}: n/a: {s.num_errors} of {s.num_requests} failed, and a failed request "
                f"would hold that percentile; over the successes only (ms): {over_ok}"
            )
        rows += [f"{name}: {warning}" for warning in client_warnings(s)]
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--llama-server", help="llama.cpp's llama-server binary")
    parser.add_argument("--llama-gguf", help="the GGUF llama-server loads (default: F16, made)")
    parser.add_argument("--llama-quantize", help="llama-quantize, to make the F16 GGUF")
    parser.add_argument("--slots", type=int, default=16, help="llama-server --parallel")
    parser.add_argument("--context-per-slot", type=int, default=2048)
    parser.add_argument("--skip-tandem", action="store_true")
    parser.add_argument("--json", help="write the summaries and per-request records here")
    args = parser.parse_args(argv)
    if args.slots < 1 or args.context_per_slot < 64:
        parser.error("--slots must be >= 1 and --context-per-slot >= 64")
    if args.llama_server and not (args.llama_gguf or args.llama_quantize):
        parser.error("--llama-server needs --llama-gguf, or --llama-quantize to make an F16 one")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    requests = read_workload(args.workload)
    results: dict[str, Result] = {}
    if not args.skip_tandem:
        with tandem_up() as cluster:
            print(
                f"tandem ready in {cluster.startup_s:.1f} s; {len(requests)} requests", flush=True
            )
            before = _counters(cluster.url)
            results["tandem"] = burst(cluster.url, "smollm2", requests, "tandem")
            results["tandem"].extra["dtypes"] = _served_dtypes(cluster.url)
            work = worker_work(before, _counters(cluster.url), results["tandem"].summary.wall_s)
            results["tandem"].extra["workers"] = work
            print(workers_table(work), flush=True)
    if args.llama_server:
        gguf = Path(args.llama_gguf or f16_gguf(args.llama_quantize, Path(tempfile.gettempdir())))
        with llama_server(args.llama_server, gguf, args.slots, args.context_per_slot) as url:
            print(f"llama-server ready ({gguf.name}, {args.slots} slots)", flush=True)
            results["llama.cpp"] = burst(url, "smollm2", requests, "llama.cpp")
    print(race_table(results))
    if args.json:
        report: dict[str, Any] = {
            "workload": args.workload,
            "slots": args.slots,
            "results": {name: result.to_dict() for name, result in results.items()},
        }
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 1 if any(r.summary.num_errors for r in results.values()) else 0


def worker_work(
    before: dict[str, WorkerCounters], after: dict[str, WorkerCounters], wall_s: float
) -> dict[str, dict[str, Any]]:
    """Each tandem worker's share of the burst: time inside engine steps over the wall, steps,
    and for decode workers the mean sequences per step (where the time went, beside the
    throughput)."""
    work = {}
    for peer, end in sorted(after.items()):
        start = before.get(peer, WorkerCounters(end.role))
        steps = end.steps - start.steps
        batch_steps = end.batch_steps - start.batch_steps
        work[peer] = {
            "role": end.role,
            "busy": (end.busy_s - start.busy_s) / wall_s if wall_s > 0 else 0.0,
            "steps": steps,
            "mean_batch": (
                (end.batch_sequences - start.batch_sequences) / batch_steps if batch_steps else None
            ),
        }
    return work


def workers_table(work: dict[str, dict[str, Any]]) -> str:
    rows = []
    for peer, w in work.items():
        batch = "" if w["mean_batch"] is None else f", {w['mean_batch']:.1f} sequences per step"
        rows.append(
            f"  {peer} ({w['role']}): busy {w['busy']:.0%} of the wall, {w['steps']:.0f} steps"
            + batch
        )
    return "tandem's workers during the burst:\n" + "\n".join(rows)


def _counters(url: str) -> dict[str, WorkerCounters]:
    return worker_counters(httpx.get(url + "/metrics", timeout=30, trust_env=False).text)


def _served_dtypes(url: str) -> list[str]:
    models = httpx.get(url + "/v1/models", timeout=10, trust_env=False).json()
    return models["data"][0].get("dtypes", [])


if __name__ == "__main__":
    sys.exit(main())
