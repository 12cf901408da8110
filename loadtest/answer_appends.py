"""What a batch job's bookkeeping costs per answered line: N answers appended through the real
`Answers` and `Store` (the answer file written, then its record in SQLite), timed in a scratch
folder on this disk. `--synchronous FULL` syncs every record, the cost a durable record per
line would have (the service keeps NORMAL for them: its answer files are the truth after a power
cut, see `services/batch/answers.py`).

    .venv/bin/python -m loadtest.answer_appends [--lines 10000] [--synchronous NORMAL|FULL]
        [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

from services.batch.answers import Answers
from services.batch.store import Store
from services.batch.validation import validate

BODY = {"id": "cmpl-1", "choices": [{"text": "hello"}], "usage": {"prompt_tokens": 5}}


def seconds_per_answer(directory: str, num_lines: int, synchronous: str) -> float:
    store = Store(directory)
    lines = [
        json.dumps({"custom_id": f"r{n}", "method": "POST", "url": "/v1/completions",
                    "body": {"model": "m", "prompt": "x"}})
        for n in range(num_lines)
    ]  # fmt: skip
    store.path_of("file-in").write_text("\n".join(lines) + "\n")
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "_tenant": "t",
             "endpoint": "/v1/completions", "input_file_id": "file-in",
             "expires_at": time.time() + 3600}  # fmt: skip
    store.add_batch(batch, "t")
    validate(store, batch, ["m"])
    answers = Answers(store, "batch_x")
    store.db.execute(f"PRAGMA synchronous={synchronous}")
    start = time.perf_counter()
    for n in range(num_lines):
        answers.response(f"r{n}", 200, BODY)
    elapsed = time.perf_counter() - start
    answers.close()
    store.close()
    return elapsed / num_lines


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--synchronous", choices=("NORMAL", "FULL"), default="NORMAL")
    parser.add_argument("--dir", default=None, help="where the scratch folder goes (this disk)")
    args = parser.parse_args(argv)
    if args.lines < 1:
        parser.error(f"--lines must be at least 1, got {args.lines}")
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        seconds = seconds_per_answer(directory, args.lines, args.synchronous)
    print(f"{args.lines} answers, synchronous={args.synchronous}: {seconds * 1e6:.1f} us each")


if __name__ == "__main__":
    main()
