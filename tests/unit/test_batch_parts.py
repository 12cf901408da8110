"""The batch service's pure parts: its wire messages, validation of input lines, the answers'
exactly-once recovery after a kill, and the Files API's tenancy and limits (on a real SQLite
store in a temporary directory)."""

from __future__ import annotations

import asyncio
import json
import time

import msgpack
import pytest

from services.batch.answers import Answers, output_file_id
from services.batch.api import BatchApi, Limits
from services.batch.store import Store
from services.batch.validation import PREFIX_KEY_CHARS, check_line, prefix_key, validate
from shared import wire_batch
from shared.openai_metadata import metadata_problem
from shared.wire import WireError


def test_wire_round_trip_with_a_data_frame():
    call = wire_batch.BatchCall(call_id="7", op="file_upload_chunk", tenant="t", params="{}")
    assert wire_batch.decode(wire_batch.encode(call, b"abc")) == (call, b"abc")
    reply = wire_batch.BatchReply(call_id="7", status=404, body='{"error": {}}')
    assert wire_batch.decode(wire_batch.encode(reply)) == (reply, None)


@pytest.mark.parametrize(
    "frames, message",
    [
        ([b"\x40"], "2 or 3 frames"),
        ([b"\x01", msgpack.packb({})], "unknown batch message type"),
        ([b"\x40", b"\xc1"], "not valid msgpack"),
        (
            [b"\x40", msgpack.packb({"call_id": "1", "op": "rm -rf", "tenant": "t", "params": ""})],
            "op",
        ),  # fmt: skip
        ([b"\x40", msgpack.packb({"call_id": "1", "op": "file_get", "tenant": "t"})], "missing"),
        (
            [
                b"\x40",
                msgpack.packb(
                    {"call_id": "1", "op": "file_get", "tenant": "t", "params": "", "extra": 1}
                ),
            ],
            "unknown field",
        ),  # fmt: skip
        (
            [
                b"\x40",
                msgpack.packb(
                    {"call_id": "1", "op": "file_get", "tenant": "t" * 300, "params": ""}
                ),
            ],
            "tenant",
        ),  # fmt: skip
    ],
)
def test_wire_refuses_wrong_frames(frames, message):
    with pytest.raises(WireError, match=message):
        wire_batch.decode(frames)


def test_wire_bounds_the_data_frame():
    call = wire_batch.BatchCall(call_id="1", op="file_get", tenant="t", params="{}")
    with pytest.raises(WireError, match="data frame"):
        wire_batch.encode(call, b"x" * (wire_batch.MAX_CHUNK_BYTES + 1))
    header = wire_batch.encode(call)
    with pytest.raises(WireError, match="data frame"):
        wire_batch.decode([*header, b"x" * (wire_batch.MAX_CHUNK_BYTES + 1)])


def good(
    custom_id: str = "a", url: str = "/v1/completions", model: str = "m", prompt: str = "x"
) -> bytes:
    line = {"custom_id": custom_id, "method": "POST", "url": url,
            "body": {"model": model, "prompt": prompt}}  # fmt: skip
    return json.dumps(line).encode()


def test_check_line_names_each_problem():
    assert check_line(good(), "/v1/completions", ["m"]) == ("a", "x", [])
    codes = lambda text: [p["code"] for p in check_line(text, "/v1/completions", ["m"])[2]]  # noqa: E731
    assert codes(b"[1]") == ["invalid_json"]
    assert codes(b"{") == ["invalid_json"]
    assert codes(good(url="/v1/chat/completions")) == ["mismatched_url"]
    assert codes(good(model="other")) == ["model_not_found"]
    assert codes(good(custom_id="")) == ["missing_required_parameter"]
    # Given, but no such string: an invalid value (it was "missing"), and a body with no model
    # a missing parameter (it was "model_not_found": "the model None is not served here").
    assert codes(good(custom_id="c" * 513)) == ["invalid_value"]
    no_model = {"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {}}
    (problem,) = check_line(json.dumps(no_model).encode(), "/v1/completions", ["m"])[2]
    assert problem["code"] == "missing_required_parameter" and "None" not in problem["message"]


@pytest.fixture
def store(tmp_path):
    store = Store(tmp_path)
    yield store
    store.close()


def new_batch(store: Store, lines: list[bytes], batch_id: str = "batch_x") -> dict:
    store.path_of("file-in").write_bytes(b"\n".join(lines) + b"\n")
    batch = {"id": batch_id, "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/completions", "input_file_id": "file-in", "_tenant": "t"}  # fmt: skip
    store.add_batch(batch, "t")
    return batch


def test_validate_reports_every_bad_line_and_records_none(store):
    batch = new_batch(store, [good("a"), b"", good("a"), b"nope", good("b")])
    num_lines, errors = validate(store, batch, ["m"])
    assert num_lines == 4  # the blank line is skipped, as OpenAI does
    assert [(e["line"], e["code"]) for e in errors] == [(3, "duplicate_custom_id"),
                                                        (4, "invalid_json")]  # fmt: skip
    assert store.num_pending("batch_x") == 0


def test_validate_records_each_line_where_it_sits(store):
    batch = new_batch(store, [good("a"), good("b")])
    assert validate(store, batch, ["m"]) == (2, [])
    rows = store.pending_lines("batch_x")
    text = store.path_of("file-in").read_bytes()
    for row in rows:
        assert (
            json.loads(text[row["offset"] : row["offset"] + row["length"]])["custom_id"]
            == (row["custom_id"])
        )


def test_lines_that_share_a_prompt_start_are_fed_together(store):
    shared = "You are a careful translator. " * 20  # longer than the key
    lines = [good("a", prompt=shared + "one"), good("b", prompt="Hello"),
             good("c", prompt=shared + "two"), good("d", prompt="Hello there"),
             good("e", prompt=shared + "three")]  # fmt: skip
    validate(store, new_batch(store, lines), ["m"])
    order = [row["custom_id"] for row in store.pending_lines("batch_x")]
    assert order == ["b", "d", "a", "c", "e"]  # by prompt start, then file order
    # Paging with the cursor gives the same order, each line once.
    paged, cursor = [], ("", 0)
    while page := store.pending_lines("batch_x", cursor, 2):
        paged += [row["custom_id"] for row in page]
        cursor = (page[-1]["prefix_key"], page[-1]["line_no"])
    assert paged == order


def test_prefix_keys_of_chat_and_completion_lines():
    system = {"role": "system", "content": "S"}
    chat = {"messages": [system, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert prefix_key(chat) == "system\x00S\x00user\x00hi"
    assert prefix_key({"prompt": [1, 2]}) == "1,2,"
    assert prefix_key({"prompt": ["first", "second"]}) == "first"
    assert prefix_key({"prompt": "p" * 2000}) == "p" * PREFIX_KEY_CHARS
    assert prefix_key({"prompt": None, "messages": "nonsense"}) == ""


def test_prefix_keys_of_long_prompts_are_their_start():
    """Only the key's characters are written out (a prompt of millions of token ids was written
    out whole, for seconds, to keep 512 characters); the key is the same."""
    ids = list(range(100_000))
    assert prefix_key({"prompt": ids}) == "".join(f"{i}," for i in ids)[:PREFIX_KEY_CHARS]
    assert prefix_key({"prompt": [ids, [1]]}) == prefix_key({"prompt": ids})
    parts = [{"type": "text", "text": ""}] * 3 + [{"type": "text", "text": "t" * 10_000}]
    messages = [{"role": "user", "content": "m" * 100}] * 1000 + [
        {"role": "user", "content": parts}
    ]
    expected = "\x00".join(f"user\x00{'m' * 100}" for _ in range(1000))[:PREFIX_KEY_CHARS]
    assert prefix_key({"messages": messages}) == expected
    only_parts = [{"role": "user", "content": parts}, "not a message", {"role": "x"}]
    assert prefix_key({"messages": only_parts}) == ("user\x00" + "t" * 10_000)[:PREFIX_KEY_CHARS]
    assert prefix_key({"messages": [{"role": "a", "content": "b"}, 5, {"role": "c"}]}) == (
        "a\x00b\x00c\x00"
    )


def test_an_old_database_gains_the_prefix_key_and_the_files_expiry(tmp_path):
    import sqlite3

    old = sqlite3.connect(tmp_path / "batch.sqlite3")
    old.execute(
        "CREATE TABLE lines (batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT "
        "NOT NULL, offset INTEGER NOT NULL, length INTEGER NOT NULL, state INTEGER NOT NULL "
        "DEFAULT 0, PRIMARY KEY (batch_id, line_no), UNIQUE (batch_id, custom_id))"
    )
    old.execute(
        "CREATE TABLE files (id TEXT PRIMARY KEY, tenant TEXT NOT NULL, purpose TEXT NOT NULL, "
        "filename TEXT NOT NULL, bytes INTEGER NOT NULL, created_at INTEGER NOT NULL, deleted "
        "INTEGER NOT NULL DEFAULT 0)"
    )
    old.execute("INSERT INTO lines VALUES ('batch_x', 1, 'a', 0, 10, 0)")
    old.execute("INSERT INTO files VALUES ('file-a', 't', 'batch', 'a.jsonl', 1, 0, 0)")
    old.commit()
    old.close()
    store = Store(tmp_path)
    assert [row["prefix_key"] for row in store.pending_lines("batch_x")] == [""]
    assert store.get_file("t", "file-a")["expires_at"] is None  # (never, as before)
    assert store.expired_files(1 << 40) == []
    store.close()


def test_answers_are_recovered_exactly_once_after_a_kill(store):
    batch = new_batch(store, [good("a"), good("b"), good("c")])
    validate(store, batch, ["m"])
    answers = Answers(store, "batch_x")
    answers.response("a", 200, {"id": "cmpl-1"})
    answers.close()
    # A kill between the append and the database: "b" is in the file but not marked, and a torn
    # half line of "c" ends the file.
    path = store.path_of(output_file_id("batch_x"))
    line_b = {"id": "r", "custom_id": "b", "response": {"status_code": 200}, "error": None}
    with open(path, "ab") as file:
        file.write(json.dumps(line_b).encode() + b"\n" + b'{"id": "r", "custom_id": "c", "resp')
    recovered = Answers(store, "batch_x")
    recovered.close()
    assert [row["custom_id"] for row in store.pending_lines("batch_x")] == ["c"]
    assert [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines()] == ["a", "b"]
    assert store.get_batch("batch_x")["request_counts"]["completed"] == 2
    assert not store.mark_answered("batch_x", "a", True)  # answered once only


def test_a_responses_usage_is_counted_as_written_and_as_recovered(store):
    """A Response's usage (`input_tokens`, `output_tokens`, cached ones under
    `input_tokens_details`) counts as a chat's does, when written and when recovered after a
    kill: the batch's usage said 0 for every `/v1/responses` line."""
    batch = new_batch(store, [good("a"), good("b")])
    validate(store, batch, ["m"])
    usage = {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 4},
             "output_tokens": 2, "total_tokens": 9}  # fmt: skip
    answers = Answers(store, "batch_x")
    answers.response("a", 200, {"id": "resp_1", "object": "response", "usage": usage})
    answers.close()
    response = {"status_code": 200, "body": {"object": "response", "usage": usage}}
    line_b = {"id": "r", "custom_id": "b", "response": response, "error": None}
    with open(store.path_of(output_file_id("batch_x")), "ab") as file:  # a kill before its record
        file.write(json.dumps(line_b).encode() + b"\n")
    Answers(store, "batch_x").close()
    assert store.get_batch("batch_x")["usage"] == {
        "input_tokens": 14,
        "output_tokens": 4,
        "total_tokens": 18,
        "input_tokens_details": {"cached_tokens": 8},
        "output_tokens_details": {"reasoning_tokens": 0},
    }


class DiskFullOnce:
    """An answer file whose next write gets half its bytes to disk, then no space left."""

    def __init__(self, file):
        self.file, self.failed = file, False

    def write(self, data: bytes) -> int:
        if self.failed:
            return self.file.write(data)
        self.failed = True
        self.file.write(data[: len(data) // 2])
        self.file.flush()
        raise OSError(28, "No space left on device")

    def __getattr__(self, name):
        return getattr(self.file, name)


def test_an_answer_the_disk_could_not_take_leaves_no_torn_line_behind(store):
    """A write that failed midway (a full disk) left half a line, the next answer appended to
    it: recovery then failed on that line at every start, and the batch stayed in progress."""
    batch = new_batch(store, [good("a"), good("b"), good("c")])
    validate(store, batch, ["m"])
    answers = Answers(store, "batch_x")
    answers.response("a", 200, {"id": "cmpl-1"})
    answers._output = DiskFullOnce(answers._output)
    with pytest.raises(OSError):
        answers.response("b", 200, {"id": "cmpl-2"})
    answers.response("c", 200, {"id": "cmpl-3"})  # space again
    answers.close()
    recovered = Answers(store, "batch_x")  # (recovers the files: must read every line)
    recovered.close()
    path = store.path_of(output_file_id("batch_x"))
    assert [json.loads(x)["custom_id"] for x in path.read_bytes().splitlines()] == ["a", "c"]
    assert [row["custom_id"] for row in store.pending_lines("batch_x")] == ["b"]  # runs again


def test_files_are_seen_only_by_their_tenant_and_bounded(store):
    api = BatchApi(store, jobs=None, limits=Limits(max_file_bytes=10))
    status, begun, _ = api.handle("file_upload_begin", "alice", {"purpose": "batch"}, None)
    params = {"upload_id": begun["upload_id"]}
    assert api.handle("file_upload_chunk", "bob", params, b"x")[0] == 404
    assert api.handle("file_upload_chunk", "alice", {"upload_id": [1]}, b"x")[0] == 404
    assert api.handle("file_upload_chunk", "alice", params, b"12345")[0] == 200
    status, created, _ = api.handle("file_upload_end", "alice", params, None)
    assert status == 200 and created["bytes"] == 5
    file_params = {"file_id": created["id"]}
    assert api.handle("file_get", "bob", file_params, None)[0] == 404
    assert api.handle("file_content", "alice", file_params, None)[2] == b"12345"
    assert api.handle("file_list", "bob", {}, None)[1]["data"] == []
    assert api.handle("file_list", "alice", {"limit": 0}, None)[0] == 400
    _, begun, _ = api.handle("file_upload_begin", "alice", {"purpose": "batch"}, None)
    status, body, _ = api.handle("file_upload_chunk", "alice", begun, b"x" * 11)
    assert status == 413 and "10 bytes" in body["error"]["message"]
    assert api.handle("file_upload_begin", "alice", {"purpose": "tune"}, None)[0] == 400


def test_a_file_an_unfinished_batch_reads_cannot_be_deleted_until_it_ends(store):
    """Deleted under a running job, its bytes were gone at the next restart, and the job could
    neither resume nor end."""
    api = BatchApi(store, jobs=None, limits=Limits())
    store.path_of("file-in").write_bytes(good() + b"\n")
    store.add_file("file-in", "alice", "batch", "in.jsonl", len(good()) + 1)
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/completions", "input_file_id": "file-in"}  # fmt: skip
    store.add_batch(batch, "alice")
    status, body, _ = api.handle("file_delete", "alice", {"file_id": "file-in"}, None)
    assert status == 409 and "batch_x" in body["error"]["message"]
    assert store.path_of("file-in").exists()
    store.update_batch("batch_x", status="completed")
    assert api.handle("file_delete", "alice", {"file_id": "file-in"}, None)[0] == 200
    assert not store.path_of("file-in").exists()


def upload(api: BatchApi, tenant: str, data: bytes, **begin) -> tuple[int, dict]:
    status, begun, _ = api.handle("file_upload_begin", tenant, {"purpose": "batch", **begin}, None)
    if status != 200:
        return status, begun
    api.handle("file_upload_chunk", tenant, begun, data)
    return api.handle("file_upload_end", tenant, begun, None)[:2]


@pytest.mark.parametrize(
    ("policy", "param"),
    [
        ({"anchor": "last_active_at", "seconds": 3600}, "expires_after.anchor"),
        ({"anchor": "created_at", "seconds": 3599}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": 30 * 86400 + 1}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": "1e4"}, "expires_after.seconds"),
        ({"anchor": "created_at", "seconds": True}, "expires_after.seconds"),
        ({"anchor": "created_at"}, "expires_after"),
        ("3600", "expires_after"),
    ],
)
def test_a_wrong_expiry_policy_is_refused_naming_its_part(store, policy, param):
    api = BatchApi(store, jobs=None, limits=Limits())
    status, body = upload(api, "alice", b"x", expires_after=policy)
    assert status == 400 and body["error"]["param"] == param, body
    assert api.handle("file_list", "alice", {}, None)[1]["data"] == []


def test_files_expire_when_their_policy_says_unless_a_running_batch_uses_them(store):
    """`expires_after` was ignored: every file stayed until deleted by hand, and a service
    running job after job grew its disk by every job's answers."""
    api = BatchApi(store, jobs=None, limits=Limits())
    policy = {"anchor": "created_at", "seconds": "3600"}  # (a form's field: a string)
    _, doomed = upload(api, "alice", b"old", expires_after=policy)
    _, in_use = upload(api, "alice", good() + b"\n", expires_after=policy)
    _, kept = upload(api, "alice", b"forever")
    assert doomed["expires_at"] == doomed["created_at"] + 3600 and kept["expires_at"] is None
    batch = {"id": "batch_x", "status": "in_progress", "created_at": 0, "endpoint":
             "/v1/completions", "input_file_id": in_use["id"]}  # fmt: skip
    store.add_batch(batch, "alice")
    assert api.drop_expired_files(now=doomed["created_at"] + 3599) == []
    assert api.drop_expired_files(now=doomed["created_at"] + 3600) == [doomed["id"]]
    assert api.handle("file_get", "alice", {"file_id": doomed["id"]}, None)[0] == 404
    assert not store.path_of(doomed["id"]).exists() and store.path_of(in_use["id"]).exists()
    store.update_batch("batch_x", status="completed")  # its job over: the input goes too
    assert api.drop_expired_files(now=doomed["created_at"] + 3600) == [in_use["id"]]
    listed = api.handle("file_list", "alice", {}, None)[1]["data"]
    assert [f["id"] for f in listed] == [kept["id"]]


def test_uploads_left_idle_are_dropped_and_a_tenant_has_few_in_progress(store, monkeypatch):
    """An upload the gateway stopped relaying (its client gone, a chunk timed out) kept its
    entry and its bytes on disk until the service restarted."""
    now = [1_000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    api = BatchApi(store, jobs=None, limits=Limits(upload_idle_s=60, max_uploads_per_tenant=2))
    begin = lambda tenant: api.handle("file_upload_begin", tenant, {"purpose": "batch"}, None)  # noqa: E731
    _, left, _ = begin("alice")
    assert api.handle("file_upload_chunk", "alice", left, b"half a file")[0] == 200
    _, other, _ = begin("alice")
    status, body, _ = begin("alice")
    assert status == 429 and "2 uploads" in body["error"]["message"]
    assert begin("bob")[0] == 200  # (per tenant)
    now[0] += 30
    assert api.handle("file_upload_chunk", "alice", other, b"x")[0] == 200  # (touched: kept)
    now[0] += 45  # `left` idle 75 s, `other` 45 s
    assert begin("alice")[0] == 200
    assert api.handle("file_upload_chunk", "alice", left, b"rest")[0] == 503  # (upload again)
    assert not (store.directory / "uploads" / left["upload_id"]).exists()
    assert api.handle("file_upload_end", "alice", other, None)[0] == 200


def test_a_write_an_exception_breaks_is_rolled_back_and_the_store_goes_on(tmp_path):
    """The connection autocommits; an exception inside BEGIN ... COMMIT (SQLite cannot encode a
    lone surrogate) left the transaction open: every later write went into it, the next BEGIN
    failed, and a restart threw them all away."""
    store = Store(tmp_path)
    new_batch(store, [good("a")])
    with pytest.raises(UnicodeEncodeError):
        store.add_lines("batch_x", [(1, "a", 0, 10, ""), (2, "b\ud83d", 11, 10, "")])
    assert not store.db.in_transaction
    assert store.add_lines("batch_x", [(1, "a", 0, 10, "")]) == []  # (the first row rolled back)
    store.update_batch("batch_x", status="failed")
    store.close()
    reopened = Store(tmp_path)
    assert reopened.get_batch("batch_x")["status"] == "failed"
    assert [row["custom_id"] for row in reopened.pending_lines("batch_x")] == ["a"]
    reopened.close()


def test_a_line_with_a_lone_surrogate_is_refused_naming_its_line(store):
    """json.loads takes a lone surrogate escape; SQLite could not store it (it broke the store:
    see above), nor could the cluster take it. Anywhere in the line: a value, a key, the id."""
    in_a_key = (b'{"custom_id": "d", "method": "POST", "url": "/v1/completions", "body": '
                b'{"model": "m", "prompt": "x", "logit_bias": {"\\udfff": 1}}}')  # fmt: skip
    lines = [good("a"), good("b", prompt="hi \ud83d"), good("c\udc00"), in_a_key, good("e")]
    assert json.loads(lines[1])["body"]["prompt"] == "hi \ud83d"  # (json.dumps escaped it)
    num_lines, errors = validate(store, new_batch(store, lines), ["m"])
    assert num_lines == 5
    assert [(e["line"], e["code"]) for e in errors] == [(2, "invalid_json"), (3, "invalid_json"),
                                                        (4, "invalid_json")]  # fmt: skip
    assert "not Unicode" in errors[0]["message"] and not store.db.in_transaction
    assert validate(store, new_batch(store, [good("a")], "batch_y"), ["m"]) == (1, [])


@pytest.mark.parametrize(
    "text",
    [
        b'{"custom_id": "\xed\xa0\xbd", "method": "POST"}',  # a surrogate's UTF-8 bytes
        b'{"custom_id": "a", "prompt": "\\uDC0A"}',  # an escape in capitals
        '{"custom_id": "\ud83d"}'.encode("utf-16-le", "surrogatepass"),  # another encoding
    ],
    ids=["utf-8-bytes", "capital-escape", "utf-16"],
)
def test_a_lone_surrogate_not_written_as_a_small_escape_is_refused_too(text):
    """Lines with no surrogate escape are not walked (a line of thousands of token ids took
    milliseconds to walk): every other way to a lone surrogate is still walked."""
    _, _, problems = check_line(text, "/v1/completions", ["m"])
    assert [p["code"] for p in problems] == ["invalid_json"]


def test_error_messages_quote_a_bounded_part_of_the_line(store):
    """Each quoted the line's value whole: 1,000 lines with 17 KB urls made a 17 MB batch
    object, which no gateway could receive (GET /v1/batches/{id} failed) and over 16 MB the
    service could not even encode (its receive task died)."""
    from services.batch.validation import QUOTE_CHARS

    big = "u" * 17_000
    _, _, problems = check_line(good(url=big, model=big), "/v1/completions", ["m"])
    assert [p["code"] for p in problems] == ["mismatched_url", "model_not_found"]
    for problem in problems:
        assert len(problem["message"]) < QUOTE_CHARS + 100 and "uuu…" in problem["message"]
    nested = b'{"custom_id": "a", "method": "POST", "url": ' + b"[" * 900 + b"]" * 900 + b"}"
    assert "got an array" in check_line(nested, "/v1/completions", ["m"])[2][0]["message"]
    batch = new_batch(store, [good(str(n), url=big, model=big) for n in range(1_000)])
    store.update_batch(
        "batch_x", errors={"object": "list", "data": validate(store, batch, ["m"])[1]}
    )
    reply = wire_batch.BatchReply(
        call_id="1", status=200, body=json.dumps(store.get_batch("batch_x"))
    )
    assert sum(map(len, wire_batch.encode(reply))) < wire_batch.MAX_FRAME_BYTES


def test_a_page_of_batches_stops_before_it_outgrows_one_frame(store):
    """A batch object carries up to 1,000 errors: a page of such batches was too big for a
    frame, so listing a tenant's batches failed for good. The page ends early (`has_more`)."""
    errors = {"object": "list", "data": [{"message": "x" * 1_000}] * 500}  # ~0.5 MB each
    for n in range(10):
        store.add_batch({"id": f"batch_{n}", "status": "failed", "created_at": n, "errors":
                         errors}, "alice")  # fmt: skip
    api = BatchApi(store, jobs=None, limits=Limits())
    pages, params = [], {"limit": 100}
    while not pages or pages[-1]["has_more"]:
        pages.append(api.handle("batch_list", "alice", params, None)[1])
        params["after"] = pages[-1]["last_id"]
    assert len(pages) == 2
    for page in pages:
        reply = wire_batch.BatchReply(call_id="1", status=200, body=json.dumps(page))
        assert sum(map(len, wire_batch.encode(reply))) < wire_batch.MAX_FRAME_BYTES
    listed = [batch["id"] for page in pages for batch in page["data"]]
    assert listed == [f"batch_{n}" for n in range(9, -1, -1)]


class Jobs:
    """A job manager that only records the batches started."""

    def __init__(self) -> None:
        self.started: list[str] = []

    def start(self, batch_id: str) -> None:
        self.started.append(batch_id)


def counting_reads(monkeypatch) -> list[int]:
    """[lines read from any input file so far]: validation's `open`, counted line by line."""
    from services.batch import validation

    num_read = [0]

    class Counted:
        def __init__(self, file):
            self.file = file

        def __enter__(self):
            return self

        def __exit__(self, *_):
            self.file.close()

        def __iter__(self):
            for raw in self.file:
                num_read[0] += 1
                yield raw

    monkeypatch.setattr(validation, "open", lambda *a: Counted(open(*a)), raising=False)  # noqa: SIM115
    return num_read


def create(api: BatchApi, lines: bytes, file_id: str = "file-in") -> tuple[int, dict]:
    store = api.store
    store.path_of(file_id).write_bytes(lines)
    store.add_file(file_id, "alice", "batch", "in.jsonl", len(lines))
    params = {"input_file_id": file_id, "endpoint": "/v1/completions",
              "completion_window": "24h", "models": ["m"]}  # fmt: skip
    status, body, _ = api.handle("batch_create", "alice", params, None)
    return status, body


def test_a_create_counts_the_file_only_up_to_its_line_limit(store, monkeypatch):
    """Every line was counted before the limit was compared: with blank lines (skipped, never
    counted) a 200 MB file took ~30 s on the service's loop, the gateway's wait: it answered
    503, the client retried, and the service created the batch anyway (two batches)."""
    num_read = counting_reads(monkeypatch)
    api = BatchApi(store, jobs=Jobs(), limits=Limits(max_lines=10))
    status, body = create(api, b"".join(good(str(n)) + b"\n" for n in range(10_000)))
    assert status == 400 and "more than 10 requests" in body["error"]["message"]
    assert num_read[0] == 11  # the limit and one more, not the tail
    num_read[0] = 0
    status, body = create(api, b"".join(good(str(n)) + b"\n" for n in range(10)), "file-ok")
    assert status == 200 and api.jobs.started == [body["id"]]


def test_a_file_of_blank_lines_is_refused_after_a_bounded_read(store, monkeypatch):
    from services.batch.validation import MAX_BLANK_LINES

    num_read = counting_reads(monkeypatch)
    api = BatchApi(store, jobs=Jobs(), limits=Limits())
    lines = b"\n" * (MAX_BLANK_LINES + 1) + b"  \r\n" * 100_000 + good() + b"\n"
    status, body = create(api, lines)
    assert status == 400 and f"more than {MAX_BLANK_LINES} blank" in body["error"]["message"]
    assert num_read[0] == MAX_BLANK_LINES + 1 and api.jobs.started == []
    # Validation refuses it too (a batch created before the limit), naming why.
    batch = new_batch(store, [b""] * (MAX_BLANK_LINES + 1) + [good("a")])
    num_lines, errors = validate(store, batch, ["m"])
    assert [e["code"] for e in errors] == ["too_many_blank_lines"]
    assert store.num_pending("batch_x") == 0
    assert validate(store, new_batch(store, [b""] * 3 + [good("a")], "batch_y"), ["m"]) == (1, [])


def test_what_a_kill_left_behind_is_removed_when_the_service_starts(tmp_path, monkeypatch):
    """A kill between an upload's move into files/ and its row kept its bytes for good, and one
    between a batch's end and the drop of its lines kept up to 50,000 rows for good (an ended
    batch is never resumed). An unfinished batch's input and answer files stay."""
    store = Store(tmp_path)
    api = BatchApi(store, jobs=None, limits=Limits())
    _, begun, _ = api.handle("file_upload_begin", "alice", {"purpose": "batch"}, None)
    api.handle("file_upload_chunk", "alice", begun, good() + b"\n")

    def killed(*_):
        raise KeyboardInterrupt  # (the kill, between the move and the row)

    monkeypatch.setattr(store, "add_file", killed)
    with pytest.raises(KeyboardInterrupt):
        api.handle("file_upload_end", "alice", begun, None)
    monkeypatch.undo()
    moved = [path.name for path in store.files_dir.iterdir()]
    assert len(moved) == 1  # (bytes no row names)
    store.path_of("file-live").write_bytes(b"kept")
    store.add_file("file-live", "alice", "batch", "in.jsonl", 4)
    store.path_of("file-gone").write_bytes(b"deleted")  # (a kill before its unlink)
    store.add_file("file-gone", "alice", "batch", "in.jsonl", 7)
    store.db.execute("UPDATE files SET deleted = 1 WHERE id = 'file-gone'")
    new_batch(store, [good("a"), good("b")], "batch_run")  # in_progress, input file-in (no row)
    validate(store, store.get_batch("batch_run"), ["m"])
    store.path_of(output_file_id("batch_run")).write_bytes(b"answers so far\n")
    new_batch(store, [good("a"), good("b")], "batch_done")
    validate(store, store.get_batch("batch_done"), ["m"])
    store.update_batch("batch_done", status="completed")  # (then the kill, before drop_lines)
    store.close()

    store = Store(tmp_path)  # the restart
    BatchApi(store, jobs=None, limits=Limits())
    left = sorted(path.name for path in store.files_dir.iterdir())
    assert left == sorted(["file-in", "file-live", output_file_id("batch_run")])
    assert store.num_pending("batch_done") == 0 and store.num_pending("batch_run") == 2
    store.close()


def test_files_are_listed_as_openai_pages_them(store):
    """OpenAI's file list takes `limit` up to 10,000 (its default) and `order` asc or desc by
    creation: `client.files.list(limit=1000)` was a 400 (the batches' bound, 100), and
    `order="asc"` was ignored (newest first, whatever was asked)."""
    for n in range(5):
        store.add_file(f"file-{n}", "alice", "batch", "in.jsonl", 1)
    api = BatchApi(store, jobs=None, limits=Limits())

    def listed(**params) -> list[str]:
        return [f["id"] for f in api.handle("file_list", "alice", params, None)[1]["data"]]

    assert listed() == [f"file-{n}" for n in range(4, -1, -1)]
    assert listed(limit=10_000, order="desc") == listed()
    assert listed(order="asc") == [f"file-{n}" for n in range(5)]
    assert listed(order="asc", after="file-1", limit=2) == ["file-2", "file-3"]
    assert listed(order="desc", after="file-3", limit=2) == ["file-2", "file-1"]
    assert api.handle("file_list", "alice", {"limit": 10_001}, None)[0] == 400
    status, body, _ = api.handle("file_list", "alice", {"order": "newest"}, None)
    assert status == 400 and body["error"]["param"] == "order"
    assert api.handle("batch_list", "alice", {"limit": 101}, None)[0] == 400  # (OpenAI's 100)


def test_a_page_of_a_tenants_batches_or_files_is_read_in_order_not_sorted(store, tmp_path):
    """A list page sorted all of the tenant's rows before taking its first (no index held
    them in rowid order): 0.55 s for `limit=1` over 10,000 batches, on the service's loop.
    Each page's query walks an index instead (SQLite's plan uses no temporary B-tree); a
    database made before the index gains it when opened."""
    for n in range(3):
        store.add_file(f"file-{n}", "alice", "batch", "in.jsonl", 1)
    plans: list[str] = []
    listing = Store(tmp_path)  # (a second open: the indexes made again, if absent, no harm)
    listing.db.set_trace_callback(lambda sql: plans.append(sql) if "LIMIT" in sql else None)
    listing.list_batches("alice", 20, None)
    listing.list_batches("alice", 20, "batch_x")
    listing.list_files("alice", None, 20, "file-1", newest_first=False)
    listing.list_files("alice", "batch", 20, None)
    listing.db.set_trace_callback(None)
    assert len(plans) == 4
    for sql in plans:
        plan = " ".join(row[3] for row in listing.db.execute(f"EXPLAIN QUERY PLAN {sql}"))
        assert "TEMP B-TREE" not in plan and "USING INDEX" in plan, (sql, plan)
    listing.close()


def test_the_batch_lists_bench_times_each_page_and_a_deletion(tmp_path, capsys):
    from loadtest import batch_lists

    batch_lists.main(["--batches", "30", "--failed", "3", "--repeats", "2", "--dir", str(tmp_path)])
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" ")[0] for line in lines] == ["batch_list"] * 4 + ["file_delete:"]
    assert all(line.endswith(" ms") for line in lines)


def test_a_create_without_a_file_id_or_with_long_metadata_keys_is_a_400_naming_it(store):
    """A missing `input_file_id` was a 404 "No such File object: None"; metadata keys were
    unbounded (OpenAI's are at most 64 characters, as its values 512)."""
    api = BatchApi(store, jobs=Jobs(), limits=Limits())
    params = {"endpoint": "/v1/completions", "completion_window": "24h", "models": ["m"]}
    for wrong in ({}, {"input_file_id": None}, {"input_file_id": 7}):
        status, body, _ = api.handle("batch_create", "alice", {**params, **wrong}, None)
        assert (status, body["error"]["param"]) == (400, "input_file_id")
    assert "required" in body["error"]["message"]
    store.path_of("file-in").write_bytes(good() + b"\n")
    store.add_file("file-in", "alice", "batch", "in.jsonl", len(good()) + 1)
    params["input_file_id"] = "file-in"
    too_many = {f"k{i}": "v" for i in range(17)}
    for metadata in ({"k" * 65: "v"}, {"k": 1}, {"k": "v" * 513}, too_many):
        create = {**params, "metadata": metadata}
        status, body, _ = api.handle("batch_create", "alice", create, None)
        assert (status, body["error"]["param"]) == (400, "metadata")
        assert body["error"]["message"] == metadata_problem(metadata)  # the gateway's words too
    status, body, _ = api.handle(
        "batch_create", "alice", {**params, "metadata": {"k" * 64: "v"}}, None
    )
    assert status == 200 and body["metadata"] == {"k" * 64: "v"}
    assert (
        api.handle("batch_create", "alice", {**params, "input_file_id": "file-no"}, None)[0] == 404
    )


def test_the_jobs_gauge_falls_to_zero_when_no_job_is_in_a_status_any_more(store):
    """Only the statuses some job was in were set: once the last running job completed,
    `batch_jobs{status="in_progress"}` kept saying 1 for good."""
    from services.batch.service import BatchMetrics

    class Jobs:
        def num_in_flight(self) -> int:
            return 0

    metrics = BatchMetrics()
    new_batch(store, [good("a")])  # in_progress

    def jobs_in(status: str) -> float:
        return metrics.registry.get_sample_value("tandem:batch_jobs", {"status": status})

    metrics.update(store, Jobs())
    assert (jobs_in("in_progress"), jobs_in("completed")) == (1, 0)
    store.update_batch("batch_x", status="completed")
    metrics.update(store, Jobs())
    assert (jobs_in("in_progress"), jobs_in("completed")) == (0, 1)


@pytest.mark.parametrize(
    "wrong, param",
    [
        ({"input_file_id": "file-\ud800"}, "input_file_id"),
        ({"metadata": {"k": "\udc00 v"}}, "metadata"),
        ({"metadata": {"\ud83d": "v"}}, "metadata"),
    ],
)
def test_a_create_with_a_string_that_is_not_unicode_is_a_400_naming_it(store, wrong, param):
    """A lone surrogate escape (`"\\ud800"`, valid JSON, no character) in a create's body: as
    the input file's id SQLite could not bind it (the service's 500); in metadata it was stored,
    and every answer that carried the batch (its create, its GET, the tenant's whole list) was
    the gateway's 500, its JSON not encodable as UTF-8."""
    api = BatchApi(store, jobs=Jobs(), limits=Limits())
    store.path_of("file-in").write_bytes(good() + b"\n")
    store.add_file("file-in", "alice", "batch", "in.jsonl", len(good()) + 1)
    params = {"input_file_id": "file-in", "endpoint": "/v1/completions",
              "completion_window": "24h", "models": ["m"], **wrong}  # fmt: skip
    status, body, _ = asyncio.run(api.answer("batch_create", "alice", params, None))
    assert (status, body["error"]["param"]) == (400, param), body
    assert "not Unicode" in body["error"]["message"]
    assert store.list_batches("alice", 10, None) == []


def test_a_create_with_a_parameter_name_that_is_not_unicode_is_a_400_that_can_be_sent(store):
    api = BatchApi(store, jobs=Jobs(), limits=Limits())
    params = {"endpoint": "/v1/completions", "completion_window": "24h", "\udfff": 1}
    status, body, _ = asyncio.run(api.answer("batch_create", "alice", params, None))
    assert status == 400
    json.dumps(body, ensure_ascii=False).encode()  # (as the gateway renders it)


def test_a_line_too_long_to_send_is_parsed_in_a_process_of_its_own(store, monkeypatch):
    """Parsing a line longer than one RPC call carries (answered 413 unread when the job runs)
    held the service's loop from the validation's thread (json keeps the GIL): about 1 s per
    100 MB of text, 3 s for 140 MB of token ids, in which no call was answered. Such a line is
    checked in a child process, as thoroughly as any other."""
    from services.batch import validation

    monkeypatch.setattr(validation, "LONG_LINE_BYTES", 300, raising=False)
    parsed_here = []
    check_here = validation.check_line
    monkeypatch.setattr(
        validation,
        "check_line",
        lambda text, *a: parsed_here.append(len(text)) or check_here(text, *a),
    )
    long_prompt = "p" * 400
    lines = [good("a"), good("b", prompt=long_prompt), good("c", prompt=long_prompt, model="x"),
             b"{" + b" " * 400, good("a", prompt=long_prompt)]  # fmt: skip
    num_lines, errors = validate(store, new_batch(store, lines), ["m"])
    assert num_lines == 5 and all(size <= 300 for size in parsed_here) and parsed_here
    assert [(e["line"], e["code"]) for e in errors] == [
        (3, "model_not_found"), (4, "invalid_json"), (5, "duplicate_custom_id")
    ]  # fmt: skip
    num_lines, errors = validate(store, new_batch(store, lines[:2], "batch_y"), ["m"])
    rows = {row["custom_id"]: row for row in store.pending_lines("batch_y")}
    assert (num_lines, errors) == (2, []) and rows["b"]["prefix_key"] == long_prompt
