"""Garbage on every ZeroMQ socket of a running cluster is logged and dropped; service goes on."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import zmq

from shared import wire

pytestmark = pytest.mark.slow

GARBAGE = [
    [b""],
    [b"\xff"],  # unknown message type
    [bytes([wire.MessageType.SUBMIT]), b"\x93\x01\x02"],  # header is a list, not a map
    [bytes([wire.MessageType.HEARTBEAT]), b"\xc1"],  # invalid msgpack
    [bytes([wire.MessageType.SUBMIT]), b"\x81\xa3foo\x01"],  # unknown field
    [bytes([wire.MessageType.KV_TRANSFER]), b"\x80", b"tensor bytes"],  # missing fields
]


def socket_addresses(log: str) -> dict[str, str]:
    found = {}
    for name in ("scheduler", "gateway-stream", "decode-0", "decode-1"):
        match = re.search(rf"ipc://[^\s\"']*/{name}\.sock", log)
        if match:
            found[name] = match.group(0)
    return found


def send_to_every_socket(addresses: dict[str, str], messages: list[list[bytes]]) -> None:
    """Each message to each socket, as the kind of peer that socket expects (PUSH or DEALER)."""
    context = zmq.Context()
    try:
        for name, address in addresses.items():
            sock = context.socket(zmq.PUSH if name == "gateway-stream" else zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)
            sock.connect(address)
            for frames in messages:
                sock.send_multipart(frames)
            sock.close()
    finally:
        context.term()


def say_hello(address: str, **shape) -> wire.Message | None:
    """A decode worker's HELLO with this KV shape; the scheduler's answer (None: 5 s of silence)."""
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    figures = {"num_kv_blocks": 64, "block_size": 16, "max_num_seqs": 4, **shape}
    hello = wire.Hello(schema_version=wire.SCHEMA_VERSION, role="decode", peer_id="odd-worker",
                       model="smollm2", address="ipc:///nowhere", **figures)  # fmt: skip
    try:
        wire.send(sock, hello)
        return wire.recv(sock) if sock.poll(5000) else None
    finally:
        sock.close()
        context.term()


def test_a_worker_whose_kv_cache_cannot_be_counted_in_is_refused(cluster, openai_client):
    address = socket_addresses(cluster.log())["scheduler"]
    decode_workers = httpx.get(cluster.url + "/ready").json()["decode_workers"]
    shapes = [{"block_size": 0}, {"max_num_seqs": 0}, {"num_kv_blocks": -1}]
    shapes += [{"block_size": 2**63}, {"max_num_seqs": 2**64 - 1}, {"num_kv_blocks": 2**62}]
    for shape in shapes:
        answer = say_hello(address, **shape)
        assert isinstance(answer, wire.HelloAck) and not answer.accepted, (shape, answer)
        assert "needs block_size in [1, 65536], max_num_seqs in [1, " in answer.error
    response = openai_client.completions.create(
        model="smollm2", prompt="Still there?", max_tokens=4, temperature=0
    )
    assert response.usage.completion_tokens >= 1
    assert httpx.get(cluster.url + "/ready").json()["decode_workers"] == decode_workers


def test_garbage_frames_are_dropped_and_cluster_still_serves(cluster, openai_client):
    addresses = socket_addresses(cluster.log())
    assert set(addresses) == {"scheduler", "gateway-stream", "decode-0", "decode-1"}
    send_to_every_socket(addresses, GARBAGE)
    time.sleep(1.0)
    response = openai_client.completions.create(
        model="smollm2", prompt="Still there?", max_tokens=4, temperature=0
    )
    assert response.usage.completion_tokens >= 1
    log = cluster.log()
    for name in ("scheduler", "gateway", "decode-0", "decode-1"):
        lines = [line for line in log.splitlines() if line.startswith(f"[{name:>9}]")]
        assert any("dropped malformed" in line for line in lines), name
    assert not cluster.process.poll()
