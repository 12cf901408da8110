"""Running a validated job: its lines through the cluster, a bounded window at a time.

The runner pages through the job's pending lines in `lines` (lines that share a prompt prefix
together, so the prefix cache computes a shared system prompt once; the store's feeding order),
reads each line's text
from the input file by its offset, and sends it to a gateway's RPC door as a *bulk* request (the
scheduler serves it only when no interactive request can be placed). At most `window` lines are
in flight; the window follows the cluster's backpressure the way TCP follows loss: a 429 or 503
halves it, and every line waits the Retry-After before trying again (then as many at once as the
window allows); every success widens it by one, up to `max_in_flight`. So a job never dumps its
file into the scheduler's queue, and its memory is the window, not the file.

A line's answer is final when the cluster answers 200 or a client error (400: over the context
limit, a bad sampling value): it goes to the output or error file (`answers`). Cluster trouble
(5xx, a gateway that does not answer in `line_timeout_s`) retries the line, up to
`max_attempts`; a worker's death is handled below us (the gateway resumes the request). A line
longer than one RPC call's JSON (`wire.MAX_JSON_LEN`) is answered 413 without being read (see
`_too_long`).

Cancel stops the feed and aborts the lines in flight (their answers are not written); expiry
(`expires_at` passed) stops the feed, lets the lines in flight finish (a line still refused
with 429/503 then stops retrying; a cancel meanwhile aborts them), and answers every line never
started with a `batch_expired` error: the batch is `expired` if there was one, else
`completed`. A line whose call fails in a way not foreseen is answered with a 500, and an
answer the disk refuses (full) is kept and written again until there is room: every line is
answered exactly once. Then the job is finalized: its output and error
files are registered and the batch object gets their ids.

SQLite may refuse a write too (`database or disk is full`, a lock held past the busy timeout):
an answer written whose record SQLite refuses is recorded again, never written again (the line
would be in both files: its answer, then `batch_expired`, as a line left pending); the end's
expiry and the batch's end state are made again likewise. Each waits, every ANSWER_RETRY_S,
until the disk and SQLite take it (the batch cannot end without them); a cancel still aborts
the lines, a stop still stops the job, and what a stop leaves written the restart's recovery
records (`answers.recover`); what a power cut took from the answer files it runs again.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sqlite3
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from services.batch.answers import Answers, error_file_id, output_file_id, recover
from services.batch.ceding import ceding
from services.batch.store import Store
from services.gateway.openai_protocol import ApiError
from services.gateway.responses_api import chat_body, response_object, responses_param
from services.gateway.rpc_client import AsyncTandemClient, RpcError
from shared import wire
from shared.logs import get_logger

PAGE_LINES = 256
# A Responses line runs as the chat it translates to (services.gateway.responses_api).
KINDS = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "chat"}
RETRY_STATUSES = (429, 503)  # backpressure: wait and retry, the window halves
RECONNECT_WAIT_S = 1.0  # a call dropped with its connection (the gateway restarted) is retried
ANSWER_RETRY_S = 5.0  # what the disk or SQLite refused (full) is written again this often
# The refusals waited out: the disk's (full) and SQLite's (full, locked past its busy timeout, an
# I/O error). Others (a corrupt database, a bug) would be refused for ever: they end the job.
STORAGE_REFUSALS = (OSError, sqlite3.OperationalError)
T = TypeVar("T")


@dataclass(frozen=True)
class RunLimits:
    max_in_flight: int = 128
    line_timeout_s: float = 600.0
    max_attempts: int = 5  # per line, for cluster failures (5xx, no answer)


class _WindowClosed(Exception):
    """The completion window passed while a line waited for the cluster to take it."""


def _error_body(kind: str, message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class JobRunner:
    """Runs one job to its end state; `cancel()` asks it to stop."""

    def __init__(self, store: Store, client: AsyncTandemClient, batch_id: str, limits: RunLimits):
        self.store = store
        self.client = client
        self.batch_id = batch_id
        self.limits = limits
        self.window = float(limits.max_in_flight)
        self.tasks: set[asyncio.Task] = set()  # the lines in flight
        # The lines whose call is out now (not those waiting to try again): at most the window.
        self._calling = 0
        self._call_ended = asyncio.Event()
        # Until when the cluster asked for no call (a refusal's Retry-After), on the loop's clock.
        self._paused_until = 0.0
        self._cancelled = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._expiry_tried = False  # (`_expire_apart`)
        self.log = get_logger(batch_id=batch_id)

    def cancel(self) -> None:
        self._cancelled.set()

    async def run(self) -> None:
        batch = self.store.get_batch(self.batch_id)
        # Reading back the answers a kill left (up to 50,000 lines, seconds) and expiring the
        # lines never started (as many writes) run in a worker thread on a connection of its
        # own: on the loop, the service answered no call meanwhile. (Made again while SQLite
        # refuses it: raised, the job ended at its start, the batch left as it was until the
        # next restart.)
        await self._until_stored("answers not recovered", self._recover_apart)
        answers = Answers(self.store, self.batch_id, recovered=True)
        tasks = self.tasks
        try:
            ended = await self._feed(batch, answers, tasks)
            if ended == "expired":  # the lines in flight finish, unless a cancel comes first
                ended = await self._let_lines_finish() or ended
            if ended == "cancelled":
                for task in tasks:
                    task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            # An answer a cancel aborted while SQLite refused its record is recorded first:
            # pending, it would count as a line never run (and be answered `batch_expired`).
            await self._until_stored("answers not recorded", self._record_unrecorded, answers)
            if ended in ("completed", "expired"):
                # Expired only if some line never ran: the window closed on lines that waited
                # for room, or the feed stopped at the deadline before them. Lines that all ran,
                # the last finishing past the deadline (or a restart in `finalizing` after it),
                # completed the batch. Lines a stopped run answered `batch_expired` are pending
                # no more: the mark it made first (`_lines_expired`) says they never ran.
                # (Counted in a worker thread: 50,000 answered lines' rows took 0.05 s and more.)
                num_pending = await asyncio.to_thread(
                    self.store.run_apart, Store.num_pending, self.batch_id
                )
                never_ran = num_pending or batch.get("_lines_expired")
                ended = "expired" if never_ran else "completed"
            if ended == "expired":
                answers.close()  # (the thread appends with handles of its own)
                await self._until_stored("expiry not marked", self._mark_lines_expired)
                await self._until_stored("expired lines not answered", self._expire_apart)
            await self._finalize(answers, ended)
        except asyncio.CancelledError:  # the service stops: its lines stay pending, for the restart
            for task in tasks:  # (left running, they outlived their job and its answer files)
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # (ended before the files close)
            raise
        finally:
            answers.close()

    async def _feed(self, batch: dict[str, Any], answers: Answers, tasks: set) -> str:
        """Feeds lines until none is left (then 'completed'), or cancel, or expiry."""
        kind = KINDS[batch["endpoint"]]
        cursor = ("", 0)
        with open(self.store.path_of(batch["input_file_id"]), "rb") as source:
            while True:
                page = self.store.pending_lines(self.batch_id, cursor, PAGE_LINES)
                if not page:  # all fed; a cancel or the deadline still counts while some run
                    return await self._wait_for_slot(batch, until_idle=True) or "completed"
                for row in page:
                    ended = await self._wait_for_slot(batch)
                    if ended is not None:
                        return ended
                    cursor = (row["prefix_key"], row["line_no"])
                    if row["length"] > wire.MAX_JSON_LEN:
                        await self._write(answers, row["custom_id"], 413, _too_long(row["length"]))
                        continue
                    source.seek(row["offset"])
                    line = json.loads(source.read(row["length"]))
                    task = asyncio.create_task(self._answer(kind, batch, line, answers))
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                # the last page's lines may still be running: wait for them before the next read
                while tasks and len(page) < PAGE_LINES:
                    ended = await self._wait_for_slot(batch, until_idle=True)
                    if ended is not None:
                        return ended

    def _pause(self, seconds: float) -> None:
        """The cluster refused a line and asked for `seconds` without calls: no line calls
        until then. Each refused line waited its own Retry-After and tried again, whatever the
        others had heard since: a restarted cluster, its workers not registered yet, refused
        a whole window at once, then each line again every second (390 refusals in 4 s)."""
        loop = asyncio.get_running_loop()
        self._paused_until = max(self._paused_until, loop.time() + seconds)

    async def _paused(self) -> None:
        """Waits out the cluster's last Retry-After (a later refusal may lengthen it)."""
        loop = asyncio.get_running_loop()
        while (delay := self._paused_until - loop.time()) > 0:
            await asyncio.sleep(delay)

    async def _call_in_turn(self, kind: str, body: dict[str, Any]) -> dict[str, Any]:
        """One try of a line's call, made after the cluster's last Retry-After and once fewer
        lines than the window are calling: the window bounds the lines fed, and a refused
        line trying again waits for it too (the halved window held back only new lines)."""
        while True:
            await self._paused()
            if self._calling < max(1, int(self.window)):
                break
            self._call_ended.clear()
            await self._call_ended.wait()
        self._calling += 1
        try:
            return await self.client.call(kind, body, self.limits.line_timeout_s)
        finally:
            self._calling -= 1
            self._call_ended.set()

    async def _wait_for_slot(self, batch: dict[str, Any], until_idle: bool = False) -> str | None:
        while len(self.tasks) >= (1 if until_idle else max(1, int(self.window))):
            if self._cancelled.is_set():
                return "cancelled"
            if time.time() >= batch["expires_at"]:
                return "expired"
            await self._wait_for_a_line_to_end()
        if self._cancelled.is_set():
            return "cancelled"
        if time.time() >= batch["expires_at"]:
            return "expired"
        return None

    async def _let_lines_finish(self) -> str | None:
        """Waits for the lines in flight to end; 'cancelled' if a cancel comes first (past the
        deadline, a cancel was ignored until they had run, then the batch said `expired`)."""
        while self.tasks:
            if self._cancelled.is_set():
                return "cancelled"
            await self._wait_for_a_line_to_end()
        return None

    async def _wait_for_a_line_to_end(self) -> None:
        """Until a line in flight ends, at most half a second (cancel and the deadline are
        checked between waits)."""
        self._slot_freed.clear()
        # asyncio.timeout, not wait_for: on Python 3.11 wait_for returns a result that came in
        # the turn its task was cancelled, so a stop landing as a line freed its slot was lost
        # and the job went on (the service's stop waited for it to end).
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(0.5):
                await self._slot_freed.wait()

    async def _answer(self, kind: str, batch: dict, line: dict, answers: Answers) -> None:
        try:
            try:
                status, body = await self._call(kind, batch, line)
            except _WindowClosed:
                return  # left pending: answered `batch_expired`, as the lines never started
            except Exception as error:  # a bug here must not lose the line: a 500 answers it
                self.log.exception("line failed", custom_id=line["custom_id"])
                status, body = 500, _error_body("server_error", f"the line failed: {error!r}")
            await self._write(answers, line["custom_id"], status, body)
        finally:
            self.tasks.discard(asyncio.current_task())  # before the wake-up: the slot is free
            self._slot_freed.set()

    async def _write(self, answers: Answers, custom_id: str, status: int, body: dict) -> None:
        """Appends the line's answer and records it. One the disk refuses (full: `Answers` cuts
        it back) is kept and written again, its slot held, so a job whose disk is full waits
        for room; one written whose record SQLite refuses is recorded again, not written again.
        Raised, either left the line pending: the job, once fed, took it for a line its
        deadline had closed on and ended `expired`, hours early, the line answered
        `batch_expired` although the cluster had answered it (in both files, once written)."""

        async def write_or_record() -> None:
            if custom_id in answers.unrecorded:  # (written: a second copy would answer it twice)
                answers.record(custom_id)
            else:
                answers.response(custom_id, status, body)

        await self._until_stored("line's answer not stored", write_or_record, custom_id=custom_id)

    async def _until_stored(
        self, what: str, step: Callable[..., Awaitable[T]], *args: Any, **log_fields: Any
    ) -> T:
        """`await step(*args)`, made again every ANSWER_RETRY_S while the disk or SQLite
        refuses it (STORAGE_REFUSALS); `what` a refusal left undone, for the log. Logged once:
        a full disk refuses every line in flight."""
        for attempt in itertools.count():
            try:
                return await step(*args)
            except STORAGE_REFUSALS as error:
                if attempt == 0:
                    self.log.error(f"{what}, retrying", error=repr(error), **log_fields)
                await asyncio.sleep(ANSWER_RETRY_S)
        raise AssertionError("unreachable")  # (for the type checker: count() never ends)

    @staticmethod
    async def _record_unrecorded(answers: Answers) -> None:
        for custom_id in list(answers.unrecorded):
            answers.record(custom_id)

    async def _recover_apart(self) -> None:
        _, num_lost = await asyncio.to_thread(self.store.run_apart, recover, self.batch_id)
        if num_lost:  # (the files lost them: a power cut, an OS crash)
            self.log.warning("answers lost from the files, their lines run again", lines=num_lost)

    async def _mark_lines_expired(self) -> None:
        """Marks the batch as one whose lines never started are (being) answered `batch_expired`,
        before they are: a stop before its end left none pending, and the restart completed it
        (the batch said `completed`, its lines `batch_expired`)."""
        self.store.update_batch(self.batch_id, _lines_expired=True)

    async def _expire_apart(self) -> None:
        # A try before this one may have written an answer SQLite then refused to record (its
        # line still pending: expired again, it was answered twice): a retry recovers first.
        again, self._expiry_tried = self._expiry_tried, True
        await asyncio.to_thread(self.store.run_apart, _expire_pending, self.batch_id, again)

    async def _call(self, kind: str, batch: dict, line: dict) -> tuple[int, dict[str, Any]]:
        if batch["endpoint"] == "/v1/responses":
            return await self._respond(batch, line)
        # The owner's tenant is charged, whatever the line says (tenancy: see the service doc).
        return await self._call_body(kind, batch, line, _answered_whole(line["body"]))

    async def _respond(self, batch: dict, line: dict) -> tuple[int, dict[str, Any]]:
        """A Responses API line: its chat answer as a Response, or the chat's refusal with the
        field named as the line has it."""
        body = line["body"]
        try:
            chat = chat_body({**body, "stream": False})
        except ApiError as error:
            return error.status, error.body()
        status, answer = await self._call_body("chat", batch, line, chat)
        if status == 200:
            return status, response_object(body, answer)
        error = answer.get("error") if isinstance(answer, dict) else None
        if isinstance(error, dict) and isinstance(error.get("param"), str):
            answer = {**answer, "error": {**error, "param": responses_param(error["param"])}}
        return status, answer

    async def _call_body(
        self, kind: str, batch: dict, line: dict, body: dict[str, Any]
    ) -> tuple[int, dict[str, Any]]:
        body = {**body, "user": batch["_tenant"]}  # the owner's tenant, whatever the line says
        failures = 0
        while True:
            try:
                response = await self._call_in_turn(kind, body)
                self.window = min(self.limits.max_in_flight, self.window + 1)
                return 200, response
            except RpcError as error:
                if error.status in RETRY_STATUSES:
                    self.window = max(1.0, self.window / 2)
                    self._pause(error.retry_after_s or 1.0)
                    await self._paused()
                    if time.time() >= batch["expires_at"]:  # (a cluster that stays full)
                        raise _WindowClosed from None
                    continue
                if error.status < 500 or failures + 1 >= self.limits.max_attempts:
                    return error.status, error.body
                failures += 1
                self.log.warning("line failed, retrying", status=error.status, error=error.message)
            except TimeoutError as error:
                failures += 1
                if failures >= self.limits.max_attempts:
                    return 504, _error_body("timeout", str(error))
                self.log.warning("line timed out, retrying", custom_id=line["custom_id"])
            except ConnectionError as error:  # the gateway restarted: not the line's failure
                self.log.warning("line's call dropped, retrying", error=str(error))
                await asyncio.sleep(RECONNECT_WAIT_S)
                if time.time() >= batch["expires_at"]:
                    raise _WindowClosed from None
                continue
            await asyncio.sleep(min(8.0, 0.5 * 2**failures))

    async def _finalize(self, answers: Answers, ended: str) -> None:
        """Ends the batch (`_end`, made again while SQLite refuses it: raised, the batch stayed
        `finalizing` or `in_progress`, its answers all written, until the service restarted),
        then drops its lines' rows in a worker thread (50,000 rows took half a second and more,
        in which the service answered no call). The batch has ended by then: a cancel
        meanwhile is refused as for any ended batch, and the rows a stop or a kill leaves the
        start-up tidy drops (`BatchApi._tidy_after_a_kill`)."""
        await asyncio.to_thread(answers.sync)  # (`_end` syncs them again, by then at once)
        if ended == "completed" and self._cancelled.is_set():
            # A cancel taken while the last lines' answers were synced (the batch said
            # `cancelling` to it): it ends `cancelled`, as the cancel's answer promised, not
            # `completed` (its lines all answered, as a cancelled batch's finished ones are).
            ended = "cancelled"
        batch = await self._until_stored("batch not ended", self._end, answers, ended)
        self.log.info("batch finished", status=ended, **batch["request_counts"])
        # (the batch keeps their counts)
        await asyncio.to_thread(self.store.run_apart, Store.drop_lines, self.batch_id)

    async def _end(self, answers: Answers, ended: str) -> dict[str, Any]:
        """Registers the batch's answer files and sets its status and their ids at once (on
        the loop: a cancel meanwhile would see a half-ended batch); the ended batch. Made
        again after a refusal midway: the status set last, each step before it can be."""
        now = int(time.time())
        if ended == "completed":
            self.store.update_batch(self.batch_id, status="finalizing", finalizing_at=now)
        output_bytes, error_bytes = answers.sizes()
        changes: dict[str, Any] = {"status": ended, f"{ended}_at": now}
        batch = self.store.get_batch(self.batch_id, None)
        tenant = batch["_tenant"]
        expires_after_s = batch.get("_output_expires_after_s")  # (its `output_expires_after`)
        if output_bytes:
            file_id = output_file_id(self.batch_id)
            self._register(file_id, tenant, output_bytes, expires_after_s)
            changes["output_file_id"] = file_id
        if error_bytes:
            file_id = error_file_id(self.batch_id)
            self._register(file_id, tenant, error_bytes, expires_after_s)
            changes["error_file_id"] = file_id
        return self.store.update_batch(self.batch_id, **changes)

    def _register(self, file_id: str, tenant: str, size: int, expires_after_s: int | None) -> None:
        if self.store.get_file(tenant, file_id) is None:
            name = f"{file_id}.jsonl"
            self.store.add_file(file_id, tenant, "batch_output", name, size, expires_after_s)


def _answered_whole(body: dict[str, Any]) -> dict[str, Any]:
    """The line's body as a request answered whole (a batch keeps no stream). A line that asked
    for a stream drops its `stream_options` too (its usage is in the answer anyway): sent with
    `stream` false, the options were refused (400), the line failed. Options given with no
    stream are the line's own mistake, refused as at the HTTP route."""
    if body.get("stream") is True:
        body = {key: value for key, value in body.items() if key != "stream_options"}
    return {**body, "stream": False}


def _too_long(num_bytes: int) -> dict[str, Any]:
    """The error a line longer than one RPC call's JSON is answered with, unread. The client
    refused its request (413) too, but only once it had been parsed and serialized on the
    service's one loop (a line of 170 MB of token ids: 4 s in which no call was answered; a
    worker thread is no help, json holds the GIL). The request is the line's body, serialized
    with a space after each comma and colon: only blanks or keys the line wastes around its
    values, or \\u escapes (sent as the characters they name), could make it shorter than the
    line: such a line is refused here though its request would fit."""
    message = (
        f"the line is {num_bytes:,} bytes, more than one RPC call carries "
        f"({wire.MAX_JSON_LEN:,} characters of JSON); nothing was sent"
    )
    return _error_body("invalid_request_error", message)


def _expire_pending(store: Store, batch_id: str, recover_first: bool) -> None:
    """Answers every line still pending `batch_expired` (none runs any more), after recovering
    the answers in the files if `recover_first`."""
    answers = Answers(store, batch_id, recovered=not recover_first)
    try:
        cursor = ("", 0)
        while page := store.pending_lines(batch_id, cursor, PAGE_LINES):
            for row in ceding(page, every=64):  # (each answer a write: see `ceding`)
                answers.failure(
                    row["custom_id"],
                    "batch_expired",
                    "This request could not be executed before the completion window expired.",
                )
                cursor = (row["prefix_key"], row["line_no"])
    finally:
        answers.close()
