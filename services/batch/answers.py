"""A job's output and error files: answers appended as lines finish, exactly once per custom_id.

Each answer is one line in OpenAI's batch output format, keyed by `custom_id`:

    {"id": "batch_req_...", "custom_id": "...",
     "response": {"status_code": 200, "request_id": "...", "body": {...}}, "error": null}

Successful lines go to the output file, failed ones (any other status, or `response: null` with
an `error` such as `batch_expired`) to the error file. A line is appended and flushed to the
operating system *before* its row in `lines` is marked answered, so a kill -9 between the two
leaves an answer on disk that the database does not know.

A power cut (or an OS crash) opens the other gap: neither write is synced (an fsync per line
would cap a job at the disk's syncs a second), so the disk may keep the record and lose the
line, or keep the file's size and lose a block of it (zeros). The files are therefore the
truth, both ways. `recover` makes the database agree with them when a job starts (again): it
reads the files up to the first line that is no whole answer (a torn last line, zeros, bytes
that are not JSON) and cuts them there, marks every custom_id found answered, makes every
other line pending again, and sets the batch's counts to the files' (see
`Store.reconcile_answers`). Whatever is pending after that has no answer anywhere, and runs
again: every line is answered exactly once. The files are synced when the batch ends, before
its status says so (`Store.add_file` registers them).

The same gap opens without a kill when SQLite refuses the record (`database or disk is full`):
the answer is on disk, its row pending. `Answers` then keeps it in `unrecorded`, for its writer
to `record` again (never to write again: the line would be answered twice).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from services.batch.ceding import ceding
from services.batch.store import AnswerCounts, Store, fsync_path


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

    def recover(self) -> tuple[int, int]:
        """Makes SQLite agree with the files (`recover`)."""
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

    def sync(self) -> None:
        """The answers to the disk, before the batch's end says they are there (a big job's
        files take seconds: a worker thread's work, when no line is being answered)."""
        for path in (self.output_path, self.error_path):
            with contextlib.suppress(FileNotFoundError):  # (closed empty: removed)
                fsync_path(path)

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


def recover(store: Store, batch_id: str) -> tuple[int, int]:
    """Makes the lines and counts of `store` say what the job's answer files hold (see the module
    doc); (the number of answers it had not recorded, the number of lines it had recorded
    answered whose answer the files lost: pending again)."""
    counts, answered_ids = AnswerCounts(), set()
    paths = store.path_of(output_file_id(batch_id)), store.path_of(error_file_id(batch_id))
    for path, ok in zip(paths, (True, False), strict=True):
        for custom_id, usage in _read_answers(path):
            if custom_id not in answered_ids:  # (never twice; counted once if so)
                answered_ids.add(custom_id)
                counts.add(ok, usage)
    return store.reconcile_answers(batch_id, answered_ids, counts)


def _read_answers(path: Path) -> Iterator[tuple[str, dict[str, Any] | None]]:
    """The custom_id and usage of each answer in the file, which is cut at its first line that
    is no whole answer: what follows it (whole answers after a block a power cut zeroed) runs
    again. Lazily: a 50,000-line job's answers are not all held at once."""
    if not path.exists():
        return
    with open(path, "rb+") as file:
        offset = 0
        for raw in ceding(file):  # (read in a worker thread beside the loop)
            answer = _answer_of(raw)
            if answer is None:
                file.truncate(offset)
                return
            yield answer["custom_id"], _usage(answer)
            offset += len(raw)


def _answer_of(raw: bytes) -> dict[str, Any] | None:
    """The answer a line of an answer file holds; None if it holds none (cut short, zeros,
    other bytes)."""
    if not raw.endswith(b"\n"):
        return None
    try:  # (decoded first: given bytes, json guesses UTF-16 or UTF-32 from zeros)
        answer = json.loads(raw.decode())
    except ValueError:  # (UnicodeDecodeError and JSONDecodeError both)
        return None
    if not isinstance(answer, dict) or not isinstance(answer.get("custom_id"), str):
        return None
    if not isinstance(answer.get("response"), dict | None):
        return None
    return answer


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
