"""The Files and Batches calls, in OpenAI's shapes: one handler per `shared.wire_batch` op.

Every handler gets the caller's tenant (resolved by the gateway from its API key) and sees only
that tenant's files and batches: another tenant's id is answered 404, as if it did not exist.
Uploads arrive in chunks appended to a file under `uploads/` and are moved into `files/` when
complete; the size limit (`max_file_bytes`, 413) is checked on every chunk, so an oversized
upload is refused while it streams, and the line limit (`max_lines`, 400) when a batch is
created. A handler returns (status, body, data frame or None); a body must fit one frame
(`shared.wire_batch.MAX_FRAME_BYTES`), so a list of batches ends its page early (`has_more`)
rather than outgrow MAX_PAGE_BYTES (a failed batch carries up to 1,000 errors).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from services.batch.answers import error_file_id, output_file_id
from services.batch.jobs import UNFINISHED, JobManager
from services.batch.runner import KINDS
from services.batch.store import Store, fsync_path
from services.batch.validation import TooManyBlankLines, has_lone_surrogate, num_requests
from shared.openai_metadata import metadata_problem

Result = tuple[int, dict[str, Any], bytes | None]
_WINDOW = re.compile(r"(\d{1,9})([hms])")  # (int() refuses over 4,300 digits)
_SECONDS = {"h": 3600, "m": 60, "s": 1}
CONTENT_CHUNK_BYTES = 1 << 20
MAX_PAGE_BYTES = 4 << 20  # of a list's objects as JSON (one batch object is ~200 KB at most)
COUNTING_THREADS = 2  # creates counting their files at once (each a second at most)


class ApiFailure(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status = status
        self.body = {
            "error": {
                "message": message,
                "type": "server_error" if status >= 500 else "invalid_request_error",
                "param": param,
                "code": code,
            }
        }


@dataclass(frozen=True)
class Limits:
    max_file_bytes: int = 200 << 20
    max_lines: int = 50_000
    max_list_limit: int = 100  # of a page of batches (OpenAI's bound, and its default 20)
    max_file_list_limit: int = 10_000  # of a page of files (OpenAI's bound and default)
    # An upload the gateway stopped relaying (its client gone, a chunk timed out) is dropped
    # once idle this long, and a tenant has at most so many in progress.
    upload_idle_s: float = 600.0
    max_uploads_per_tenant: int = 16


# A file's expiry, as OpenAI's: an upload's `expires_after`, a batch's `output_expires_after`
# (its output and error files), each {"anchor": "created_at", "seconds": N} with N from an hour
# to thirty days. Its `expires_at` says when; the service's timer deletes it then
# (`drop_expired_files`), unless a batch that has not ended reads or writes it (then at the
# first turn after it ends). Without one a file stays until deleted: a service that ran job
# after job grew its disk by every job's answers, with no way to say "keep them a week".
MIN_EXPIRES_AFTER_S = 3600
MAX_EXPIRES_AFTER_S = 30 * 24 * 3600


@dataclass
class _Upload:
    tenant: str
    purpose: str
    filename: str
    path: Path
    touched_at: float  # (time.monotonic) when it began, or its last chunk came
    size: int = 0
    expires_after_s: int | None = None  # (None: never)


def file_object(row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "expires_at": row["expires_at"],
        "status_details": None,
    }


def files_of(batch: dict[str, Any]) -> set[str]:
    """The ids of the files an unfinished batch's job uses: its input, which it reads until it
    ends (and again after a restart), and its answer files, which it writes. The answer files
    are registered (listed, deletable) before the status that ends the batch is set: between
    the two (SQLite refusing the status while the disk is full, a kill), a deleted one lost
    the answers, and the batch ended `completed` naming no output file."""
    return {batch["input_file_id"], output_file_id(batch["id"]), error_file_id(batch["id"])}


def public(batch: dict[str, Any]) -> dict[str, Any]:
    """The batch object as clients see it: the service's own keys (leading `_`) left out."""
    return {key: value for key, value in batch.items() if not key.startswith("_")}


def page(data: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A list page of `data` (fetched with one more than `limit`, to tell if more follow): the
    first `limit` objects, or fewer when they would outgrow MAX_PAGE_BYTES (never none)."""
    size = 0
    for num_shown, item in enumerate(data[:limit]):
        size += len(json.dumps(item))
        if size > MAX_PAGE_BYTES and num_shown:
            limit = num_shown
            break
    shown = data[:limit]
    return {
        "object": "list",
        "data": shown,
        "has_more": len(data) > limit,
        "first_id": shown[0]["id"] if shown else None,
        "last_id": shown[-1]["id"] if shown else None,
    }


class BatchApi:
    def __init__(self, store: Store, jobs: JobManager, limits: Limits):
        self.store = store
        self.jobs = jobs
        self.limits = limits
        self.uploads_dir = store.directory / "uploads"
        self.uploads_dir.mkdir(exist_ok=True)
        for stale in self.uploads_dir.iterdir():  # uploads cut short by a restart
            stale.unlink()
        self._uploads: dict[str, _Upload] = {}
        # Threads of the creates' own: behind validations (seconds each, in asyncio's default
        # threads), a create's count would outlast the gateway's wait.
        self._counting = ThreadPoolExecutor(COUNTING_THREADS, thread_name_prefix="batch-count")
        self._tidy_after_a_kill()

    def close(self) -> None:
        self._counting.shutdown(wait=False, cancel_futures=True)

    def _tidy_after_a_kill(self) -> None:
        """Removes what a kill between two steps left behind for good: bytes in files/ that no
        row names (an upload's, moved before its row was written), and the lines of ended
        batches. An unfinished batch's input and answer files stay (the answers are
        registered when it ends)."""
        keep = set()
        for batch in self.store.batches_in(*UNFINISHED):
            keep |= files_of(batch)
        self.store.remove_unnamed_files(keep)
        self.store.drop_lines_of_batches_not_in(*UNFINISHED)

    def handle(self, op: str, tenant: str, params: dict, data: bytes | None) -> Result:
        try:
            _refuse_non_unicode(params)
            return getattr(self, op)(tenant, params, data)
        except ApiFailure as failure:
            return failure.status, failure.body, None

    async def answer(self, op: str, tenant: str, params: dict, data: bytes | None) -> Result:
        """`handle`, for the service's loop: a create first counts its file's requests in a
        worker thread (a 200 MB file of one line is read whole: most of a second, in which the
        loop answered no call)."""
        if op == "file_upload_end":
            await self._sync_upload(tenant, params)
        if op != "batch_create":
            return self.handle(op, tenant, params, data)
        try:
            _refuse_non_unicode(params)
            _create_options(params)  # (its errors first, as `batch_create` checks)
            path = self.store.path_of(self._input_file(tenant, params)["id"])
            loop = asyncio.get_running_loop()
            try:
                num_lines = await loop.run_in_executor(self._counting, self._num_requests, path)
            except FileNotFoundError:  # deleted while the count waited for a thread: a 404
                self._input_file(tenant, params)  # (raises it; the service's 500 before)
                raise
            # (checked again: the file may have been deleted meanwhile, a 404 then)
            return self.batch_create(tenant, params, data, num_lines)
        except ApiFailure as failure:
            return failure.status, failure.body, None

    async def _sync_upload(self, tenant: str, params: dict) -> None:
        """An upload's bytes to the disk in a worker thread, before its end registers them
        (`Store.add_file` syncs them again, by then at once: 200 MB synced on the loop held
        every call for seconds). An upload not found is the end's to answer."""
        try:
            path = self._upload(tenant, params).path
        except ApiFailure:
            return
        loop = asyncio.get_running_loop()
        with contextlib.suppress(FileNotFoundError):
            await loop.run_in_executor(self._counting, fsync_path, path)

    # -- files --------------------------------------------------------------------------------

    def file_upload_begin(self, tenant: str, params: dict, _: bytes | None) -> Result:
        if params.get("purpose") != "batch":
            raise ApiFailure(400, "purpose must be 'batch'", "purpose")
        filename = str(params.get("filename") or "upload.jsonl")[:256]
        expires_after_s = _expires_after_seconds(params.get("expires_after"), "expires_after")
        self.drop_idle_uploads()
        in_progress = sum(upload.tenant == tenant for upload in self._uploads.values())
        if in_progress >= self.limits.max_uploads_per_tenant:
            raise ApiFailure(
                429, f"{self.limits.max_uploads_per_tenant} uploads are in progress already", "file"
            )
        upload_id = secrets.token_hex(12)
        path = self.uploads_dir / upload_id
        path.touch()
        self._uploads[upload_id] = _Upload(
            tenant, "batch", filename, path, time.monotonic(), expires_after_s=expires_after_s
        )
        return 200, {"upload_id": upload_id}, None

    def file_upload_chunk(self, tenant: str, params: dict, data: bytes | None) -> Result:
        upload = self._upload(tenant, params)
        upload.touched_at = time.monotonic()
        upload.size += len(data or b"")
        if upload.size > self.limits.max_file_bytes:
            self._drop_upload(params["upload_id"])
            raise ApiFailure(413, f"the file exceeds {self.limits.max_file_bytes} bytes", "file")
        try:
            with open(upload.path, "ab") as file:
                file.write(data or b"")
        except OSError as error:  # (full): raised, a 500, the upload kept for its idle time
            self._drop_upload(params["upload_id"])  # its bytes off the disk that had no room
            reason = error.strerror or str(error)
            raise ApiFailure(507, f"the file could not be stored: {reason}", "file") from None
        return 200, {"bytes": upload.size}, None

    def file_upload_end(self, tenant: str, params: dict, _: bytes | None) -> Result:
        upload = self._upload(tenant, params)
        del self._uploads[params["upload_id"]]
        file_id = f"file-{secrets.token_hex(12)}"
        upload.path.rename(self.store.path_of(file_id))
        try:
            self.store.add_file(
                file_id,
                tenant,
                upload.purpose,
                upload.filename,
                upload.size,
                upload.expires_after_s,
            )
        except Exception:  # (SQLite refused it: full) no row names the bytes, which stayed
            self.store.path_of(file_id).unlink(missing_ok=True)  # until the service restarted
            raise
        return 200, file_object(self.store.get_file(tenant, file_id)), None

    def file_list(self, tenant: str, params: dict, _: bytes | None) -> Result:
        maximum = self.limits.max_file_list_limit
        limit = self._limit(params, default=maximum, maximum=maximum)
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiFailure(400, "order must be 'asc' or 'desc'", "order")
        rows = self.store.list_files(
            tenant,
            params.get("purpose"),
            limit + 1,
            params.get("after"),
            newest_first=order == "desc",
        )
        return 200, page([file_object(row) for row in rows], limit), None

    def file_get(self, tenant: str, params: dict, _: bytes | None) -> Result:
        return 200, file_object(self._file(tenant, params)), None

    def file_delete(self, tenant: str, params: dict, _: bytes | None) -> Result:
        row = self._file(tenant, params)
        unfinished = self.store.batches_in(*UNFINISHED)
        using = [batch["id"] for batch in unfinished if row["id"] in files_of(batch)]
        if using:
            raise ApiFailure(
                409,
                f"the file is read or written by {using[0]}, which has not finished: cancel "
                "it, or delete the file once it has ended",
                "file_id",
            )
        self.store.delete_file(tenant, row["id"])
        return 200, {"id": row["id"], "object": "file", "deleted": True}, None

    def file_content(self, tenant: str, params: dict, _: bytes | None) -> Result:
        row = self._file(tenant, params)
        offset = params.get("offset", 0)
        if not isinstance(offset, int) or offset < 0:
            raise ApiFailure(400, "offset must be a non-negative integer", "offset")
        with open(self.store.path_of(row["id"]), "rb") as file:
            file.seek(offset)
            chunk = file.read(CONTENT_CHUNK_BYTES)
        end = offset + len(chunk)
        more = end < row["bytes"]
        return 200, {"bytes": row["bytes"], "next_offset": end if more else None}, chunk

    # -- batches ------------------------------------------------------------------------------

    def batch_create(
        self, tenant: str, params: dict, _: bytes | None, num_lines: int | None = None
    ) -> Result:
        """Creates the batch, its file's requests counted here unless `num_lines` says how many
        there are (`answer` counts them in a worker thread)."""
        endpoint, window_s, metadata = _create_options(params)
        output_expiry = params.get("output_expires_after")
        output_expires_after_s = _expires_after_seconds(output_expiry, "output_expires_after")
        row = self._input_file(tenant, params)
        if num_lines is None:
            num_lines = self._num_requests(self.store.path_of(row["id"]))
        max_lines = self.limits.max_lines
        if num_lines > max_lines:
            raise ApiFailure(
                400,
                f"the input file has more than {max_lines} requests, the limit",
                "input_file_id",
            )
        now = int(time.time())
        batch = {
            "id": f"batch_{secrets.token_hex(12)}",
            "object": "batch",
            "endpoint": endpoint,
            "errors": None,
            "input_file_id": row["id"],
            "completion_window": params["completion_window"],
            "status": "validating",
            "output_file_id": None,
            "error_file_id": None,
            "created_at": now,
            "in_progress_at": None,
            "expires_at": now + window_s,
            "finalizing_at": None,
            "completed_at": None,
            "failed_at": None,
            "expired_at": None,
            "cancelling_at": None,
            "cancelled_at": None,
            "metadata": metadata,
            "_tenant": tenant,
            "_models": list(params.get("models") or []),
            "_output_expires_after_s": output_expires_after_s,  # (its answer files')
        }
        self.store.add_batch(batch, tenant)
        self.jobs.start(batch["id"])
        return 200, public(self.store.get_batch(batch["id"])), None

    def batch_get(self, tenant: str, params: dict, _: bytes | None) -> Result:
        return 200, public(self._batch(tenant, params)), None

    def batch_list(self, tenant: str, params: dict, _: bytes | None) -> Result:
        limit = self._limit(params)
        batches = self.store.list_batches(tenant, limit + 1, params.get("after"))
        return 200, page([public(b) for b in batches], limit), None

    def batch_cancel(self, tenant: str, params: dict, _: bytes | None) -> Result:
        batch = self._batch(tenant, params)
        if batch["status"] in ("validating", "in_progress"):
            batch = self.store.update_batch(
                batch["id"], status="cancelling", cancelling_at=int(time.time())
            )
            self.jobs.cancel(batch["id"])
        elif batch["status"] != "cancelling":
            raise ApiFailure(409, f"cannot cancel a batch that is {batch['status']}", "batch_id")
        return 200, public(batch), None

    def _num_requests(self, path: Path) -> int:
        """The input file's requests, counted only up to one past the limit, blank lines
        bounded too: a call that outlasts the gateway's wait is answered 503 there while the
        batch is created here (the client retries: two batches)."""
        try:
            return num_requests(path, self.limits.max_lines + 1)
        except TooManyBlankLines as refused:
            raise ApiFailure(400, str(refused), "input_file_id") from None

    # -- lookups ------------------------------------------------------------------------------

    def _input_file(self, tenant: str, params: dict):
        if not isinstance(params.get("input_file_id"), str):  # (not a 404 naming None)
            raise ApiFailure(400, "input_file_id is required: a file's id", "input_file_id")
        row = self._file(tenant, {"file_id": params["input_file_id"]}, "input_file_id")
        if row["purpose"] != "batch":
            raise ApiFailure(400, "the input file's purpose must be 'batch'", "input_file_id")
        return row

    def _file(self, tenant: str, params: dict, param: str = "file_id"):
        file_id = params.get("file_id")
        row = self.store.get_file(tenant, file_id) if isinstance(file_id, str) else None
        if row is None:
            raise ApiFailure(404, f"No such File object: {file_id}", param)
        return row

    def _batch(self, tenant: str, params: dict) -> dict[str, Any]:
        batch_id = params.get("batch_id")
        batch = self.store.get_batch(batch_id, tenant) if isinstance(batch_id, str) else None
        if batch is None:
            raise ApiFailure(404, f"No batch found with id '{batch_id}'.", "batch_id")
        return batch

    def _upload(self, tenant: str, params: dict) -> _Upload:
        upload_id = params.get("upload_id")
        upload = self._uploads.get(upload_id) if isinstance(upload_id, str) else None
        if upload is None and isinstance(upload_id, str):
            # Only the gateway sends upload ids, ours: this one was lost (the service restarted
            # mid-upload, or the upload idled past `upload_idle_s`). A 404 naming `upload_id`
            # was retried by no client, and named a parameter none had sent.
            raise ApiFailure(
                503,
                "the upload was cut short (the batch service restarted, or it waited too "
                "long): upload the file again",
                "file",
            )
        if upload is None or upload.tenant != tenant:
            raise ApiFailure(404, "no such upload in progress", "upload_id")
        return upload

    def drop_expired_files(self, now: float | None = None) -> list[str]:
        """Deletes the files whose `expires_at` has come (now, or `now`), save those a batch
        that has not ended reads or writes; their ids."""
        due = self.store.expired_files(int(time.time() if now is None else now))
        if not due:  # (the usual answer, every turn of the timer: no batch read for it)
            return []
        keep = set()
        for batch in self.store.batches_in(*UNFINISHED):
            keep |= files_of(batch)
        expired = []
        for tenant, file_id in due:
            if file_id not in keep and self.store.delete_file(tenant, file_id):
                expired.append(file_id)
        return expired

    def drop_idle_uploads(self) -> None:
        """Drops the uploads idle past `upload_idle_s`, bytes and all: when one begins, and on
        the service's timer (an abandoned upload kept its bytes until another began)."""
        idle_since = time.monotonic() - self.limits.upload_idle_s
        for upload_id, upload in list(self._uploads.items()):
            if upload.touched_at < idle_since:
                self._drop_upload(upload_id)

    def _drop_upload(self, upload_id: str) -> None:
        upload = self._uploads.pop(upload_id)
        upload.path.unlink(missing_ok=True)

    def _limit(self, params: dict, default: int = 20, maximum: int | None = None) -> int:
        maximum = self.limits.max_list_limit if maximum is None else maximum
        limit = params.get("limit", default)
        if not isinstance(limit, int) or not 1 <= limit <= maximum:
            raise ApiFailure(400, f"limit must be in [1, {maximum}]", "limit")
        return limit


def _refuse_non_unicode(params: dict) -> None:
    """A 400 naming the first parameter that holds a string that is not Unicode: a lone
    surrogate escape (`"\\ud800"`), which JSON allows. Until 2026-12-06 SQLite could not bind
    one as a file's id (the service's 500), and one in a batch's metadata was stored: every
    answer that carried the batch (its GET, the tenant's list) was then the gateway's 500, not
    encodable as UTF-8."""
    for name, value in params.items():
        if has_lone_surrogate(name):  # (not quoted: the answer could not carry it either)
            raise ApiFailure(400, "a parameter's name is not Unicode (a lone surrogate)")
        if has_lone_surrogate(value):
            raise ApiFailure(
                400, f"{name} holds a string that is not Unicode (a lone surrogate)", name
            )


def _create_options(params: dict) -> tuple[str, int, dict | None]:
    """A create's endpoint, completion window in seconds and metadata, checked."""
    endpoint = params.get("endpoint")
    if not isinstance(endpoint, str) or endpoint not in KINDS:  # ([] is not even hashable)
        raise ApiFailure(400, f"endpoint must be one of {', '.join(KINDS)}", "endpoint")
    window_s = _window_seconds(params.get("completion_window"))
    metadata = params.get("metadata")
    problem = metadata_problem(metadata)
    if problem is not None:
        raise ApiFailure(400, problem, "metadata")
    return endpoint, window_s, metadata


def _expires_after_seconds(policy: Any, param: str) -> int | None:
    """The seconds after its creation at which a file expires (None: never), from an expiry
    policy; 400 for one that is not {"anchor": "created_at", "seconds": N} with N in bounds.
    `seconds` may be a string of digits: a multipart form's fields are strings."""
    if policy is None:
        return None
    if not isinstance(policy, dict) or set(policy) != {"anchor", "seconds"}:
        raise ApiFailure(400, f"{param} must be an object of anchor and seconds", param)
    if policy["anchor"] != "created_at":
        raise ApiFailure(400, f"{param}.anchor must be 'created_at'", f"{param}.anchor")
    seconds = policy["seconds"]
    if isinstance(seconds, str) and seconds.isascii() and seconds.isdigit():
        seconds = int(seconds)
    if type(seconds) is not int or not MIN_EXPIRES_AFTER_S <= seconds <= MAX_EXPIRES_AFTER_S:
        raise ApiFailure(
            400,
            f"{param}.seconds must be an integer from {MIN_EXPIRES_AFTER_S} (an hour) to "
            f"{MAX_EXPIRES_AFTER_S} (30 days)",
            f"{param}.seconds",
        )
    return seconds


def _window_seconds(window: Any) -> int:
    """OpenAI's '24h'; tandem also takes other hours, minutes or seconds ('90m', '30s')."""
    match = _WINDOW.fullmatch(window) if isinstance(window, str) else None
    if match is None or int(match[1]) <= 0:
        raise ApiFailure(
            400, "completion_window must be like '24h' (or 'Nh', 'Nm', 'Ns')", "completion_window"
        )
    return int(match[1]) * _SECONDS[match[2]]
