"""`tandem batch-service` as its own process: it refuses wrong settings at start-up, drops wrong
frames with a log line and goes on answering, and keeps its files across a restart."""

from __future__ import annotations

import json
import subprocess
import sys

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


def wait_listening(process: subprocess.Popen) -> None:
    for line in process.stdout:  # start-up may take a while on a busy machine
        if b"batch service listening" in line:
            return
    raise RuntimeError("the batch service exited before listening")


def test_wrong_frames_are_dropped_and_logged_and_files_survive_a_restart(tmp_path):
    process = start(tmp_path)
    wait_listening(process)
    context = zmq.Context.instance()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(f"ipc://{tmp_path}/batch.sock")
    try:
        socket.send_multipart([b"\xff"])
        socket.send_multipart([b"\x40", b"not msgpack"])
        socket.send_multipart([b"\x41", b"\x80"])  # a reply sent to the service
        good = wire_batch.BatchCall(call_id="x", op="file_list", tenant="t", params="[1]")
        socket.send_multipart(wire_batch.encode(good))  # params not an object
        _, begun, _ = call(socket, "file_upload_begin", {"purpose": "batch", "filename": "a"})
        call(socket, "file_upload_chunk", begun, b'{"custom_id": "a"}\n')
        status, created, _ = call(socket, "file_upload_end", begun)
        assert status == 200 and created["bytes"] == 19
        process.terminate()
        output, _ = process.communicate(timeout=30)
        assert output.decode().count("dropped malformed message") == 4
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
