"""A job's output and error files: answers appended as lines finish, exactly once per custom_id.

Each answer is one line in OpenAI's batch output format, keyed by `custom_id`:

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

Successful lines go to the output file, failed ones (any other status, or `response: null` with
an `error` such as `batch_expired`) to the error file. A line is appended and flushed to the
operating system *before* its row in `lines` is marked answered, so a kill -9 between the two
leaves an answer on disk that the database does not know. `recover` closes that gap when a job
starts (again): it cuts a torn last line, then marks every custom_id found in the files as
answered, which makes the database agree with the files. Whatever is still pending after that
was never written, and runs again: every line is answered exactly once.

The same gap opens without a kill when SQLite refuses the record (`database or disk is full`):
the answer is on disk, its row pending. `Answers` then keeps it in `unrecorded`, for its writer
to `record` again (never to write again: the line would be answered twice).
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any

from services.batch.store import Store


def output_file_id(batch_id: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}o"


def error_file_id(batch_id: str) -> str:
    return f"file-{batch_id.removeprefix('batch_')}e"


class Answers:
    def __init__(self, store: Store, batch_id: str, recovered: bool = False):
        """Opens the job's files, after `recover` unless it `recovered` them already (the
        runner does, in a worker thread: 50,000 answers take seconds)."""
        self.store = store
        self.batch_id = batch_id
        # custom_id -> (ok, usage) of each answer written to its file that SQLite has not
        # recorded yet (it refused: `record` makes the record again).
        self.unrecorded: dict[str, tuple[bool, dict[str, int] | None]] = {}
        self.output_path = store.path_of(output_file_id(batch_id))
        self.error_path = store.path_of(error_file_id(batch_id))
        if not recovered:
            self.recover()
        # Unbuffered: each answer goes to the OS in the call that appends it (`_write_whole`).
        self._output = open(self.output_path, "ab", buffering=0)  # noqa: SIM115 - the job's life
        self._errors = open(self.error_path, "ab", buffering=0)  # noqa: SIM115

    def close(self) -> None:
        """Closes the files; one left empty is removed (no line went there: the batch names
        no such file, and it stayed on disk for good)."""
        self._output.close()
        self._errors.close()
        for path in (self.output_path, self.error_path):
            if path.exists() and path.stat().st_size == 0:
                path.unlink()

    def recover(self) -> int:
        """Marks every answer already in the files; the number that were unknown to SQLite."""
        return recover(self.store, self.batch_id)

    def response(self, custom_id: str, status: int, body: dict[str, Any]) -> None:
        """A line answered by the cluster (status 200) or refused by it (an error body)."""
        request_id = body.get("id") if status == 200 else None
        line = {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body},
            "error": None,
        }
        self._append(line, ok=status == 200)

    def failure(self, custom_id: str, code: str, message: str) -> None:
        """A line that never got a response (expired)."""
        line = {
            "id": f"batch_req_{secrets.token_hex(12)}",
            "custom_id": custom_id,
            "response": None,
            "error": {"code": code, "message": message},
        }
        self._append(line, ok=False)

    def record(self, custom_id: str) -> None:
        """Records in SQLite an answer written but `unrecorded`; a refusal (sqlite3.Error)
        leaves it there, to be recorded again."""
        ok, usage = self.unrecorded[custom_id]
        self.store.mark_answered(self.batch_id, custom_id, ok, usage)
        del self.unrecorded[custom_id]

    def _append(self, line: dict[str, Any], ok: bool) -> None:
        """Writes the answer, then records it. Raises OSError if the disk refused the answer
        (nothing written), sqlite3.Error if SQLite refused its record (then `unrecorded`)."""
        file = self._output if ok else self._errors
        # To the OS before the database: see the module doc.
        _write_whole(file, json.dumps(line, separators=(",", ":")).encode() + b"\n")
        self.unrecorded[line["custom_id"]] = (ok, _usage(line))
        self.record(line["custom_id"])

    def sizes(self) -> tuple[int, int]:
        return _size(self.output_path), _size(self.error_path)


def _write_whole(file: Any, data: bytes) -> None:
    """Appends `data` whole or not at all. A write that fails midway (a full disk) is cut back:
    left, its half line had the next answer appended to it, a line no recovery could read (the
    batch stayed in progress for good, failing at every start)."""
    start = file.seek(0, os.SEEK_END)
    view = memoryview(data)
    try:
        while view:
            view = view[file.write(view) :]
    except OSError:
        file.truncate(start)
        raise


def recover(store: Store, batch_id: str) -> int:
    """Marks every answer already in the job's files answered in `store`; the number that were
    unknown to it (see the module doc)."""
    num_recovered = 0
    paths = store.path_of(output_file_id(batch_id)), store.path_of(error_file_id(batch_id))
    for path, ok in zip(paths, (True, False), strict=True):
        if not path.exists():
            continue
        _cut_torn_tail(path)
        with open(path, "rb") as file:
            for raw in file:
                line = json.loads(raw)
                num_recovered += store.mark_answered(batch_id, line["custom_id"], ok, _usage(line))
    return num_recovered


def _usage(line: dict[str, Any]) -> dict[str, Any] | None:
    """The answer's usage in a chat's terms, what `Store.mark_answered` counts. A Response (a
    `/v1/responses` line) says `input_tokens` and `output_tokens`, its cached ones under
    `input_tokens_details`: taken as they came, none was counted (the batch's usage said 0)."""
    body = (line.get("response") or {}).get("body") or {}
    usage = body.get("usage")
    if not isinstance(usage, dict):
        return None
    if "prompt_tokens" in usage or "input_tokens" not in usage:
        return usage
    details = usage.get("input_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return {
        "prompt_tokens": usage["input_tokens"],
        "completion_tokens": usage.get("output_tokens", 0),
        "prompt_tokens_details": {"cached_tokens": cached or 0},
    }


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


def _cut_torn_tail(path: Path) -> None:
    """Drops a last line that a kill cut short (no final newline)."""
    size = path.stat().st_size
    if size == 0:
        return
    with open(path, "rb+") as file:
        file.seek(-1, os.SEEK_END)
        if file.read(1) == b"\n":
            return
        position = size
        while position > 0:
            step = min(65536, position)
            file.seek(position - step)
            chunk = file.read(step)
            newline = chunk.rfind(b"\n")
            if newline >= 0:
                file.truncate(position - step + newline + 1)
                return
            position -= step
        file.truncate(0)
