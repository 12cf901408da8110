"""Garbage on every ZeroMQ socket of a running cluster is logged and dropped; service goes on."""

from __future__ import annotations

import re
import time

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
