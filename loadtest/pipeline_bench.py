"""Pipeline benchmark: static batching, bare engine and served cluster, one workload, one run.

(a) transformers' `generate` with static batches (loadtest/baselines.py), (b) our engine
in-process with continuous batching, (c) `tandem up --prefill 1 --decode 1` replayed over HTTP
(loadtest/client.py). Each runs alone, one after the other, with the models of the previous one
freed; (a) and (b) use `--threads` torch threads, while `tandem up` splits the machine's cores
between its workers. The table gives output tokens/s, the ratios to (a) and (b), and the latency
percentiles of each (for (a), a request finishes only when its whole batch does).

    .venv/bin/python -m loadtest.pipeline_bench [--workload loadtest/workloads/mixed64.jsonl]
        [--skip-static] [--skip-engine] [--skip-cluster] [--threads 2] [--json OUT] [--profile]
        [--dtype bfloat16 [--static-dtype float32]] [--device cuda]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import sys
from collections.abc import Sequence
from typing import Any

import torch

from loadtest.baselines import run_engine, run_static
from loadtest.client import run_workload
from loadtest.metrics import Result, Summary
from loadtest.served import tandem_up
from loadtest.summary_text import percentile_ms, unknown_note
from loadtest.workload import WorkloadRequest, read_workload
from shared.engine.engine import EngineConfig
from shared.engine.loader import device_argument

DEFAULT_WORKLOAD = "loadtest/workloads/mixed64.jsonl"


def run_static_baseline(args: argparse.Namespace, requests: Sequence[WorkloadRequest]) -> Result:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shared.engine.loader import parse_device, parse_dtype
    from shared.engine.model_files import resolve_model_dir

    directory, _ = resolve_model_dir(args.model)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    tokenizer.padding_side = "left"
    dtype = parse_dtype(args.static_dtype or args.dtype, parse_device(args.device))
    hf_model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype)
    hf_model = hf_model.eval().to(parse_device(args.device))
    return run_static(hf_model, tokenizer, requests, args.batch_size, not args.burst)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    # The same sizes `tandem up` gives each worker, so (b) and (c) differ only in the serving.
    return EngineConfig(kv_cache_bytes=args.kv_cache_bytes, max_num_seqs=args.max_num_seqs)


def run_engine_baseline(args: argparse.Namespace, requests: Sequence[WorkloadRequest]) -> Result:
    from shared.engine.loader import load_model, parse_device, parse_dtype

    device = parse_device(args.device)
    loaded = load_model(args.model, dtype=parse_dtype(args.dtype, device), device=device)
    return run_engine(loaded.model, loaded.tokenizer, requests, engine_config(args), not args.burst)


def run_cluster(args: argparse.Namespace, requests: Sequence[WorkloadRequest]) -> Result:
    from shared.engine.model_files import resolve_model_dir

    served_name = resolve_model_dir(args.model)[1]
    extra = [
        "--model",
        args.model,
        "--kv-cache-bytes",
        str(args.kv_cache_bytes),
        "--max-num-seqs",
        str(args.max_num_seqs),
        "--dtype",
        args.dtype,
        "--device",
        args.device,
    ]
    with tandem_up(1, 1, extra, args.ready_timeout) as cluster:
        print(f"cluster ready at {cluster.url} in {cluster.startup_s:.1f} s; replaying", flush=True)
        result = asyncio.run(
            run_workload(
                cluster.url,
                served_name,
                requests,
                honor_arrivals=not args.burst,
                timeout_s=args.timeout,
                deadline_s=args.deadline,
                name="cluster",
            )
        )
    result.extra.update(startup_s=cluster.startup_s, log=str(cluster.log_path))
    return result


def run_profile(args: argparse.Namespace, requests: Sequence[WorkloadRequest]) -> str:
    from loadtest.engine_profile import profile_engine
    from shared.engine.loader import load_model, parse_device, parse_dtype

    device = parse_device(args.device)
    loaded = load_model(args.model, dtype=parse_dtype(args.dtype, device), device=device)
    return profile_engine(
        loaded.model,
        loaded.tokenizer,
        requests,
        engine_config(args),
        args.profile_steps,
        args.profile_skip,
    )


# --- the report --------------------------------------------------------------------------------


def throughput_ratio(result: Result, base: Result | None) -> float | None:
    if base is None or base.summary.output_tokens_per_s <= 0:
        return None
    return result.summary.output_tokens_per_s / base.summary.output_tokens_per_s


def _times(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _pair_ms(summary: Summary, metric: str) -> str:
    """p50/p99 of `metric` in ms, "n/a" for one that would be a failed request's."""
    p50, p99 = (percentile_ms(summary, f"{metric}_p{q}") for q in (50, 99))
    return "-" if "-" in (p50, p99) else f"{p50}/{p99}"


def format_table(results: dict[str, Result]) -> str:
    static, engine = results.get("static"), results.get("engine")
    header = (
        f"{'run':<8} {'ok':>7} {'wall s':>7} {'out tok/s':>10} {'vs static':>10} "
        f"{'vs engine':>10} {'TTFT p50/p99 ms':>16} {'TPOT p50/p99 ms':>16} "
        f"{'e2e p50/p99 ms':>16}"
    )
    rows = [header, "-" * len(header)]
    notes = []
    for name, result in results.items():
        s: Summary = result.summary
        rows.append(
            f"{name:<8} {f'{s.num_ok}/{s.num_requests}':>7} {s.wall_s:>7.1f} "
            f"{s.output_tokens_per_s:>10.1f} {_times(throughput_ratio(result, static)):>10} "
            f"{_times(throughput_ratio(result, engine)):>10} "
            f"{_pair_ms(s, 'ttft'):>16} {_pair_ms(s, 'tpot'):>16} {_pair_ms(s, 'e2e'):>16}"
        )
        note = unknown_note(s)  # failed requests are in no latency: says which are unknown
        notes += [f"{name}: {note}"] if note else []
    return "\n".join(rows + notes)


def ratios(results: dict[str, Result]) -> dict[str, float]:
    """Output tokens/s of every run over (a) and over (b)."""
    out = {}
    for name, result in results.items():
        for base in ("static", "engine"):
            ratio = throughput_ratio(result, results.get(base))
            if base != name and ratio is not None:
                out[f"{name}_over_{base}"] = ratio
    return out


# --- command line ------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--skip-static", action="store_true")
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument("--skip-cluster", action="store_true")
    parser.add_argument("--threads", type=int, default=2, help="torch threads for (a) and (b)")
    parser.add_argument(
        "--dtype",
        default="float32",
        choices=["auto", "float32", "bfloat16"],
        help="for all three runs (auto: as `tandem up` picks for this machine)",
    )
    parser.add_argument(
        "--static-dtype",
        choices=["float32", "bfloat16"],
        help="(a) only, instead of --dtype: e.g. transformers at its default float32 against "
        "tandem in bfloat16, the comparison the llama.cpp figures make",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        type=device_argument,
        help="for all three runs: cpu, cuda, cuda:N",
    )
    parser.add_argument("--batch-size", type=int, default=16, help="static batch size for (a)")
    parser.add_argument("--burst", action="store_true", help="ignore arrival times: all at once")
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="(b) and per worker")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="(b) and per decode worker")
    parser.add_argument("--timeout", type=float, default=1800.0, help="(c) per request, seconds")
    parser.add_argument("--deadline", type=float, default=3600.0, help="(c) whole replay, seconds")
    parser.add_argument("--ready-timeout", type=float, default=300.0, help="(c) start-up, seconds")
    parser.add_argument("--profile", action="store_true", help="also profile (b) for a few steps")
    parser.add_argument("--profile-steps", type=int, default=20)
    parser.add_argument("--profile-skip", type=int, default=0, help="steps to run before profiling")
    parser.add_argument("--json", help="write the summaries and per-request records here")
    return parser.parse_args(argv)


def run_all(
    args: argparse.Namespace, requests: Sequence[WorkloadRequest]
) -> tuple[dict[str, Result], dict[str, str]]:
    """Runs (a), (b), (c) in turn; one that fails is reported and the others still run."""
    runs = [
        ("static", args.skip_static, run_static_baseline),
        ("engine", args.skip_engine, run_engine_baseline),
        ("cluster", args.skip_cluster, run_cluster),
    ]
    results: dict[str, Result] = {}
    failures: dict[str, str] = {}
    for name, skipped, run in runs:
        if skipped:
            continue
        print(f"running {name} on {len(requests)} requests", flush=True)
        try:
            results[name] = run(args, requests)
        except (RuntimeError, TimeoutError, OSError) as error:
            failures[name] = f"{type(error).__name__}: {error}"
            print(f"{name} failed: {failures[name]}", flush=True)
        gc.collect()  # the previous run's model goes before the next one loads
    return results, failures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    requests = read_workload(args.workload)
    results, failures = run_all(args, requests)
    print(format_table(results))
    for result in results.values():
        for record in [r for r in result.records if r.error][:5]:
            print(f"{result.name} request {record.index}: {record.error}")
    report: dict[str, Any] = {
        "workload": args.workload,
        "num_requests": len(requests),
        "threads": args.threads,
        "dtype": args.dtype,
        "static_dtype": args.static_dtype or args.dtype,
        "device": args.device,
        "burst": args.burst,
        "ratios": ratios(results),
        "failures": failures,
        "results": {name: result.to_dict() for name, result in results.items()},
    }
    if args.profile:
        report["profile"] = run_profile(args, requests)
        print(report["profile"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
    num_errors = sum(r.summary.num_errors for r in results.values())
    return 1 if failures or num_errors else 0


if __name__ == "__main__":
    sys.exit(main())
