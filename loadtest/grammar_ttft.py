"""A cached schema's time to first token, end to end: the `json` workload of `tandem bench`
against the same requests with `response_format` removed, through one `tandem up` cluster.

A few constrained requests go first so every schema is compiled (cached); then both workloads
run in interleaved rounds at a Poisson `--rate`, and each round's TTFT p50/p90 is printed with
the ratio of the means of the p50s (the issue's bar: constrained under 1.10x free).

    .venv/bin/python -m loadtest.grammar_ttft [--num 24] [--rate 1.0] [--rounds 2] [--seed 3]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics

from loadtest.client import run_workload
from loadtest.generators import generate, with_arrivals
from loadtest.served import tandem_up
from loadtest.workload import WorkloadRequest

NUM_WARMUP = 4


async def rounds(url: str, constrained: list[WorkloadRequest], num_rounds: int) -> dict:
    free = [dataclasses.replace(r, response_format=None, label="free") for r in constrained]
    await run_workload(url, "smollm2", constrained[:NUM_WARMUP], name="warm-up")
    p50s: dict[str, list[float]] = {"json": [], "free": []}
    for index in range(num_rounds):
        for name, requests in (("json", constrained), ("free", free)):
            summary = (await run_workload(url, "smollm2", requests, name=name)).summary
            p50s[name].append(summary.ttft_p50)
            print(json.dumps({"round": index, "workload": name, "ok": summary.num_ok,
                              "ttft_p50_s": summary.ttft_p50,
                              "ttft_p90_s": summary.ttft_p90}), flush=True)  # fmt: skip
    ratio = statistics.mean(p50s["json"]) / statistics.mean(p50s["free"])
    return {"ttft_p50_json_over_free": round(ratio, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num", type=int, default=24)
    parser.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    if args.num < NUM_WARMUP or args.rounds < 1 or not args.rate > 0:
        parser.error(f"--num must be >= {NUM_WARMUP}, --rounds >= 1 and --rate > 0")
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir("smollm2")[0])
    constrained = with_arrivals(generate(tokenizer, "json", args.num, args.seed), args.rate)
    with tandem_up() as cluster:
        print(json.dumps(asyncio.run(rounds(cluster.url, constrained, args.rounds))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
