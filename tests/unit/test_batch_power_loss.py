"""The batch service after a power cut (or an OS crash), not just a kill: the operating system
then keeps some of what it was given and loses the rest, in no order. SQLite may keep a line's
"answered" record whose answer's bytes the output file lost, or a file may keep a block of zeros
where its answers were. A cut cannot be made here; its effect can: the answer files are cut
back or zeroed under a store whose records are left as they were, then the real runner starts
again and every line must end answered exactly once, its counts those of the files. What is
reported stored (an upload, a batch's creation, its end) must be on the disk when reported:
fsync, the folder's entry and SQLite's synchronous=FULL, checked as they are asked for."""

from __future__ import annotations

import os

import pytest

from services.batch.answers import Answers, error_file_id, output_file_id, recover
from services.batch.api import BatchApi, Limits
from services.batch.store import Store
from tests.unit.test_batch_runner import PlayedClient, answered, line, run, validated_batch

USAGE = {"prompt_tokens": 3, "completion_tokens": 1}


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path)
    yield store
    store.close()


def answer_all(store: Store, custom_ids: list[str]) -> None:
    """Answers the lines as the runner does (to the file, then to SQLite)."""
    answers = Answers(store, "batch_x")
    for custom_id in custom_ids:
        answers.response(custom_id, 200, {"id": f"cmpl-{custom_id}", "usage": USAGE})
    answers.close()


def output_lines(store: Store) -> list[bytes]:
    return store.path_of(output_file_id("batch_x")).read_bytes().splitlines(keepends=True)


def test_answers_a_power_cut_took_from_the_file_are_answered_again(store):
    """SQLite kept the records of c and d, the output file lost their lines: they were
    `answered` with no answer anywhere, and the batch completed without them."""
    validated_batch(store, [line(n, "ok") for n in "abcdef"])
    answer_all(store, list("abcd"))
    kept = output_lines(store)[:2]
    store.path_of(output_file_id("batch_x")).write_bytes(b"".join(kept))
    batch = run(store, PlayedClient())
    assert batch["status"] == "completed"
    assert answered(store, batch) == dict.fromkeys("abcdef", 200)
    assert batch["request_counts"] == {"total": 6, "completed": 6, "failed": 0}


def test_a_block_of_zeros_amid_the_answers_is_cut_and_what_follows_runs_again(store):
    """A file whose size reached the disk before its middle block did reads zeros there, then
    later answers: recovery refused that line (not JSON) at every start, the batch stayed in
    progress for good. The file is cut where it stops being answers; what follows runs again."""
    validated_batch(store, [line(n, "ok") for n in "abcd"])
    answer_all(store, list("abcd"))
    a, b, c, d = output_lines(store)
    zeroed = a + b"\0" * len(b) + c + d
    store.path_of(output_file_id("batch_x")).write_bytes(zeroed)
    batch = run(store, PlayedClient())
    assert batch["status"] == "completed"
    assert answered(store, batch) == dict.fromkeys("abcd", 200)
    assert batch["request_counts"] == {"total": 4, "completed": 4, "failed": 0}
    # each answer counted once: a's as written, b's, c's and d's as the played cluster's
    assert batch["usage"]["input_tokens"] == USAGE["prompt_tokens"]
    assert batch["usage"]["output_tokens"] == 4


@pytest.mark.parametrize(
    "unreadable",
    [b"[1, 2]\n", b'{"custom_id": 7}\n', b'{"no_id": 1}\n', b"\xff\xfe\n", b"nul\0l\n"],
    ids=["not-an-object", "id-not-a-string", "no-id", "not-utf8", "torn-json"],
)
def test_recovery_cuts_the_file_at_the_first_line_that_is_no_answer(store, unreadable):
    validated_batch(store, [line(n, "ok") for n in "abc"])
    answer_all(store, list("abc"))
    a, b, c = output_lines(store)
    store.path_of(output_file_id("batch_x")).write_bytes(a + unreadable + c)
    assert recover(store, "batch_x") == (0, 2)  # none unknown to SQLite; b and c reopened
    assert output_lines(store) == [a]
    assert [row["custom_id"] for row in store.pending_lines("batch_x")] == ["b", "c"]
    assert store.get_batch("batch_x")["request_counts"]["completed"] == 1


def test_a_lost_error_file_reopens_its_lines_and_uncounts_them(store):
    """The error file's entry never reached the disk: its lines, counted `failed`, run again."""
    validated_batch(store, [line(n, "ok") for n in "ab"])
    answers = Answers(store, "batch_x")
    answers.response("a", 200, {"id": "cmpl-a", "usage": USAGE})
    answers.failure("b", "batch_expired", "late")
    answers.close()
    store.path_of(error_file_id("batch_x")).unlink()
    assert recover(store, "batch_x") == (0, 1)
    counts = store.get_batch("batch_x")["request_counts"]
    assert counts == {"total": 2, "completed": 1, "failed": 0}
    assert [row["custom_id"] for row in store.pending_lines("batch_x")] == ["b"]


def test_an_unlost_recovery_changes_nothing(store):
    """After a mere kill (the files whole), recovery keeps every record, and a second one is
    a no-op."""
    validated_batch(store, [line(n, "ok") for n in "abc"])
    answer_all(store, list("ab"))
    before = store.get_batch("batch_x")
    assert recover(store, "batch_x") == (0, 0)
    assert recover(store, "batch_x") == (0, 0)
    assert store.get_batch("batch_x") == before


class FsyncSpy:
    """Records what each os.fsync was asked for (the path of its descriptor), and syncs it."""

    def __init__(self, monkeypatch):
        self.paths: list[str] = []
        real = os.fsync

        def fsync(fd: int) -> None:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            real(fd)

        monkeypatch.setattr(os, "fsync", fsync)


class SqlWatch:
    """The statements the store's connection runs, each with the synchronous mode it ran in
    (FULL: its commit synced the WAL)."""

    def __init__(self, store: Store):
        mode = store.db.execute("PRAGMA synchronous").fetchone()[0]
        self.mode = ("OFF", "NORMAL", "FULL", "EXTRA")[mode]
        self.seen: list[tuple[str, str]] = []
        store.db.set_trace_callback(self._saw)

    def _saw(self, sql: str) -> None:
        if sql.upper().startswith("PRAGMA SYNCHRONOUS="):
            self.mode = sql.split("=")[1].upper()
        else:
            self.seen.append((sql, self.mode))

    def modes_of(self, start: str) -> set[str]:
        return {mode for sql, mode in self.seen if sql.startswith(start)}


def test_an_upload_is_on_the_disk_before_it_is_reported_stored(store, monkeypatch):
    """An upload's bytes and its name in files/ stayed in the OS's cache, its row unsynced: a
    power cut after the client was told `file-...` is stored lost its tail, or the file."""
    api = BatchApi(store, jobs=None, limits=Limits())
    _, begun, _ = api.handle("file_upload_begin", "alice", {"purpose": "batch"}, None)
    params = {"upload_id": begun["upload_id"]}
    api.handle("file_upload_chunk", "alice", params, line("a", "ok") + b"\n")
    spy, watch = FsyncSpy(monkeypatch), SqlWatch(store)
    status, stored, _ = api.handle("file_upload_end", "alice", params, None)
    api.close()
    assert status == 200
    assert spy.paths == [str(store.path_of(stored["id"])), str(store.files_dir)]
    assert watch.modes_of("INSERT INTO files") == {"FULL"}


def test_a_batchs_end_is_durable_and_its_answers_too_but_not_each_record(store, monkeypatch):
    """A completed batch's answers and their folder entry are synced before its status says
    so, and the status is written synced; each line's record is not (thousands a second)."""
    validated_batch(store, [line(n, "ok") for n in "ab"])
    spy, watch = FsyncSpy(monkeypatch), SqlWatch(store)
    batch = run(store, PlayedClient())
    assert batch["status"] == "completed"
    # (synced in a worker thread first, the error file too, empty; then again, at once, as
    # the file is registered)
    synced = {str(store.path_of(batch["output_file_id"])), str(store.files_dir)}
    assert synced <= set(spy.paths) <= synced | {str(store.path_of(error_file_id("batch_x")))}
    assert watch.modes_of("UPDATE batches SET status") == {"FULL"}
    assert watch.modes_of("UPDATE lines SET state") == {"NORMAL"}


def test_the_answer_appends_bench_times_real_answers_and_refuses_no_lines(tmp_path, capsys):
    from loadtest import answer_appends

    answer_appends.main(["--lines", "50", "--dir", str(tmp_path)])
    assert "50 answers, synchronous=NORMAL:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        answer_appends.main(["--lines", "0"])
    assert "--lines must be at least 1" in capsys.readouterr().err
