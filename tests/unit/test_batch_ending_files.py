"""The Files API beside a batch that is ending: its answer files, registered before its status
says it has ended, are files its job still writes (on a real SQLite store and the real
runner's end, in a temporary directory)."""

from __future__ import annotations

import asyncio
import json
import sqlite3

import pytest

from services.batch import runner as runner_module
from services.batch.answers import Answers, error_file_id, output_file_id
from services.batch.api import BatchApi, Limits
from services.batch.runner import JobRunner, RunLimits
from services.batch.store import Store
from services.batch.validation import validate

TENANT = "t"
BATCH_ID = "batch_x"


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path)
    yield store
    store.close()


def answered_batch(store: Store) -> Answers:
    """`BATCH_ID`, validated and in progress, its two lines answered: one in the output file,
    one in the error file; the open answers, as its runner holds them when it ends."""
    lines = [
        {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x"},
        }  # fmt: skip
        for custom_id in ("a", "b")
    ]
    content = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    store.path_of("file-in").write_bytes(content)
    batch = {"id": BATCH_ID, "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/completions", "input_file_id": "file-in", "_tenant": TENANT}  # fmt: skip
    store.add_batch(batch, TENANT)
    num_lines, errors = validate(store, store.get_batch(BATCH_ID), ["m"])
    assert errors == []
    store.set_total(BATCH_ID, num_lines)
    answers = Answers(store, BATCH_ID)
    answers.response("a", 200, {"id": "cmpl-1", "choices": []})
    answers.response("b", 400, {"error": {"message": "bad"}})
    return answers


def refuse_the_end_until(store: Store, monkeypatch, released: asyncio.Event) -> asyncio.Event:
    """Makes SQLite refuse the batch's final status (full) until `released`; the event set at
    the first refusal. The answer files are registered by then: `_end` registers them first."""
    refused = asyncio.Event()
    update_batch = store.update_batch

    def full_until_released(batch_id: str, **changes):
        if changes.get("status") == "completed" and not released.is_set():
            refused.set()
            raise sqlite3.OperationalError("database or disk is full")
        return update_batch(batch_id, **changes)

    monkeypatch.setattr(store, "update_batch", full_until_released)
    monkeypatch.setattr(runner_module, "ANSWER_RETRY_S", 0.01)
    return refused


@pytest.mark.parametrize("answer_file_id", [output_file_id, error_file_id])
def test_an_answer_file_cannot_be_deleted_while_its_batch_has_not_ended(
    store, monkeypatch, answer_file_id
):
    """A batch's end registers its answer files, then sets its status; while SQLite refused the
    status (a full disk, retried every 5 s) or after a kill between the two, the files were
    listed, and deleting one was a 200 that removed the answers: the batch then ended
    `completed` naming no output file though it counted the line completed (or, resumed,
    every line ran again and the end failed for good on the deleted file's row). As an input
    file, such a file is a 409 until its batch has ended."""
    answers = answered_batch(store)
    api = BatchApi(store, jobs=None, limits=Limits())
    runner = JobRunner(store, client=None, batch_id=BATCH_ID, limits=RunLimits())
    file_id = answer_file_id(BATCH_ID)

    async def delete_while_the_end_is_refused() -> tuple[int, dict]:
        released = asyncio.Event()
        refused = refuse_the_end_until(store, monkeypatch, released)
        ending = asyncio.create_task(runner._finalize(answers, "completed"))
        await asyncio.wait_for(refused.wait(), 30)
        assert store.get_batch(BATCH_ID)["status"] == "finalizing"
        assert api.handle("file_get", TENANT, {"file_id": file_id}, None)[0] == 200  # listed
        status, body, _ = api.handle("file_delete", TENANT, {"file_id": file_id}, None)
        released.set()
        await asyncio.wait_for(ending, 30)
        return status, body

    status, body = asyncio.run(delete_while_the_end_is_refused())
    answers.close()
    assert status == 409 and BATCH_ID in body["error"]["message"], body
    assert body["error"]["param"] == "file_id"
    batch = store.get_batch(BATCH_ID)
    assert batch["status"] == "completed"
    assert batch["request_counts"] == {"total": 2, "completed": 1, "failed": 1}
    assert (batch["output_file_id"], batch["error_file_id"]) == (
        output_file_id(BATCH_ID),
        error_file_id(BATCH_ID),
    )
    for named, num_lines in ((batch["output_file_id"], 1), (batch["error_file_id"], 1)):
        _, _, content = api.handle("file_content", TENANT, {"file_id": named}, None)
        assert content.count(b"\n") == num_lines
    # Ended, the batch's files are the tenant's to delete.
    assert api.handle("file_delete", TENANT, {"file_id": file_id}, None)[0] == 200
    assert not store.path_of(file_id).exists()
