"""Does a batch job's memory grow with its file? Issue 17 asks that a 50,000-line job run in the
same RSS as a 500-line one: the service streams lines from disk and keeps only its in-flight
window in memory.

Each size runs in a fresh process, with the batch service's own parts (`Store`, `validate`,
`JobRunner`, `Answers`) in a temporary directory: an input file of N completion lines is
validated, then run to completion through the runner's window. The cluster is replaced by an
in-process client that answers every line at once with a fixed completion: the one fake, because
what is measured is the service's bookkeeping (SQLite, the files, the window), not the model.
Reported per size: peak RSS after start-up, peak RSS at the end, their difference, and lines/s.

    .venv/bin/python -m loadtest.batch_memory [--sizes 500,50000] [--max-in-flight 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from services.batch.runner import JobRunner, RunLimits
from services.batch.store import Store
from services.batch.validation import validate

ENDPOINT = "/v1/completions"
MODEL = "smollm2"


class InstantClient:
    """Answers every line at once, as the gateway's RPC door would with a tiny completion."""

    def __init__(self) -> None:
        self.num_calls = 0

    async def call(self, kind: str, body: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        self.num_calls += 1
        await asyncio.sleep(0)  # yield, as a real call would
        return {
            "id": f"cmpl-{self.num_calls}",
            "object": "text_completion",
            "model": body["model"],
            "choices": [{"index": 0, "text": " and so on.", "finish_reason": "length"}],
            "usage": {"prompt_tokens": 12, "completion_tokens": 4, "total_tokens": 16},
        }


def write_input(path: Path, num_lines: int) -> None:
    with open(path, "w") as file:
        for i in range(num_lines):
            body = {"model": MODEL, "prompt": f"Line {i}: a short prompt about item {i % 97}.",
                    "max_tokens": 4}  # fmt: skip
            line = {"custom_id": f"req-{i}", "method": "POST", "url": ENDPOINT, "body": body}
            file.write(json.dumps(line) + "\n")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


async def run_job(directory: Path, num_lines: int, max_in_flight: int) -> dict[str, Any]:
    store = Store(directory)
    write_input(store.path_of("file-in"), num_lines)
    batch = {"id": "batch_memory", "object": "batch", "status": "in_progress", "created_at": 0,
             "endpoint": ENDPOINT, "input_file_id": "file-in", "_tenant": "t",
             "expires_at": time.time() + 86_400}  # fmt: skip
    store.add_batch(batch, "t")
    started_rss = peak_rss_mib()
    started = time.perf_counter()
    num_valid, errors = validate(store, store.get_batch("batch_memory"), [MODEL])
    assert not errors and num_valid == num_lines, errors[:3]
    store.set_total("batch_memory", num_lines)
    validated_rss = peak_rss_mib()
    client = InstantClient()
    runner = JobRunner(store, client, "batch_memory", RunLimits(max_in_flight=max_in_flight))
    await runner.run()
    seconds = time.perf_counter() - started
    done = store.get_batch("batch_memory")
    store.close()
    return {
        "lines": num_lines,
        "status": done["status"],
        "completed": done["request_counts"]["completed"],
        "calls": client.num_calls,
        "rss_start_mib": started_rss,
        "rss_validated_mib": validated_rss,
        "rss_end_mib": peak_rss_mib(),
        "lines_per_s": num_lines / seconds,
    }


def child(num_lines: int, max_in_flight: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        result = asyncio.run(run_job(Path(directory), num_lines, max_in_flight))
    print(json.dumps(result))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", default="500,50000", help="lines per job, comma-separated")
    parser.add_argument("--max-in-flight", type=int, default=32)
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(args.child, args.max_in_flight)
        return
    sizes = [int(size) for size in args.sizes.split(",")]
    if not sizes or min(sizes) < 1 or args.max_in_flight < 1:
        parser.error("--sizes must be positive line counts, --max-in-flight at least 1")
    print(f"{'lines':>7} {'status':>10} {'RSS start':>10} {'validated':>10} {'end':>8} "
          f"{'growth':>8} {'lines/s':>8}")  # fmt: skip
    for size in sizes:
        command = [sys.executable, "-m", "loadtest.batch_memory", "--child", str(size),
                   "--max-in-flight", str(args.max_in_flight)]  # fmt: skip
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        r = json.loads(out.strip().splitlines()[-1])
        growth = r["rss_end_mib"] - r["rss_start_mib"]
        print(f"{r['lines']:>7} {r['status']:>10} {r['rss_start_mib']:>8.1f}MB "
              f"{r['rss_validated_mib']:>8.1f}MB {r['rss_end_mib']:>6.1f}MB {growth:>6.1f}MB "
              f"{r['lines_per_s']:>8.0f}")  # fmt: skip


if __name__ == "__main__":
    main()
