"""Memory pressure: the bare engine on one workload with an ample KV pool, and with a pool too
small for it under each preemption mode (swap only, recompute only, the cost-based choice).

    .venv/bin/python -m loadtest.pressure_bench [--workload loadtest/workloads/mixed64.jsonl]
        [--tight-blocks 160] [--json OUT]

All requests arrive at once, so the tight pool must preempt. Reports output tokens/s, TTFT and
TPOT percentiles, the preemptions of each kind, and each run's throughput against the ample one.
Every run must produce exactly `max_tokens` for every request (the workload ignores EOS).
"""

from __future__ import annotations

import argparse
import json

import torch

from loadtest.baselines import run_engine
from loadtest.workload import read_workload
from shared.engine.engine import EngineConfig
from shared.engine.loader import load_model

DEFAULT_WORKLOAD = "loadtest/workloads/mixed64.jsonl"


def configs(args: argparse.Namespace) -> dict[str, EngineConfig]:
    tight = {"num_blocks": args.tight_blocks, "swap_bytes": args.swap_bytes}
    return {
        "ample": EngineConfig(kv_cache_bytes=args.ample_bytes),
        "swap": EngineConfig(**tight, preemption_mode="swap"),
        "recompute": EngineConfig(**tight, preemption_mode="recompute"),
        "auto": EngineConfig(**tight, preemption_mode="auto"),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tight-blocks", type=int, default=160, help="blocks of 16 tokens")
    parser.add_argument("--swap-bytes", type=int, default=1 << 30)
    parser.add_argument("--ample-bytes", type=int, default=512 << 20)
    parser.add_argument("--json", help="write the summaries here")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    loaded = load_model(args.model)
    requests = read_workload(args.workload)
    results = {}
    print(f"{'run':<10} {'ok':>5} {'tok/s':>7} {'vs ample':>8} {'TTFT p50':>9} "
          f"{'TPOT p50':>9} {'TPOT p99':>9} {'swaps':>6} {'recomputes':>10}")  # fmt: skip
    for name, config in configs(args).items():
        result = run_engine(loaded.model, loaded.tokenizer, requests, config, False)
        s = result.summary
        results[name] = {"summary": s.to_dict(), "preemptions": result.extra["preemptions"]}
        ample = results["ample"]["summary"]["output_tokens_per_s"]
        p = result.extra["preemptions"]
        print(
            f"{name:<10} {s.num_ok:>2}/{s.num_requests:<2} {s.output_tokens_per_s:7.1f} "
            f"{s.output_tokens_per_s / ample:8.2f} {s.ttft_p50:9.2f} {s.tpot_p50:9.3f} "
            f"{s.tpot_p99:9.3f} {p['swap']:>6} {p['recompute']:>10}",
            flush=True,
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
