"""What the Batch API's lookups over a tenant's many batches cost on the service's one loop: a
store holding `--batches` ended batches (`--failed` of them failed with 1,000 line errors each,
as a malformed upload leaves), then the list pages OpenAI's client asks for and a file's
deletion (which looks for the unfinished batches that use the file), each timed through the
real `BatchApi` and `Store`: the median of `--repeats`.

    .venv/bin/python -m loadtest.batch_lists [--batches 10000] [--failed 1000] [--repeats 5]
        [--dir DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

from services.batch.api import BatchApi, Limits
from services.batch.store import Store

ERRORS = {"object": "list", "data": [
    {"code": "invalid_json", "message": "x" * 150, "param": None, "line": n} for n in range(1000)
]}  # fmt: skip


def ended_batches(store: Store, num_batches: int, num_failed: int) -> None:
    with store.transaction():
        for n in range(num_batches):
            status = "failed" if n < num_failed else "completed"
            batch = {"id": f"batch_{n:08d}", "object": "batch", "status": status,
                     "created_at": 1_700_000_000 + n, "endpoint": "/v1/chat/completions",
                     "input_file_id": "file-x", "completion_window": "24h",
                     "metadata": {"k": "v" * 100}, "errors": ERRORS if n < num_failed else None,
                     "_tenant": "alice", "_models": ["m"]}  # fmt: skip
            store.db.execute(
                "INSERT INTO batches (id, tenant, status, body, created_at) VALUES (?, ?, ?, ?, ?)",
                (batch["id"], "alice", status, json.dumps(batch), batch["created_at"]),
            )


def median_ms(call: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--failed", type=int, default=1_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dir", default=None, help="where the scratch store goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(dir=args.dir) as directory:
        store = Store(directory)
        ended_batches(store, args.batches, args.failed)
        api = BatchApi(store, jobs=None, limits=Limits())
        middle = f"batch_{args.batches // 2:08d}"
        pages = ({"limit": 1}, {"limit": 20}, {"limit": 100}, {"limit": 20, "after": middle})
        for params in pages:
            took = median_ms(
                lambda p=params: api.handle("batch_list", "alice", p, None), args.repeats
            )
            print(f"batch_list {json.dumps(params)}: {took:.1f} ms")
        file_ids = iter([f"file-{n}" for n in range(args.repeats)])
        for file_id in [f"file-{n}" for n in range(args.repeats)]:
            store.add_file(file_id, "alice", "batch", "in.jsonl", 1)

        def delete_a_file() -> None:
            status, _, _ = api.handle("file_delete", "alice", {"file_id": next(file_ids)}, None)
            assert status == 200, status

        print(f"file_delete: {median_ms(delete_a_file, args.repeats):.1f} ms")
        store.close()


if __name__ == "__main__":
    main()
