"""The batch service's durable state: one SQLite database (WAL) beside a folder of file contents.

Tables: `files` (uploaded inputs and produced outputs; the bytes live in `files/<id>` on disk,
never in the database), `batches` (one row per job: its state, timestamps, counts and errors) and
`lines` (one row per input line of a validated job: its custom_id, where it sits in the input
file, its prefix key, and whether its answer is written). `lines` is what lets a job resume after
a kill without holding the file in memory: pending lines are read page by page, each line's text
by seeking to its offset. Pages come in prefix-key order (then line order), so lines that share
a prompt prefix are fed together (services.batch.validation.prefix_key). UNIQUE(batch_id,
custom_id) is the duplicate check of validation, and the key that recovery marks answered lines
by.

The service runs on one asyncio thread, with one connection; the long work (validating a 200 MB
file) runs in a worker thread with a connection of its own (a connection is its thread's), which
WAL lets write while the loop's reads go on. Every write commits at once, save the few that must
go together, which `transaction` wraps (and rolls back on any exception); a write waits out the
other connection's (short) write transaction, up to BUSY_TIMEOUT_S.

Durability. A kill -9 loses nothing committed (the OS keeps what it was given); a power cut or
an OS crash loses what was not synced to the disk. So what the service reports stored is synced
first: a file's bytes and its name in files/ before its row (`add_file`), and the writes marked
`@_synced` (files, batches, a batch's lines and total) commit with synchronous=FULL (the WAL
synced, which makes every earlier commit durable too). The rest commit with synchronous=NORMAL,
the connection's mode: above all the per-line record of an answer (`mark_answered`, thousands a
second; switching the mode for each cost a third of its time). A power cut may lose such a
record, or keep it while the answer file lost the line: the answer files are the truth, which
`services.batch.answers.recover` makes the lines' states and the batch's counts agree with
(`reconcile_answers`) when the job starts again. A new write that must outlive a power cut
gets `@_synced`.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, deleted INTEGER NOT NULL DEFAULT 0,
    expires_at INTEGER  -- when the service deletes it (NULL: never)
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL,
    created_at INTEGER NOT NULL, total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0,
    cached_tokens INTEGER NOT NULL DEFAULT 0  -- of the input tokens, those the prefix cache served
);
CREATE TABLE IF NOT EXISTS lines (
    batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL,
    offset INTEGER NOT NULL, length INTEGER NOT NULL,
    state INTEGER NOT NULL DEFAULT 0,  -- 0 pending, 1 answered (in the output or error file)
    prefix_key TEXT NOT NULL DEFAULT '',  -- the start of the line's prompt: the feeding order
    PRIMARY KEY (batch_id, line_no), UNIQUE (batch_id, custom_id)
);
"""
# Databases made before lines had a prefix key, or batches a count of cached tokens, gain the
# column ('' keeps line order; 0 for the lines answered before).
_MIGRATIONS = {
    ("files", "expires_at"): "ALTER TABLE files ADD COLUMN expires_at INTEGER",
    ("lines", "prefix_key"): "ALTER TABLE lines ADD COLUMN prefix_key TEXT NOT NULL DEFAULT ''",
    ("batches", "cached_tokens"): (
        "ALTER TABLE batches ADD COLUMN cached_tokens INTEGER NOT NULL DEFAULT 0"
    ),
}
# Made after the migrations (the feed order's column may be new). The tenant's batches and
# files in rowid order (an index on the tenant alone holds them so): a page of a list sorted
# all of the tenant's rows first, 0.55 s for `limit=1` over 10,000 batches on the loop.
_INDEXES = """
CREATE INDEX IF NOT EXISTS lines_in_feed_order ON lines (batch_id, prefix_key, line_no);
DROP INDEX IF EXISTS batches_by_tenant;  -- (tenant, created_at): no query's order
CREATE INDEX IF NOT EXISTS batches_of_tenant ON batches (tenant);
CREATE INDEX IF NOT EXISTS files_of_tenant ON files (tenant);
"""
PENDING, ANSWERED = 0, 1
DROP_PAGE_LINES = 1000  # lines' rows deleted per write
T = TypeVar("T")
BUSY_TIMEOUT_S = 30.0  # (the other connection's transactions take milliseconds)


def _synced(write: Callable[..., T]) -> Callable[..., T]:
    """A `Store` write whose commits are synced (synchronous=FULL): durable once it returns."""

    @functools.wraps(write)
    def synced_write(self: Store, *args: Any, **kwargs: Any) -> T:
        self.db.execute("PRAGMA synchronous=FULL")
        try:
            return write(self, *args, **kwargs)
        finally:
            self.db.execute("PRAGMA synchronous=NORMAL")

    return synced_write


class Store:
    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files_dir = self.directory / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True)
        self.db = sqlite3.connect(
            self.directory / "batch.sqlite3", isolation_level=None, timeout=BUSY_TIMEOUT_S
        )
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")  # but `@_synced` writes (see the module doc)
        self.db.executescript(SCHEMA)
        for (table, column), statement in _MIGRATIONS.items():
            columns = {row["name"] for row in self.db.execute(f"PRAGMA table_info({table})")}
            if column not in columns:
                self.db.execute(statement)
        self.db.executescript(_INDEXES)

    def close(self) -> None:
        self.db.close()

    def run_apart(self, work: Callable[..., T], *args: Any) -> T:
        """`work(store, *args)` on a store of the same database with a connection of its own,
        made, used and closed here: for a worker thread (`asyncio.to_thread(store.run_apart,
        ...)`), as this store's connection is the loop thread's."""
        own = Store(self.directory)
        try:
            return work(own, *args)
        finally:
            own.close()

    @contextlib.contextmanager
    def transaction(self) -> Iterator[None]:
        """BEGIN ... COMMIT, rolled back on any exception. The connection autocommits, so a
        transaction an exception left open took every later write into itself, never committed
        (and the next BEGIN failed): one bad line's value broke the service until a restart
        threw the writes away. IMMEDIATE: the write lock is taken (or waited for) at BEGIN,
        never refused midway because the other connection wrote since this one read."""
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield
            self.db.execute("COMMIT")
        except BaseException:
            if self.db.in_transaction:  # (SQLite ends some failed transactions itself)
                self.db.execute("ROLLBACK")
            raise

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def sync_file(self, file_id: str) -> None:
        """Syncs the file's bytes and its name in files/ to the disk (after a power cut, a
        file only written and renamed may have lost its tail, or be gone). A file not there
        has nothing to sync (the service names none such; tests add rows alone)."""
        try:
            fsync_path(self.path_of(file_id))
        except FileNotFoundError:
            return
        fsync_path(self.files_dir, os.O_DIRECTORY)

    # -- files --------------------------------------------------------------------------------

    @_synced
    def add_file(
        self,
        file_id: str,
        tenant: str,
        purpose: str,
        filename: str,
        size: int,
        expires_after_s: int | None = None,
    ) -> None:
        """Adds the row of the bytes in files/<file_id>, synced first: a row never names bytes
        that a power cut can take (an upload reported stored, a batch's answers). It expires
        `expires_after_s` after now (None: never)."""
        self.sync_file(file_id)
        created_at = int(time.time())
        expires_at = None if expires_after_s is None else created_at + expires_after_s
        self.db.execute(
            "INSERT INTO files (id, tenant, purpose, filename, bytes, created_at, expires_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (file_id, tenant, purpose, filename, size, created_at, expires_at),
        )

    def expired_files(self, now: int) -> list[tuple[str, str]]:
        """The (tenant, id) of every live file whose `expires_at` is at or before `now`."""
        return self.db.execute(
            "SELECT tenant, id FROM files WHERE deleted = 0 AND expires_at <= ?", (now,)
        ).fetchall()

    def get_file(self, tenant: str, file_id: str) -> sqlite3.Row | None:
        return self.db.execute(
            "SELECT * FROM files WHERE id = ? AND tenant = ? AND deleted = 0", (file_id, tenant)
        ).fetchone()

    def list_files(
        self,
        tenant: str,
        purpose: str | None,
        limit: int,
        after: str | None,
        newest_first: bool = True,
    ):
        """Up to `limit` live files of `tenant`, in creation order (rowid), newest first or
        oldest first; those past the file `after` in that order."""
        sql, args = "SELECT * FROM files WHERE tenant = ? AND deleted = 0", [tenant]
        if purpose is not None:
            sql, args = sql + " AND purpose = ?", [*args, purpose]
        past, direction = ("<", "DESC") if newest_first else (">", "ASC")
        if after is not None:
            sql += f" AND rowid {past} (SELECT rowid FROM files WHERE id = ?)"
            args = [*args, after]
        return self.db.execute(
            f"{sql} ORDER BY rowid {direction} LIMIT ?", [*args, limit]
        ).fetchall()

    def remove_unnamed_files(self, keep: set[str]) -> list[str]:
        """Removes the bytes in files/ that no live file row names (a deleted file's too), save
        those of `keep`; their ids. A kill between an upload's move into files/ and its row,
        or between a deletion's row and its unlink, left such bytes for good."""
        named = {row[0] for row in self.db.execute("SELECT id FROM files WHERE deleted = 0")}
        removed = []
        for path in self.files_dir.iterdir():
            if path.name not in named and path.name not in keep:
                path.unlink(missing_ok=True)
                removed.append(path.name)
        return removed

    @_synced
    def delete_file(self, tenant: str, file_id: str) -> bool:
        cursor = self.db.execute(
            "UPDATE files SET deleted = 1 WHERE id = ? AND tenant = ? AND deleted = 0",
            (file_id, tenant),
        )
        if cursor.rowcount:
            self.path_of(file_id).unlink(missing_ok=True)
        return bool(cursor.rowcount)

    # -- batches ------------------------------------------------------------------------------

    @_synced
    def add_batch(self, batch: dict[str, Any], tenant: str) -> None:
        self.db.execute(
            "INSERT INTO batches (id, tenant, status, body, created_at) VALUES (?, ?, ?, ?, ?)",
            (batch["id"], tenant, batch["status"], json.dumps(batch), batch["created_at"]),
        )

    def get_batch(self, batch_id: str, tenant: str | None = None) -> dict[str, Any] | None:
        sql, args = "SELECT * FROM batches WHERE id = ?", [batch_id]
        if tenant is not None:
            sql, args = sql + " AND tenant = ?", [*args, tenant]
        row = self.db.execute(sql, args).fetchone()
        return None if row is None else _batch_of(row)

    def list_batches(self, tenant: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        sql, args = "SELECT * FROM batches WHERE tenant = ?", [tenant]
        if after is not None:
            sql += " AND rowid < (SELECT rowid FROM batches WHERE id = ? AND tenant = ?)"
            args += [after, tenant]
        rows = self.db.execute(sql + " ORDER BY rowid DESC LIMIT ?", [*args, limit]).fetchall()
        return [_batch_of(row) for row in rows]

    def batches_in(self, *statuses: str) -> list[dict[str, Any]]:
        marks = ",".join("?" * len(statuses))
        rows = self.db.execute(
            f"SELECT * FROM batches WHERE status IN ({marks}) ORDER BY rowid", statuses
        ).fetchall()
        return [_batch_of(row) for row in rows]

    @_synced
    def update_batch(self, batch_id: str, **changes: Any) -> dict[str, Any]:
        """Sets fields of the batch object (status, timestamps, file ids, errors) at once."""
        batch = self.get_batch(batch_id)
        assert batch is not None, batch_id
        batch.update(changes)
        batch.pop("request_counts", None)  # derived from the counters on every read
        batch.pop("usage", None)
        self.db.execute(
            "UPDATE batches SET status = ?, body = ? WHERE id = ?",
            (batch["status"], json.dumps(batch), batch_id),
        )
        return self.get_batch(batch_id)

    # -- lines --------------------------------------------------------------------------------

    @_synced
    def add_lines(self, batch_id: str, rows: list[tuple[int, str, int, int, str]]) -> list[int]:
        """Adds (line_no, custom_id, offset, length, prefix_key) rows; the line numbers whose
        custom_id was already taken (duplicates)."""
        duplicates = []
        with self.transaction():
            for row in rows:
                cursor = self.db.execute(
                    "INSERT OR IGNORE INTO lines "
                    "(batch_id, line_no, custom_id, offset, length, prefix_key) "
                    "VALUES (?, ?, ?, ?, ?, ?)",
                    (batch_id, *row),
                )
                if not cursor.rowcount:
                    duplicates.append(row[0])
        return duplicates

    def drop_lines(self, batch_id: str) -> None:
        """Drops the batch's lines, DROP_PAGE_LINES rows per write: one delete of 50,000 rows
        (each with a prefix key of up to 512 characters) held the write lock for half a second,
        and a write of the other connection (the loop's) waited as long. (Not one transaction:
        every caller drops them all again, or the start-up tidy does, after a kill midway.)"""
        page = (
            "DELETE FROM lines WHERE rowid IN (SELECT rowid FROM lines WHERE batch_id = ? LIMIT ?)"
        )
        num_deleted = DROP_PAGE_LINES
        while num_deleted:  # (the connection autocommits: each page is a write of its own)
            num_deleted = self.db.execute(page, (batch_id, DROP_PAGE_LINES)).rowcount

    def drop_lines_of_batches_not_in(self, *statuses: str) -> int:
        """Drops the lines of every batch whose status is not one of `statuses` (a kill between
        a batch's end and `drop_lines` left them for good: an ended batch is never resumed);
        the number of rows dropped."""
        marks = ",".join("?" * len(statuses))
        cursor = self.db.execute(
            "DELETE FROM lines WHERE batch_id NOT IN "
            f"(SELECT id FROM batches WHERE status IN ({marks}))",
            statuses,
        )
        return cursor.rowcount

    @_synced
    def set_total(self, batch_id: str, total: int) -> None:
        self.db.execute("UPDATE batches SET total = ? WHERE id = ?", (total, batch_id))

    def pending_lines(
        self, batch_id: str, after: tuple[str, int] = ("", 0), limit: int = 256
    ) -> list[sqlite3.Row]:
        """Up to `limit` pending lines in feeding order (prefix key, then line number), those
        after the cursor `after` = (prefix_key, line_no) of the last line of the previous page."""
        return self.db.execute(
            "SELECT line_no, custom_id, offset, length, prefix_key FROM lines WHERE batch_id = ? "
            "AND state = ? AND (prefix_key, line_no) > (?, ?) ORDER BY prefix_key, line_no "
            "LIMIT ?",
            (batch_id, PENDING, *after, limit),
        ).fetchall()

    def num_pending(self, batch_id: str) -> int:
        row = self.db.execute(
            "SELECT COUNT(*) FROM lines WHERE batch_id = ? AND state = ?", (batch_id, PENDING)
        ).fetchone()
        return row[0]

    def mark_answered(
        self, batch_id: str, custom_id: str, ok: bool, usage: dict[str, int] | None = None
    ) -> bool:
        """Records a line's answer (once: False if it was already answered), with its count,
        in one transaction, unsynced (see the module doc)."""
        with self.transaction():
            cursor = self.db.execute(
                "UPDATE lines SET state = ? WHERE batch_id = ? AND custom_id = ? AND state = ?",
                (ANSWERED, batch_id, custom_id, PENDING),
            )
            if cursor.rowcount:
                column = "completed" if ok else "failed"
                self.db.execute(
                    f"UPDATE batches SET {column} = {column} + 1, "
                    "input_tokens = input_tokens + ?, output_tokens = output_tokens + ?, "
                    "cached_tokens = cached_tokens + ? WHERE id = ?",
                    (*token_counts(usage), batch_id),
                )
        return bool(cursor.rowcount)

    def answered_custom_ids(self, batch_id: str) -> set[str]:
        rows = self.db.execute(
            "SELECT custom_id FROM lines WHERE batch_id = ? AND state = ?", (batch_id, ANSWERED)
        )
        return {row[0] for row in rows}

    def reconcile_answers(
        self, batch_id: str, answered_ids: set[str], counts: AnswerCounts
    ) -> tuple[int, int]:
        """Makes the batch's lines and counts say what its answer files hold: `answered_ids`
        answered, every other line pending (its answer lost: run again), the counts `counts`
        (set, not added: a lost answer's usage is known nowhere else); (the number of lines
        marked answered, the number made pending again). Each step can be made again: a kill
        midway is mended by the next recovery."""
        in_db = self.answered_custom_ids(batch_id)
        num_marked = self._set_states(batch_id, answered_ids - in_db, ANSWERED)
        num_reopened = self._set_states(batch_id, in_db - answered_ids, PENDING)
        self._set_counts(batch_id, counts)  # (synced: the states set before it with it)
        return num_marked, num_reopened

    @_synced
    def _set_counts(self, batch_id: str, counts: AnswerCounts) -> None:
        self.db.execute(
            "UPDATE batches SET completed = ?, failed = ?, input_tokens = ?, "
            "output_tokens = ?, cached_tokens = ? WHERE id = ?",
            (
                counts.completed,
                counts.failed,
                counts.input_tokens,
                counts.output_tokens,
                counts.cached_tokens,
                batch_id,
            ),
        )

    def _set_states(self, batch_id: str, custom_ids: Iterable[str], state: int) -> int:
        """Sets the lines' state, DROP_PAGE_LINES per write (see `drop_lines`); how many
        changed."""
        ids, num_changed = sorted(custom_ids), 0
        for start in range(0, len(ids), DROP_PAGE_LINES):
            with self.transaction():
                for custom_id in ids[start : start + DROP_PAGE_LINES]:
                    num_changed += self.db.execute(
                        "UPDATE lines SET state = ? WHERE batch_id = ? AND custom_id = ? "
                        "AND state != ?",
                        (state, batch_id, custom_id, state),
                    ).rowcount
        return num_changed

    def count_by_state(self) -> dict[str, int]:
        rows = self.db.execute("SELECT status, COUNT(*) FROM batches GROUP BY status").fetchall()
        return {status: count for status, count in rows}


def fsync_path(path: Path, flags: int = 0) -> None:
    """Syncs the file (or, with os.O_DIRECTORY, the directory) at `path` to the disk."""
    descriptor = os.open(path, os.O_RDONLY | flags)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _batch_of(row: sqlite3.Row) -> dict[str, Any]:
    batch = json.loads(row["body"])
    # The model its lines run on, which validation holds them to: the relaying gateway's.
    batch["model"] = next(iter(batch.get("_models") or []), None)
    batch["status"] = row["status"]
    batch["request_counts"] = {
        "total": row["total"],
        "completed": row["completed"],
        "failed": row["failed"],
    }
    batch["usage"] = {
        "input_tokens": row["input_tokens"],
        "output_tokens": row["output_tokens"],
        "total_tokens": row["input_tokens"] + row["output_tokens"],
        "input_tokens_details": {"cached_tokens": row["cached_tokens"]},
        "output_tokens_details": {"reasoning_tokens": 0},
    }
    return batch


@dataclass
class AnswerCounts:
    """A batch's counts of answers and their tokens, as its `batches` row keeps them."""

    completed: int = 0
    failed: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0  # of the input tokens, those the prefix cache served

    def add(self, ok: bool, usage: dict[str, Any] | None) -> None:
        if ok:
            self.completed += 1
        else:
            self.failed += 1
        prompt, completion, cached = token_counts(usage)
        self.input_tokens += prompt
        self.output_tokens += completion
        self.cached_tokens += cached


def token_counts(usage: dict[str, Any] | None) -> tuple[int, int, int]:
    """An answer's (prompt, completion, cached prompt) tokens, in a chat's usage terms."""
    usage = usage or {}
    return usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0), _cached_tokens(usage)


def _cached_tokens(usage: dict[str, Any]) -> int:
    """The prompt tokens an answer's usage says the prefix cache served (OpenAI's
    `prompt_tokens_details.cached_tokens`; 0 when it says nothing)."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) else 0
