"""The batch service's job runner and job manager where the cluster cannot make them misbehave on
demand: a line whose call fails in a way nobody foresaw, a cluster that stays full past the
deadline, a cancel while the last lines run, input no parser expected, a validation that raises,
the disk or SQLite refusing a write (full). Each is answered exactly once per line and ends in a
terminal state. The client is played (its one method, `call`); the store, the files and the
answers are the real ones."""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import sqlite3
import threading
import time

import pytest

from services.batch import answers, jobs, runner
from services.batch.answers import Answers
from services.batch.jobs import JobManager
from services.batch.runner import JobRunner, RunLimits
from services.batch.store import Store
from services.batch.validation import check_line, validate
from services.gateway.openai_protocol import ApiError, parse_completion_request
from services.gateway.rpc_client import RpcError

FULL = RpcError(503, {"error": {"message": "full", "type": "overloaded"}}, retry_after_s=0.02)


class PlayedClient:
    """Answers each line by its prompt: "ok" answers, "bug" raises what no one foresaw, "full"
    is refused with 503 for ever, "slow" waits until cancelled, "dropped" loses its first two
    calls with the connection (a gateway restarting)."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []

    async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
        self.bodies.append(body)
        match body["prompt"]:
            case "bug":
                raise KeyError("choices")
            case "full":
                raise FULL
            case "slow":
                await asyncio.Event().wait()
            case "dropped" if len(self.bodies) <= 2:
                raise ConnectionError("the connection dropped (did the gateway restart?)")
        return {"choices": [{"text": body["prompt"]}], "usage": {"completion_tokens": 1}}


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path)
    yield store
    store.close()


def line(custom_id: str, prompt: str, **extra) -> bytes:
    body = {"model": "m", "prompt": prompt, **extra}
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
                       "body": body}).encode()  # fmt: skip


def validated_batch(store: Store, lines: list[bytes], expires_in_s: float = 3600) -> dict:
    store.path_of("file-in").write_bytes(b"\n".join(lines) + b"\n")
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/completions", "input_file_id": "file-in", "_tenant": "t",
             "expires_at": time.time() + expires_in_s}  # fmt: skip
    store.add_batch(batch, "t")
    num_lines, errors = validate(store, batch, ["m"])
    assert errors == []
    store.set_total(batch["id"], num_lines)
    return batch


def run(store: Store, client: PlayedClient, cancel_after_s: float | None = None) -> dict:
    async def scenario() -> None:
        job = JobRunner(store, client, "batch_x", RunLimits(max_in_flight=4))
        if cancel_after_s is not None:
            asyncio.get_running_loop().call_later(cancel_after_s, job.cancel)
        await asyncio.wait_for(job.run(), 20)

    asyncio.run(scenario())
    return store.get_batch("batch_x")


def answered(store: Store, batch: dict) -> dict[str, int]:
    """custom_id -> the status its answer carries, over the output and error files."""
    statuses = {}
    for key in ("output_file_id", "error_file_id"):
        if batch.get(key):
            for text in store.path_of(batch[key]).read_text().splitlines():
                answer = json.loads(text)
                assert answer["custom_id"] not in statuses, "answered twice"
                response = answer["response"]
                statuses[answer["custom_id"]] = response["status_code"] if response else 0
    return statuses


def test_a_line_whose_call_fails_unforeseen_is_answered_500_and_the_rest_run(store):
    validated_batch(store, [line("a", "ok"), line("b", "bug"), line("c", "ok")])
    batch = run(store, PlayedClient())
    assert batch["status"] == "completed"
    assert answered(store, batch) == {"a": 200, "b": 500, "c": 200}
    assert batch["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    lines_left = store.db.execute("SELECT COUNT(*) FROM lines WHERE batch_id = 'batch_x'")
    assert lines_left.fetchone()[0] == 0  # a finished batch's rows are dropped; counts stay


@pytest.mark.parametrize(("prompt", "kept"), [("ok", "output"), ("bug", "error")])
def test_an_answer_file_left_empty_is_not_left_on_disk(store, prompt, kept):
    """A batch with no failed line has no error file (OpenAI's `error_file_id` is null), nor
    one with no successful line an output file: each stayed on disk, empty, for good."""
    validated_batch(store, [line("a", prompt), line("b", prompt)])
    batch = run(store, PlayedClient())
    on_disk = {
        name: store.path_of(file_id("batch_x")).exists()
        for name, file_id in (("output", answers.output_file_id), ("error", answers.error_file_id))
    }
    assert on_disk == {"output": kept == "output", "error": kept == "error"}
    assert batch[f"{kept}_file_id"] is not None
    assert [key for key in ("output_file_id", "error_file_id") if batch.get(key)] == [
        f"{kept}_file_id"
    ]


def test_body_fields_named_like_the_clients_arguments_are_sent_as_they_are(store):
    """`timeout_s` or `self` in a line's body went to the client's keyword methods as their own
    arguments: a TypeError that lost the line while the batch said completed."""
    validated_batch(store, [line("a", "ok", timeout_s=5, self=1)])
    client = PlayedClient()
    batch = run(store, client)
    assert answered(store, batch) == {"a": 200}
    assert client.bodies[0]["timeout_s"] == 5 and client.bodies[0]["self"] == 1


def test_a_call_dropped_with_the_gateways_connection_is_retried(store, monkeypatch):
    """The client raises ConnectionError for calls in flight when the gateway's connection
    drops: not the line's failure, so neither a 500 (an unforeseen error's answer) nor one of
    its attempts."""
    monkeypatch.setattr(runner, "RECONNECT_WAIT_S", 0.01)
    validated_batch(store, [line("a", "dropped")])
    client = PlayedClient()
    batch = run(store, client)
    assert answered(store, batch) == {"a": 200} and len(client.bodies) == 3


def test_a_cluster_full_past_the_deadline_lets_the_batch_expire(store):
    validated_batch(store, [line("a", "ok"), line("b", "full")], expires_in_s=1.0)
    batch = run(store, PlayedClient())
    assert batch["status"] == "expired"
    assert answered(store, batch) == {"a": 200, "b": 0}  # b: `batch_expired`, no response
    errors = store.path_of(batch["error_file_id"]).read_text()
    assert "batch_expired" in errors


def test_a_cancel_while_the_last_lines_run_cancels(store, monkeypatch):
    """Every line fed (the last page full, so the feed finds no next page) while some still
    run: a cancel then still ends the batch as cancelled."""
    monkeypatch.setattr(runner, "PAGE_LINES", 2)
    validated_batch(store, [line("a", "ok"), line("b", "slow")])
    batch = run(store, PlayedClient(), cancel_after_s=0.5)
    assert batch["status"] == "cancelled"
    assert answered(store, batch) == {"a": 200}


@pytest.mark.parametrize(
    "text, custom_id, codes",
    [
        (
            json.dumps(
                {
                    "custom_id": "a",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {
                        "model": "m",
                        "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
                    },
                }
            ).encode(),
            "a",
            [],
        ),  # fmt: skip
        (b'{"custom_id": "a", "n": ' + b"1" * 5_000 + b"}", None, ["invalid_json"]),
        (b"[" * 200_000, None, ["invalid_json"]),
    ],
    ids=["text-part-null", "int-of-5000-digits", "nested-200000-deep"],
)
def test_input_no_parser_expected_is_checked_not_a_crash(text, custom_id, codes):
    """Each raised past the check (a TypeError, a ValueError, a RecursionError) and left the
    batch `validating` for ever. A null text part is the gateway's 400 when the line runs."""
    found_id, _, problems = check_line(text, "/v1/chat/completions", ["m"])
    assert (found_id, [p["code"] for p in problems]) == (custom_id, codes)


def test_a_validation_that_raises_fails_the_batch_instead_of_leaving_it_validating(
    store, monkeypatch
):
    store.path_of("file-in").write_bytes(line("a", "ok") + b"\n")
    store.add_batch({"id": "batch_x", "status": "validating", "created_at": 0, "endpoint":
                     "/v1/completions", "input_file_id": "file-in", "_models": ["m"],
                     "expires_at": time.time() + 60}, "t")  # fmt: skip

    def raising(*_args):
        raise RuntimeError("a bug")

    monkeypatch.setattr(jobs, "validate", raising)

    async def scenario() -> None:
        manager = JobManager(store, PlayedClient(), RunLimits())
        await manager._drive("batch_x")

    asyncio.run(scenario())
    batch = store.get_batch("batch_x")
    assert batch["status"] == "failed"
    assert batch["errors"]["data"][0]["code"] == "validation_failed"
    assert "a bug" in batch["errors"]["data"][0]["message"]


@pytest.mark.parametrize("input_is", ["good", "bad", "unreadable"])
def test_a_batch_cancelled_while_it_validates_ends_cancelled(store, monkeypatch, input_is):
    """OpenAI's batch cancelled while validating ends `cancelled`. Cancelled, then found to hold
    bad lines, it ended `failed` (the cancel overwritten); cancelled, then its validation
    raised, it stayed `cancelling` until the next restart."""
    from services.batch.api import BatchApi, Limits

    text = {"good": line("a", "ok"), "bad": b"nope", "unreadable": line("a", "ok")}[input_is]
    store.path_of("file-in").write_bytes(text + b"\n")
    store.add_batch({"id": "batch_x", "status": "validating", "created_at": 0, "endpoint":
                     "/v1/completions", "input_file_id": "file-in", "_models": ["m"],
                     "_tenant": "t", "expires_at": time.time() + 60}, "t")  # fmt: skip

    async def cancel() -> None:  # (on the loop, where the store's connection lives)
        status, _, _ = BatchApi(store, manager, Limits()).handle(
            "batch_cancel", "t", {"batch_id": "batch_x"}, None
        )
        assert status == 200 and store.get_batch("batch_x")["status"] == "cancelling"

    def cancelled_meanwhile(own_store, batch, models, _stop):
        # The cancel came in as the validation's thread read the last line (too late to stop
        # it: the stop is not passed on).
        asyncio.run_coroutine_threadsafe(cancel(), loop).result(10)
        if input_is == "unreadable":
            raise OSError("the disk went away")
        return validate(own_store, batch, models)

    monkeypatch.setattr(jobs, "validate", cancelled_meanwhile)

    async def scenario() -> None:
        nonlocal loop
        loop = asyncio.get_running_loop()
        await asyncio.wait_for(manager._drive("batch_x"), 20)

    loop = None
    manager = JobManager(store, PlayedClient(), RunLimits())
    asyncio.run(scenario())
    batch = store.get_batch("batch_x")
    assert (batch["status"], batch.get("failed_at")) == ("cancelled", None)
    assert batch["cancelled_at"] is not None and batch["request_counts"]["completed"] == 0


def test_a_job_stopped_as_a_line_frees_its_slot_stops_and_aborts_its_lines(store):
    """The service's stop cancels each job's task. Cancelled in the loop turn where a finished
    line freed its slot, the wait for that slot (`asyncio.wait_for`, which on Python 3.11
    returns a result that came with the cancel) swallowed the cancel: the job went on feeding,
    the stop waited for it to end (hours) while the service answered no call, and the lines in
    flight outlived their job. The stop now ends the job at once, aborting its lines; they stay
    pending, for the restart."""
    validated_batch(store, [line("a", "ok"), line("b", "slow"), line("c", "ok")])
    client = PlayedClient()

    class StopWhenSet(asyncio.Event):
        def set(self) -> None:
            super().set()
            stopping.cancel()  # (the stop, in the turn the freed slot wakes the feed)

    async def scenario() -> None:
        nonlocal stopping
        job = JobRunner(store, client, "batch_x", RunLimits(max_in_flight=1))
        job._slot_freed = StopWhenSet()
        stopping = asyncio.create_task(job.run())
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(stopping), 5)
        await asyncio.sleep(0)  # (the aborted lines' last turn)
        assert job.tasks == set()

    stopping: asyncio.Task | None = None
    asyncio.run(scenario())
    assert [body["prompt"] for body in client.bodies] == ["ok"]  # nothing fed after the stop
    assert store.get_batch("batch_x")["status"] == "in_progress"
    assert store.num_pending("batch_x") == 2  # b and c: run again by the restart


def test_a_batch_whose_last_lines_finish_past_the_deadline_completes(store):
    """Every line started before the deadline and answered after it: no line expired, yet the
    batch ended `expired` (so `tandem batch submit --wait` exited 1), with every line in its
    output file. The same for a batch the service restarted in `finalizing` past its deadline."""

    class Late(PlayedClient):
        async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
            await asyncio.sleep(0.8)
            return await super().call(kind, body, timeout_s)

    validated_batch(store, [line("a", "ok"), line("b", "ok")], expires_in_s=0.5)
    batch = run(store, Late())
    assert (batch["status"], batch.get("expired_at")) == ("completed", None)
    assert answered(store, batch) == {"a": 200, "b": 200}

    store.update_batch("batch_x", status="finalizing", completed_at=None)  # (then the kill)
    batch = run(store, PlayedClient())
    assert (batch["status"], batch.get("expired_at")) == ("completed", None)
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}


def test_the_batchs_usage_counts_the_prompt_tokens_the_prefix_cache_served(store, tmp_path):
    """Lines are fed in prompt-prefix order so the prefix cache serves their shared start, and
    each answer's usage says how much it served (`prompt_tokens_details.cached_tokens`), yet
    the batch's `usage.input_tokens_details.cached_tokens` was always 0. A database made
    before the count gains it (0 for the lines answered before)."""
    import sqlite3

    class Cached(PlayedClient):
        async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
            answer = await super().call(kind, body, timeout_s)
            usage = {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6,
                     "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
            return {**answer, "usage": usage}

    validated_batch(store, [line("a", "ok"), line("b", "ok")])
    usage = run(store, Cached())["usage"]
    assert (usage["input_tokens"], usage["output_tokens"], usage["total_tokens"]) == (10, 2, 12)
    assert usage["input_tokens_details"] == {"cached_tokens": 8}

    (tmp_path / "old").mkdir()
    old = sqlite3.connect(tmp_path / "old" / "batch.sqlite3")
    old.execute(
        "CREATE TABLE batches (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, "
        "body TEXT NOT NULL, created_at INTEGER NOT NULL, total INTEGER NOT NULL DEFAULT 0, "
        "completed INTEGER NOT NULL DEFAULT 0, failed INTEGER NOT NULL DEFAULT 0, input_tokens "
        "INTEGER NOT NULL DEFAULT 0, output_tokens INTEGER NOT NULL DEFAULT 0)"
    )
    old.execute("INSERT INTO batches VALUES ('batch_o', 't', 'completed', '{}', 0, 1, 1, 0, 5, 1)")
    old.commit()
    old.close()
    reopened = Store(tmp_path / "old")
    assert reopened.get_batch("batch_o")["usage"]["input_tokens_details"] == {"cached_tokens": 0}
    reopened.close()


def test_a_cancel_while_lines_run_past_the_deadline_aborts_them(store):
    """Past the deadline the lines in flight are let finish, but a cancel then was ignored: the
    batch stayed `cancelling` while they ran (up to `line_timeout_s` times `max_attempts`),
    then ended `expired`, not `cancelled`."""
    validated_batch(store, [line("a", "ok"), line("b", "slow")], expires_in_s=0.3)
    batch = run(store, PlayedClient(), cancel_after_s=0.8)
    assert batch["status"] == "cancelled"
    assert answered(store, batch) == {"a": 200}


def test_a_big_jobs_recovery_and_expiry_leave_the_loop_free(store):
    """Reading back the answers a kill left and answering the lines never started
    `batch_expired` ran on the service's one loop: 10,000 lines each took seconds in which the
    service answered no call (the gateway's relays timed out as 503s)."""
    num_lines = 20_000
    validated_batch(store, [line(f"r{n}", "ok") for n in range(num_lines)], expires_in_s=-1)
    answer = {"id": "x", "response": {"status_code": 200, "request_id": "x", "body": {}}}
    with open(store.path_of(answers.output_file_id("batch_x")), "wb") as file:
        for n in range(0, num_lines, 2):  # every other line answered just before a kill
            file.write(json.dumps({**answer, "custom_id": f"r{n}", "error": None}).encode() + b"\n")

    job = JobRunner(store, PlayedClient(), "batch_x", RunLimits())
    longest_gap = asyncio.run(longest_loop_gap_while(job.run()))
    batch = store.get_batch("batch_x")
    assert batch["status"] == "expired"
    counts = {"total": num_lines, "completed": num_lines // 2, "failed": num_lines // 2}
    assert batch["request_counts"] == counts
    assert longest_gap < 0.25, longest_gap


def answered_lines(store: Store, num_lines: int) -> None:
    """A batch whose `num_lines` lines were all answered (as just before its end), each with
    a prompt's full-length start as its feeding key, as a shared system prompt gives."""
    validated_batch(store, [line("r0", "ok")])
    system_prompt = "You are a careful assistant. " * 20
    rows = [(n, f"r{n}", 0, 1, f"{system_prompt}{n:06d}"[:512]) for n in range(num_lines)]
    store.drop_lines("batch_x")
    store.add_lines("batch_x", rows)
    store.db.execute("UPDATE lines SET state = 1 WHERE batch_id = 'batch_x'")
    store.db.execute(
        "UPDATE batches SET total = ?, completed = ? WHERE id = 'batch_x'", (num_lines, num_lines)
    )
    # Their answers, in the output file (the truth: a line SQLite marks answered with none
    # there is one a power cut lost, and recovery runs it again).
    answer = {"id": "x", "response": {"status_code": 200, "request_id": "x", "body": {}}}
    with open(store.path_of(answers.output_file_id("batch_x")), "w") as file:
        for n in range(num_lines):
            file.write(json.dumps({**answer, "custom_id": f"r{n}", "error": None}) + "\n")


async def longest_loop_gap_while(work) -> float:
    """The longest the loop went without a turn (a 10 ms tick) while `work` was awaited."""
    longest_gap, done = 0.0, False

    async def tick() -> None:
        nonlocal longest_gap
        while not done:
            before = time.monotonic()
            await asyncio.sleep(0.01)
            longest_gap = max(longest_gap, time.monotonic() - before)

    ticking = asyncio.create_task(tick())
    await asyncio.sleep(0.05)  # (the tick has begun)
    try:
        await asyncio.wait_for(work, 60)
    finally:
        done = True
        await ticking
    return longest_gap


def test_a_big_jobs_end_leaves_the_loop_free(store):
    """A batch's end dropped its lines' rows on the service's one loop: 50,000 lines, each
    keyed by its prompt's first 512 characters, took half a second and more in which the
    service answered no call."""
    answered_lines(store, 50_000)
    job = JobRunner(store, PlayedClient(), "batch_x", RunLimits())
    longest_gap = asyncio.run(longest_loop_gap_while(job.run()))
    batch = store.get_batch("batch_x")
    assert batch["status"] == "completed" and batch["request_counts"]["completed"] == 50_000
    assert store.db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0
    assert longest_gap < 0.25, longest_gap


def test_a_cancel_or_a_stop_while_a_batch_ends_leaves_it_ended(store, tmp_path, monkeypatch):
    """A batch's end drops its lines' rows in a worker thread, the batch ended already: a
    cancel meanwhile is refused as for any ended batch (409), and a stop (or a kill) leaves it
    ended, its rows dropped by the restart, which resumes nothing."""
    from services.batch.api import BatchApi, Limits

    answered_lines(store, 3)
    dropping, stopped = threading.Event(), threading.Event()

    def drop_once_stopped(self: Store, batch_id: str) -> None:  # (as a kill midway would)
        dropping.set()
        stopped.wait(10)

    monkeypatch.setattr(Store, "drop_lines", drop_once_stopped)

    async def scenario() -> tuple[int, dict]:
        manager = JobManager(store, PlayedClient(), RunLimits())
        api = BatchApi(store, manager, Limits())
        manager.start("batch_x")
        while not dropping.is_set():
            await asyncio.sleep(0.01)
        status, refusal, _ = api.handle("batch_cancel", "t", {"batch_id": "batch_x"}, None)
        await asyncio.wait_for(manager.close(), 5)  # the service's stop
        stopped.set()
        api.close()
        return status, refusal

    status, refusal = asyncio.run(scenario())
    assert status == 409 and "completed" in refusal["error"]["message"]
    assert store.get_batch("batch_x")["status"] == "completed"
    monkeypatch.undo()
    restarted = Store(tmp_path)
    BatchApi(restarted, JobManager(restarted, PlayedClient(), RunLimits()), Limits()).close()
    assert restarted.batches_in(*jobs.UNFINISHED) == []
    assert restarted.db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0
    restarted.close()


def test_a_cancel_taken_as_a_batch_ends_ends_it_cancelled(store, monkeypatch):
    """A cancel that came while the last answers were synced (the batch still `in_progress`)
    was answered `cancelling`, and the batch then ended `completed`: a client waiting for
    `cancelled` never saw it. It ends `cancelled`, its lines all answered."""
    from services.batch.api import BatchApi, Limits

    validated_batch(store, [line("a", "ok"), line("b", "ok")])
    syncing, cancelled = threading.Event(), threading.Event()
    sync = Answers.sync

    def sync_once_cancelled(self: Answers) -> None:
        syncing.set()
        cancelled.wait(10)
        sync(self)

    monkeypatch.setattr(Answers, "sync", sync_once_cancelled)

    async def scenario() -> tuple[int, dict]:
        manager = JobManager(store, PlayedClient(), RunLimits())
        api = BatchApi(store, manager, Limits())
        manager.start("batch_x")
        while not syncing.is_set():
            await asyncio.sleep(0.01)
        status, body, _ = api.handle("batch_cancel", "t", {"batch_id": "batch_x"}, None)
        cancelled.set()
        while store.get_batch("batch_x")["status"] == "cancelling":
            await asyncio.sleep(0.01)
        await asyncio.wait_for(manager.close(), 5)
        api.close()
        return status, body

    status, body = asyncio.run(scenario())
    assert (status, body["status"]) == (200, "cancelling")
    batch = store.get_batch("batch_x")
    assert batch["status"] == "cancelled" and batch["cancelled_at"]
    assert answered(store, batch) == {"a": 200, "b": 200}


def test_a_line_too_long_for_one_call_is_answered_413_unread(store):
    """A line may be as long as its file (200 MB): one of 40 MB of token ids was parsed and
    then serialized for its call on the service's one loop, a second and more in which the
    service answered no call, only for the client to refuse a request over one RPC call's JSON
    (413). Such a line is answered 413 without being read."""
    huge = line("huge", list(range(1_000_000, 6_000_000)))
    validated_batch(store, [line("a", "ok"), huge, line("b", "ok")])
    client = PlayedClient()
    job = JobRunner(store, client, "batch_x", RunLimits())
    longest_gap = asyncio.run(longest_loop_gap_while(job.run()))
    batch = store.get_batch("batch_x")
    assert answered(store, batch) == {"a": 200, "huge": 413, "b": 200}
    assert sorted(body["prompt"] for body in client.bodies) == ["ok", "ok"]  # none sent
    refusal = json.loads(store.path_of(batch["error_file_id"]).read_text())
    assert "more than one RPC call carries" in refusal["response"]["body"]["error"]["message"]
    assert longest_gap < 0.25, longest_gap


def test_dropping_a_big_jobs_lines_apart_leaves_the_loops_writes_free(store):
    """A worker thread dropped a job's lines (a batch's end, a validation refused or started
    again) in one delete that held the database's write lock for a third of a second per
    50,000 lines: a write of the loop's meanwhile (a line of another job answered, a file
    uploaded) waited as long, the service answering no call. They are dropped a page at a time
    now. (A job of 100,000 lines: `--max-lines` raised.)"""
    answered_lines(store, 100_000)

    async def longest_write_while_dropping() -> float:
        dropping = asyncio.create_task(
            asyncio.to_thread(store.run_apart, Store.drop_lines, "batch_x")
        )
        longest_write, num_files = 0.0, 0
        while not dropping.done():
            before = time.monotonic()
            store.add_file(f"file-{num_files}", "t", "batch", "a.jsonl", 1)
            longest_write = max(longest_write, time.monotonic() - before)
            num_files += 1
            await asyncio.sleep(0.005)
        await dropping
        return longest_write

    longest_write = asyncio.run(longest_write_while_dropping())
    assert store.db.execute("SELECT COUNT(*) FROM lines").fetchone()[0] == 0
    assert longest_write < 0.3, longest_write


def test_an_answer_the_disk_could_not_take_is_written_once_there_is_room(store, monkeypatch):
    """A line's answer that the disk refused (full) raised out of the line's task: the line
    stayed pending, and the job, once fed, took it for a line the deadline had closed on. An
    hour before its deadline the batch ended `expired`, the line answered `batch_expired`
    though the cluster had answered it. The answer is kept and written once there is room."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01, raising=False)
    validated_batch(store, [line("a", "ok"), line("b", "ok"), line("c", "ok")])
    write_whole = answers._write_whole
    refusals = [OSError(28, "No space left on device")] * 3

    def full_for_a_while(file, data: bytes) -> None:
        if b'"custom_id":"b"' in data and refusals:
            raise refusals.pop()
        write_whole(file, data)

    monkeypatch.setattr(answers, "_write_whole", full_for_a_while)
    client = PlayedClient()
    batch = run(store, client)
    assert batch["status"] == "completed"
    assert answered(store, batch) == {"a": 200, "b": 200, "c": 200}
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(client.bodies) == 3  # (the answer kept, not asked for again)


class PlayedChat:
    """Answers chat calls with the last message's text; "refuse" is a 400 naming a message."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, dict]] = []

    async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
        self.calls.append((kind, body))
        text = body["messages"][-1]["content"]
        if text == "refuse":
            error = {"message": "no", "type": "invalid_request_error", "param": "messages[1]"}
            raise RpcError(400, {"error": error})
        message = {"role": "assistant", "content": text.upper()}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        return {"choices": [{"index": 0, "message": message, "finish_reason": "stop"}],
                "usage": usage}  # fmt: skip


def test_a_responses_batch_runs_each_line_as_a_chat_and_answers_responses(store):
    """OpenAI's Batch API takes `/v1/responses` lines: each runs as the chat it translates
    to, the owner's tenant charged whatever the line says, and is answered as a Response."""

    def responses_line(custom_id: str, **body) -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/responses",
                           "body": {"model": "m", **body}}).encode()  # fmt: skip

    lines = [
        responses_line("a", instructions="Shout.", input="hi", safety_identifier="someone"),
        responses_line("b", input="x", previous_response_id="resp_1"),
        responses_line("c", input="refuse"),
    ]
    store.path_of("file-in").write_bytes(b"\n".join(lines) + b"\n")
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/responses", "input_file_id": "file-in", "_tenant": "t",
             "expires_at": time.time() + 3600}  # fmt: skip
    store.add_batch(batch, "t")
    num_lines, errors = validate(store, batch, ["m"])
    assert errors == [] and num_lines == 3
    store.set_total("batch_x", num_lines)
    client = PlayedChat()
    ended = run(store, client)
    assert answered(store, ended) == {"a": 200, "b": 400, "c": 400}
    ((kind, body),) = [call for call in client.calls if call[1]["messages"][-1]["content"] == "hi"]
    assert kind == "chat" and body["user"] == "t" and body["stream"] is False
    assert body["messages"][0] == {"role": "system", "content": "Shout."}
    by_id = {}
    for key in ("output_file_id", "error_file_id"):
        for text in store.path_of(ended[key]).read_text().splitlines():
            by_id[json.loads(text)["custom_id"]] = json.loads(text)["response"]["body"]
    assert by_id["a"]["object"] == "response"
    assert by_id["a"]["output"][0]["content"][0]["text"] == "HI"
    assert by_id["b"]["error"]["param"] == "previous_response_id"
    assert by_id["c"]["error"]["param"] == "input"  # (the chat's `messages[1]`)


DB_FULL = sqlite3.OperationalError("database or disk is full")


def refuse_records(monkeypatch, custom_id: str, times: float) -> threading.Event:
    """Makes SQLite refuse to record `custom_id`'s answer (full) `times` times (math.inf: for
    ever); an event set at the first refusal."""
    mark_answered = Store.mark_answered
    refusals = itertools.count()
    refused = threading.Event()

    def full_for_a_while(self, batch_id, answered_id, ok, usage=None):
        if answered_id == custom_id and next(refusals) < times:
            refused.set()
            raise DB_FULL
        return mark_answered(self, batch_id, answered_id, ok, usage)

    monkeypatch.setattr(Store, "mark_answered", full_for_a_while)
    return refused


@pytest.mark.parametrize("times", [1, 3])
def test_an_answer_sqlite_could_not_record_is_recorded_once_it_can_never_answered_again(
    store, monkeypatch, times
):
    """A line's answer written to its file and then refused by SQLite (full: a
    sqlite3.OperationalError, not the OSError the disk's refusal is) raised out of the line's
    task: the line stayed pending, the batch ended `expired` and the line was answered
    `batch_expired` too, one custom_id in both files. Its record is made again until SQLite
    takes it; the answer is not written again."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    validated_batch(store, [line("a", "ok"), line("b", "ok"), line("c", "ok")])
    refuse_records(monkeypatch, "b", times)
    client = PlayedClient()
    batch = run(store, client)
    assert batch["status"] == "completed"
    assert answered(store, batch) == {"a": 200, "b": 200, "c": 200}
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(client.bodies) == 3


def test_an_answer_sqlite_never_records_waits_and_the_restart_records_it_once(
    tmp_path, store, monkeypatch
):
    """SQLite refusing for good, past the deadline: the job waits for it, as for a full disk
    (it cannot end the batch without it), neither expiring the line nor answering it again;
    the service's stop leaves the answer in the file, and the restart records it."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    batch = validated_batch(store, [line("a", "ok"), line("b", "ok"), line("c", "ok")], 1.0)
    refused = refuse_records(monkeypatch, "b", times=math.inf)
    client = PlayedClient()

    async def stopped_past_the_deadline() -> None:
        job = asyncio.create_task(JobRunner(store, client, "batch_x", RunLimits()).run())
        await asyncio.wait_for(asyncio.to_thread(refused.wait), 10)
        await asyncio.sleep(batch["expires_at"] - time.time() + 0.6)
        assert not job.done()  # (neither ended nor crashed)
        job.cancel()  # the service's stop
        with pytest.raises(asyncio.CancelledError):
            await job

    asyncio.run(stopped_past_the_deadline())
    assert store.get_batch("batch_x")["status"] == "in_progress"
    written = store.path_of(answers.output_file_id("batch_x")).read_text().splitlines()
    assert sorted(json.loads(text)["custom_id"] for text in written) == ["a", "b", "c"]
    assert not store.path_of(answers.error_file_id("batch_x")).exists()
    monkeypatch.undo()
    restarted = Store(tmp_path)
    batch = run(restarted, client)
    restarted.close()
    assert batch["status"] == "completed"
    assert answered(store, batch) == {"a": 200, "b": 200, "c": 200}
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
    assert len(client.bodies) == 3


def test_a_cancel_while_sqlite_refuses_an_answers_record_counts_the_answer(store, monkeypatch):
    """A cancel aborts the lines in flight, one among them waiting for SQLite to record its
    written answer: the batch's counts then left out an answer its output file holds."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    validated_batch(store, [line("a", "ok"), line("b", "ok"), line("c", "ok")])
    job = JobRunner(store, PlayedClient(), "batch_x", RunLimits())
    mark_answered = Store.mark_answered

    def full_while_its_line_runs(self, batch_id, custom_id, ok, usage=None):
        if custom_id == "b" and job.tasks:  # (b's own task's tries: the cancel aborts them)
            job.cancel()
            raise DB_FULL
        return mark_answered(self, batch_id, custom_id, ok, usage)

    monkeypatch.setattr(Store, "mark_answered", full_while_its_line_runs)
    asyncio.run(asyncio.wait_for(job.run(), 20))
    batch = store.get_batch("batch_x")
    assert batch["status"] == "cancelled"
    assert answered(store, batch) == {"a": 200, "b": 200, "c": 200}
    assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}


@pytest.mark.parametrize("refused_by", ["sqlite", "disk"])
def test_an_expiry_the_disk_or_sqlite_refuses_is_answered_once_there_is_room(
    store, monkeypatch, refused_by
):
    """A `batch_expired` answer refused (the disk full, or SQLite) raised out of the job: the
    batch stayed `in_progress` past its deadline until the service restarted. The expiry is
    made again until it is taken, each line answered once."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    validated_batch(store, [line("a", "ok"), line("f", "full")], expires_in_s=0.2)
    if refused_by == "sqlite":
        refuse_records(monkeypatch, "f", times=3)
    else:
        write_whole = answers._write_whole
        refusals = [OSError(28, "No space left on device")] * 3

        def full_for_a_while(file, data: bytes) -> None:
            if b'"custom_id":"f"' in data and refusals:
                raise refusals.pop()
            write_whole(file, data)

        monkeypatch.setattr(answers, "_write_whole", full_for_a_while)
    batch = run(store, PlayedClient())
    assert batch["status"] == "expired"
    assert answered(store, batch) == {"a": 200, "f": 0}
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}


def test_a_batchs_end_sqlite_refuses_is_made_once_there_is_room(store, monkeypatch):
    """SQLite refusing the batch's end (its status and file ids) raised out of the job: the
    batch stayed `finalizing`, its answers written, until the service restarted."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    validated_batch(store, [line("a", "ok"), line("b", "ok")])
    update_batch = Store.update_batch
    refusals = [DB_FULL] * 3

    def full_for_a_while(self, batch_id, **changes):
        if changes.get("status") == "completed" and refusals:
            raise refusals.pop()
        return update_batch(self, batch_id, **changes)

    monkeypatch.setattr(Store, "update_batch", full_for_a_while)
    batch = run(store, PlayedClient())
    assert batch["status"] == "completed" and batch["output_file_id"]
    assert answered(store, batch) == {"a": 200, "b": 200}


def test_a_recovery_sqlite_refuses_is_made_once_there_is_room(store, monkeypatch):
    """The restart's recovery of an answer written but never recorded, refused by SQLite,
    raised out of the job at its start: the batch stayed `in_progress` until the next
    restart. It is made again until SQLite takes it, and the line is not run again."""
    monkeypatch.setattr(runner, "ANSWER_RETRY_S", 0.01)
    validated_batch(store, [line("a", "ok"), line("b", "ok")])
    response = {"status_code": 200, "request_id": None, "body": {"choices": []}}
    left = {"id": "batch_req_1", "custom_id": "b", "response": response, "error": None}
    # (as a kill between the answer's write and its record left it)
    store.path_of(answers.output_file_id("batch_x")).write_text(json.dumps(left) + "\n")
    refuse_records(monkeypatch, "b", times=3)
    client = PlayedClient()
    batch = run(store, client)
    assert batch["status"] == "completed"
    assert answered(store, batch) == {"a": 200, "b": 200}
    assert batch["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert [body["prompt"] for body in client.bodies] == ["ok"]  # a alone


def test_a_responses_batch_counts_the_usage_of_its_answers(store):
    """A Response's usage says `input_tokens` and `output_tokens` (its cached ones under
    `input_tokens_details`), not a chat's `prompt_tokens`: a `/v1/responses` batch counted none
    of them, its usage all zeros however much it ran."""
    url = "/v1/responses"
    lines = [
        json.dumps(
            {"custom_id": id_, "method": "POST", "url": url, "body": {"model": "m", "input": text}}
        )
        for id_, text in (("a", "hi"), ("b", "yo"))
    ]
    store.path_of("file-in").write_text("\n".join(lines) + "\n")
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/responses", "input_file_id": "file-in", "_tenant": "t",
             "expires_at": time.time() + 3600}  # fmt: skip
    store.add_batch(batch, "t")
    num_lines, errors = validate(store, batch, ["m"])
    assert errors == []
    store.set_total("batch_x", num_lines)
    ended = run(store, PlayedChat())
    assert ended["request_counts"] == {"total": 2, "completed": 2, "failed": 0}
    assert ended["usage"]["input_tokens"] == 6
    assert ended["usage"]["output_tokens"] == 2
    assert ended["usage"]["total_tokens"] == 8


def test_a_line_that_asks_for_a_stream_with_its_options_is_answered_whole(store):
    """A batch answers each line whole: a line written as it was sent interactively, `stream`
    true with `stream_options` (`include_usage`), was sent with `stream` false and its options
    kept, and the cluster refused it (400: stream_options only allowed when streaming)."""

    class Parsing(PlayedClient):
        async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
            try:
                parse_completion_request(body, "m", 1024)
            except ApiError as error:
                raise RpcError(error.status, error.body()) from None
            return await super().call(kind, body, timeout_s)

    options = {"stream": True, "stream_options": {"include_usage": True}}
    validated_batch(store, [line("a", "ok", **options), line("b", "ok", stream=True)])
    client = Parsing()
    batch = run(store, client)
    assert answered(store, batch) == {"a": 200, "b": 200}
    assert all(body["stream"] is False for body in client.bodies)


def test_a_batch_stopped_after_its_lines_expired_still_ends_expired(store, monkeypatch):
    """The lines never started are answered `batch_expired`, then the batch ends `expired`. A
    stop (a kill, or a restart while SQLite refused the end: full) between the two left no
    line pending, and the restarted job took the batch for one whose lines had all run: it
    ended `completed`, its lines saying `batch_expired`."""

    class Stopped(Exception):
        pass

    async def stopped_before_the_end(self, answers, ended) -> None:
        raise Stopped

    validated_batch(store, [line("a", "ok"), line("b", "ok")], expires_in_s=-1)
    with monkeypatch.context() as patched:
        patched.setattr(JobRunner, "_finalize", stopped_before_the_end)
        with pytest.raises(Stopped):
            run(store, PlayedClient())
    assert store.num_pending("batch_x") == 0  # (both answered `batch_expired`)
    batch = run(store, PlayedClient())  # the restart
    assert batch["status"] == "expired" and batch["expired_at"] is not None
    assert answered(store, batch) == {"a": 0, "b": 0}
    assert batch["request_counts"] == {"total": 2, "completed": 0, "failed": 2}


def test_lines_refused_together_retry_as_the_window_allows_not_all_at_once(store):
    """A restarted cluster refuses every line (503, its workers not registered yet) for a
    while: the whole window of lines in flight was refused, and each retried on its own every
    Retry-After, the halved window holding back only new lines (a tester counted 390 refusals
    in 4 s after a restart). Now a refusal's Retry-After holds every line, and a refused line's
    next try waits for the window too."""

    class Restarting(PlayedClient):
        def __init__(self) -> None:
            super().__init__()
            self.refusals = 0
            self.up_at = time.monotonic() + 0.5

        async def call(self, kind: str, body: dict, timeout_s: float | None = None) -> dict:
            if time.monotonic() < self.up_at:
                self.refusals += 1
                raise FULL  # (Retry-After 0.02 s)
            return await super().call(kind, body, timeout_s)

    batch = validated_batch(store, [line(f"r{i}", "ok") for i in range(64)])
    client = Restarting()

    async def scenario() -> None:
        job = JobRunner(store, client, "batch_x", RunLimits(max_in_flight=64))
        await asyncio.wait_for(job.run(), 20)

    asyncio.run(scenario())
    batch = store.get_batch("batch_x")
    assert set(answered(store, batch).values()) == {200} and len(answered(store, batch)) == 64
    # 0.5 s of refusals 0.02 s apart: about one per Retry-After (23 here); each line for
    # itself made 1,408 (64 lines x 25 pauses, less the first ones').
    assert client.refusals < 64 + 100, client.refusals
