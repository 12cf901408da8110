"""`tandem batch-service` as its own process: it refuses wrong settings at start-up, drops wrong
frames with a log line and goes on answering, and keeps its files across a restart."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from typing import Any

import pytest
import zmq

from services.batch.service import BatchServiceConfig
from shared import wire_batch
from shared.config import ConfigError, config_from_args


def start(tmp_path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "batch-service",
         "--address", f"ipc://{tmp_path}/batch.sock", "--data-dir", str(tmp_path / "data"),
         "--gateway-rpc-address", f"ipc://{tmp_path}/nobody.sock", *extra],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


def call(socket: zmq.Socket, op: str, params: dict, data: bytes | None = None) -> tuple:
    message = wire_batch.BatchCall(call_id=op, op=op, tenant="t", params=json.dumps(params))
    socket.send_multipart(wire_batch.encode(message, data))
    assert socket.poll(60_000), "no answer from the batch service"
    reply, chunk = wire_batch.decode(socket.recv_multipart())
    return reply.status, json.loads(reply.body), chunk


@pytest.mark.parametrize(
    "name, value, message",
    [
        ("MAX_IN_FLIGHT", "0", "max_in_flight"),
        ("MAX_IN_FLIGHT", "1000", "at most 256"),
        ("ADDRESS", "localhost:5", "tcp://"),
        ("MAX_FILE_BYTES", "lots", "integer"),
        ("METRICS_PORT", "70000", "port"),
        ("LINE_TIMEOUT_S", "-1", "line_timeout_s"),
    ],
)
def test_wrong_settings_are_refused_naming_the_setting(name, value, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(BatchServiceConfig, environ={f"TANDEM_{name}": value})


def test_a_wrong_setting_stops_the_command_with_status_2(tmp_path):
    process = start(tmp_path, "--max-in-flight", "0")
    output, _ = process.communicate(timeout=120)
    assert process.returncode == 2 and "max_in_flight" in output.decode()


def dealer(tmp_path) -> zmq.Socket:
    """A plain connection to the service started in `tmp_path` (as the gateway's link)."""
    socket = zmq.Context.instance().socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"ipc://{tmp_path}/batch.sock")
    return socket


def wait_listening(process: subprocess.Popen) -> None:
    for line in process.stdout:  # start-up may take a while on a busy machine
        if b"batch service listening" in line:
            return
    raise RuntimeError("the batch service exited before listening")


def test_wrong_frames_are_dropped_and_logged_and_files_survive_a_restart(tmp_path):
    process = start(tmp_path)
    wait_listening(process)
    socket = dealer(tmp_path)
    try:
        socket.send_multipart([b"\xff"])
        socket.send_multipart([b"\x40", b"not msgpack"])
        socket.send_multipart([b"\x41", b"\x80"])  # a reply sent to the service
        good = wire_batch.BatchCall(call_id="x", op="file_list", tenant="t", params="[1]")
        socket.send_multipart(wire_batch.encode(good))  # params not an object
        # Nested past the parser's recursion limit, or an int of 5,000 digits: the error
        # (RecursionError, a ValueError not JSON's) ended the receive task, and the service
        # answered no call after it.
        for params in ("[" * 100_000, '{"limit": ' + "1" * 5_000 + "}"):
            wrong = wire_batch.BatchCall(call_id="y", op="file_list", tenant="t", params=params)
            socket.send_multipart(wire_batch.encode(wrong))
        _, begun, _ = call(socket, "file_upload_begin", {"purpose": "batch", "filename": "a"})
        call(socket, "file_upload_chunk", begun, b'{"custom_id": "a"}\n')
        status, created, _ = call(socket, "file_upload_end", begun)
        assert status == 200 and created["bytes"] == 19
        process.terminate()
        output, _ = process.communicate(timeout=30)
        assert output.decode().count("dropped malformed message") == 6
        process = start(tmp_path)
        wait_listening(process)
        status, content = call(socket, "file_content", {"file_id": created["id"]})[::2]
        assert status == 200 and content == b'{"custom_id": "a"}\n'
    finally:
        socket.close()
        process.kill()
        process.wait()


def test_under_curvezmq_only_a_holder_of_the_clusters_key_gets_an_answer(tmp_path):
    from shared.curve import CurveKeys, generate

    generate(tmp_path / "keys")
    generate(tmp_path / "other")
    process = start(tmp_path, "--curve-keys-dir", str(tmp_path / "keys"))
    try:
        wait_listening(process)
        cluster = CurveKeys.from_dir(tmp_path / "keys")
        stranger = CurveKeys.from_dir(tmp_path / "other")
        context = zmq.Context.instance()
        for keys, answered in ((cluster, True), (stranger, False)):
            socket = context.socket(zmq.DEALER)
            socket.setsockopt(zmq.LINGER, 0)
            socket.curve_secretkey, socket.curve_publickey = keys.secret, keys.public
            socket.curve_serverkey = cluster.public
            socket.connect(f"ipc://{tmp_path}/batch.sock")
            message = wire_batch.BatchCall(call_id="1", op="file_list", tenant="t", params="{}")
            socket.send_multipart(wire_batch.encode(message))
            assert bool(socket.poll(10_000 if answered else 2_000)) is answered
            socket.close()
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
    assert "unknown CurveZMQ key" in output.decode()  # the stranger, refused and logged


def upload(socket: zmq.Socket, content: bytes) -> str:
    _, begun, _ = call(socket, "file_upload_begin", {"purpose": "batch", "filename": "in.jsonl"})
    call(socket, "file_upload_chunk", begun, content)
    status, created, _ = call(socket, "file_upload_end", begun)
    assert status == 200
    return created["id"]


def validated(socket: zmq.Socket, content: bytes) -> dict:
    """The batch of a file with `content`, once its validation has ended."""
    params = {"input_file_id": upload(socket, content), "endpoint": "/v1/completions",
              "completion_window": "24h", "models": ["m"]}  # fmt: skip
    status, batch, _ = call(socket, "batch_create", params)
    assert status == 200, batch
    for _ in range(600):
        if batch["status"] != "validating":
            return batch
        time.sleep(0.1)
        batch = call(socket, "batch_get", {"batch_id": batch["id"]})[1]
    raise AssertionError(f"{batch['id']} still validating")


def test_a_line_with_a_lone_surrogate_fails_its_batch_and_the_service_goes_on(tmp_path):
    """SQLite could not encode the line's string inside validation's open transaction, which
    stayed open: the batch failed with no line named, the next batch's validation could not
    begin ("cannot start a transaction within a transaction"), and a restart lost every write
    since (and validated the first batch again, which broke the service again)."""
    line = {"method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "hi"}}
    good = json.dumps({"custom_id": "a", **line}).encode()
    bad = good.replace(b'"hi"', b'"hi \\ud83d"').replace(b'"a"', b'"b"')
    process = start(tmp_path)
    wait_listening(process)
    socket = dealer(tmp_path)
    try:
        failed = validated(socket, good + b"\n" + bad + b"\n")
        assert failed["status"] == "failed"
        assert [(e["line"], e["code"]) for e in failed["errors"]["data"]] == [(2, "invalid_json")]
        running = validated(socket, good + b"\n")
        assert running["status"] == "in_progress"  # (no cluster here: its line waits)
        process.terminate()
        process.communicate(timeout=30)
        process = start(tmp_path)
        wait_listening(process)
        for batch in (failed, running):
            status, now, _ = call(socket, "batch_get", {"batch_id": batch["id"]})
            assert status == 200 and now["status"] == batch["status"]
            assert call(socket, "file_get", {"file_id": batch["input_file_id"]})[0] == 200
    finally:
        socket.close()
        process.kill()
        process.wait()


@pytest.mark.parametrize(
    "num_bytes", [wire_batch.MAX_FRAME_BYTES, 17 << 20], ids=["past-a-frame", "past-a-header"]
)
def test_an_answer_too_big_to_send_is_a_500_and_the_service_goes_on(tmp_path, num_bytes):
    """An answer over 16 MB raised in the receive task, which ended: the service answered no one
    after. One smaller but past the gateway's frame limit never arrived (the gateway's link
    dropped the connection), and the call was a 503 after the link's timeout."""
    from services.batch.service import BatchService
    from services.gateway.batch_link import BatchLink
    from services.gateway.openai_protocol import ApiError

    config = BatchServiceConfig(
        address=f"ipc://{tmp_path}/batch.sock",
        gateway_rpc_address=f"ipc://{tmp_path}/nobody.sock",
        data_dir=str(tmp_path / "data"),
    )

    async def scenario() -> tuple[ApiError, dict]:
        service = BatchService(config)
        handle = service.api.handle

        def handle_with_a_huge_list(op: str, tenant: str, params: dict, data: bytes | None):
            if op == "batch_list":
                return 200, {"object": "list", "data": "x" * num_bytes}, None
            return handle(op, tenant, params, data)

        service.api.handle = handle_with_a_huge_list
        serving = asyncio.create_task(service.serve())
        link = BatchLink(config.address, timeout_s=10)
        await link.start()
        try:
            with pytest.raises(ApiError) as too_big:
                await link.call("batch_list", "t", {})
            _, files, _ = await link.call("file_list", "t", {})
        finally:
            await link.close()
            service._stopping.set()
            await serving
        return too_big.value, files

    too_big, files = asyncio.run(scenario())
    assert too_big.status == 500 and "batch_list could not be sent" in too_big.message
    assert files["data"] == []


def test_an_abandoned_upload_is_dropped_on_the_services_timer(tmp_path):
    """Idle uploads were dropped only when another upload began: an abandoned one kept its
    bytes on disk until some tenant uploaded again, or the service restarted."""
    from services.batch.service import BatchService

    config = BatchServiceConfig(
        address=f"ipc://{tmp_path}/batch.sock",
        gateway_rpc_address=f"ipc://{tmp_path}/nobody.sock",
        data_dir=str(tmp_path / "data"),
    )

    async def scenario() -> tuple[bool, bool]:
        service = BatchService(config)
        api = service.api
        _, begun, _ = api.handle("file_upload_begin", "t", {"purpose": "batch"}, None)
        api.handle("file_upload_chunk", "t", begun, b"half a file")
        upload = api._uploads[begun["upload_id"]]
        upload.touched_at -= api.limits.upload_idle_s + 1  # its client gone, nothing since
        serving = asyncio.create_task(service.serve())
        try:
            for _ in range(100):  # (the timer's first turn comes as the service starts)
                await asyncio.sleep(0.1)
                if not upload.path.exists():
                    break
        finally:
            service._stopping.set()
            await serving
        return upload.path.exists(), begun["upload_id"] in api._uploads

    assert asyncio.run(scenario()) == (False, False)


def write_big_input(store, num_lines: int) -> str:
    """A valid input file of `num_lines` completions of 500 token ids each, every line with
    an escaped emoji (a surrogate pair: each line's strings are walked); its file id."""
    body = {"model": "m", "prompt": list(range(500)), "suffix": "\U0001f600"}
    line = {"custom_id": "CUSTOM_ID", "method": "POST", "url": "/v1/completions", "body": body}
    template = json.dumps(line).encode()
    path = store.path_of("file-big")
    with open(path, "wb") as file:
        for n in range(num_lines):
            file.write(template.replace(b"CUSTOM_ID", b"r%d" % n) + b"\n")
    store.add_file("file-big", "t", "batch", "big.jsonl", path.stat().st_size)
    return "file-big"


async def serving_with_a_big_input(tmp_path, num_lines: int, run) -> Any:
    """Runs `run(link, file_id)` against a service in this process, its big input written."""
    from services.batch.service import BatchService
    from services.gateway.batch_link import BatchLink

    config = BatchServiceConfig(
        address=f"ipc://{tmp_path}/batch.sock",
        gateway_rpc_address=f"ipc://{tmp_path}/nobody.sock",
        data_dir=str(tmp_path / "data"),
    )
    service = BatchService(config)
    file_id = write_big_input(service.store, num_lines)
    serving = asyncio.create_task(service.serve())
    link = BatchLink(config.address, timeout_s=60)
    await link.start()
    try:
        return await run(link, file_id)
    finally:
        await link.close()
        service._stopping.set()
        await serving


def create_params(file_id: str) -> dict:
    return {"input_file_id": file_id, "endpoint": "/v1/completions",
            "completion_window": "24h", "models": ["m"]}  # fmt: skip


def test_the_service_answers_calls_while_a_big_file_validates(tmp_path):
    """Validation ran on the service's one loop: a 184 MB file took seconds (a file of long
    token-id arrays far longer), during which no call was answered (uploads, status, other
    tenants' creates) and the gateway's relays timed out as 503s."""

    async def probe_while_validating(link, file_id) -> tuple[dict, list[float]]:
        _, batch, _ = await link.call("batch_create", "t", create_params(file_id))
        waits = []
        while batch["status"] == "validating":
            started = time.monotonic()
            _, batch, _ = await link.call("batch_get", "t", {"batch_id": batch["id"]})
            await link.call("file_list", "t", {"limit": 1})
            waits.append(time.monotonic() - started)
            await asyncio.sleep(0.05)
        return batch, waits

    batch, waits = asyncio.run(serving_with_a_big_input(tmp_path, 20_000, probe_while_validating))
    assert batch["status"] == "in_progress" and batch["request_counts"]["total"] == 20_000
    assert len(waits) > 2 and max(waits) < 0.5, waits


def test_a_cancel_stops_a_big_files_validation_at_once(tmp_path):
    """A batch cancelled while `validating` ends `cancelled` (OpenAI's); the cancel waited for
    the whole file to be validated first (it was not even received until then)."""

    async def cancel_while_validating(link, file_id) -> tuple[dict, float]:
        _, batch, _ = await link.call("batch_create", "t", create_params(file_id))
        await asyncio.sleep(0.2)
        started = time.monotonic()
        _, batch, _ = await link.call("batch_cancel", "t", {"batch_id": batch["id"]})
        while batch["status"] == "cancelling":
            await asyncio.sleep(0.05)
            _, batch, _ = await link.call("batch_get", "t", {"batch_id": batch["id"]})
        return batch, time.monotonic() - started

    batch, waited = asyncio.run(serving_with_a_big_input(tmp_path, 20_000, cancel_while_validating))
    assert batch["status"] == "cancelled" and batch["request_counts"]["total"] == 0
    assert waited < 1.0


def test_the_service_answers_calls_while_a_create_counts_its_file(tmp_path, monkeypatch):
    """A create counted its file's requests on the service's loop: a 200 MB file of one line is
    read whole (most of a second, on a loaded machine more), and no call was answered
    meanwhile. The count is slowed down here, as a slow disk would."""
    from services.batch import api

    count = api.num_requests

    def slow_count(path, at_most: int) -> int:
        time.sleep(1.5)
        return count(path, at_most)

    monkeypatch.setattr(api, "num_requests", slow_count)

    async def list_while_creating(link, file_id) -> tuple[dict, float]:
        creating = asyncio.create_task(link.call("batch_create", "t", create_params(file_id)))
        await asyncio.sleep(0.3)  # (the create is counting)
        started = time.monotonic()
        status, files, _ = await link.call("file_list", "t", {})
        waited = time.monotonic() - started
        assert status == 200 and not creating.done()
        _, batch, _ = await creating
        return batch, waited

    batch, waited = asyncio.run(serving_with_a_big_input(tmp_path, 10, list_while_creating))
    assert batch["status"] == "validating" and waited < 0.5


def test_the_service_answers_calls_while_an_upload_syncs_its_bytes(tmp_path, monkeypatch):
    """An upload's end syncs its bytes to the disk in a worker thread (a 200 MB upload: 0.4 s
    and more), and the calls after it waited for it, in order. The sync is slowed down here, as
    a slow disk would."""
    from services.batch import api

    sync = api.fsync_path

    def slow_sync(path, flags: int = 0) -> None:
        time.sleep(1.5)
        sync(path, flags)

    monkeypatch.setattr(api, "fsync_path", slow_sync)

    async def list_while_ending_an_upload(link, _) -> tuple[dict, float]:
        begin = {"purpose": "batch", "filename": "in.jsonl"}
        _, upload, _ = await link.call("file_upload_begin", "t", begin)
        await link.call("file_upload_chunk", "t", upload, b'{"custom_id": "a"}\n')
        ending = asyncio.create_task(link.call("file_upload_end", "t", upload))
        await asyncio.sleep(0.3)  # (the end is syncing)
        started = time.monotonic()
        status, _, _ = await link.call("file_list", "t", {})
        waited = time.monotonic() - started
        assert status == 200 and not ending.done()
        status, file, _ = await ending
        assert status == 200, file
        return file, waited

    file, waited = asyncio.run(serving_with_a_big_input(tmp_path, 10, list_while_ending_an_upload))
    assert file["bytes"] == len(b'{"custom_id": "a"}\n') and waited < 0.5


def test_a_kill_mid_validation_leaves_the_batch_validating_and_a_restart_validates_it(tmp_path):
    """Validation runs in a worker thread, its lines committed page by page on a connection of
    its own: a kill -9 midway still leaves the batch `validating`, and the restart validates it
    again from the start (no line recorded twice, none lost)."""
    from services.batch.store import Store

    store = Store(tmp_path / "data")
    file_id = write_big_input(store, 20_000)
    store.close()
    process = start(tmp_path)
    wait_listening(process)
    socket = dealer(tmp_path)
    try:
        status, batch, _ = call(socket, "batch_create", create_params(file_id))
        assert status == 200 and batch["status"] == "validating"
        time.sleep(0.5)
        process.kill()
        process.wait()
        process = start(tmp_path)
        wait_listening(process)
        deadline = time.monotonic() + 120
        while batch["status"] == "validating" and time.monotonic() < deadline:
            time.sleep(0.2)
            _, batch, _ = call(socket, "batch_get", {"batch_id": batch["id"]})
        assert batch["status"] == "in_progress"
        assert batch["request_counts"]["total"] == 20_000
    finally:
        socket.close()
        process.kill()
        process.wait()


@pytest.mark.parametrize("wrong", ["a folder", "not a database"])
def test_a_database_that_cannot_be_opened_stops_the_start_with_its_reason(tmp_path, wrong):
    """A `--data-dir` whose database SQLite cannot open (a folder in its place, a file that is
    no database, one it may not write) ended the command in a traceback: it says why, as a
    start-up error (`tandem` prints it and exits 1)."""
    from services.batch.service import BatchService
    from shared.errors import StartUpError

    (tmp_path / "data").mkdir()
    database = tmp_path / "data" / "batch.sqlite3"
    if wrong == "a folder":
        database.mkdir()
    else:
        database.write_bytes(b"no SQLite here " * 100)
    config = BatchServiceConfig(
        address=f"ipc://{tmp_path}/batch.sock",
        gateway_rpc_address=f"ipc://{tmp_path}/nobody.sock",
        data_dir=str(tmp_path / "data"),
    )
    with pytest.raises(StartUpError, match="batch.sqlite3"):
        BatchService(config)
