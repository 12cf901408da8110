"""The RPC messages on the wire: round trips, and refusal of wrong types with the field named.
(Arbitrary round trips of every message are in test_wire.py.)"""

from __future__ import annotations

import json
import re

import msgpack
import pytest

from shared import wire
from shared.wire import MessageType, WireError


def frames(code: MessageType, header: dict) -> list[bytes]:
    return [bytes([code]), msgpack.packb(header)]


def test_request_and_event_round_trip_with_a_long_body():
    body = json.dumps({"model": "m", "prompt": "x" * 100_000})  # far beyond MAX_STR_LEN
    request = wire.RpcRequest(call_id="7", kind="chat", body=body, stream=True)
    assert wire.decode(wire.encode(request)) == request
    event = wire.RpcEvent(call_id="7", kind="error", body="{}", status=429, retry_after_s=2.0,
                          done=True)  # fmt: skip
    assert wire.decode(wire.encode(event)) == event
    assert wire.decode(frames(MessageType.RPC_CANCEL, {"call_id": "7"})) == wire.RpcCancel(
        call_id="7"
    )


def test_retry_after_may_be_left_out():
    header = {"call_id": "1", "kind": "end", "body": "", "status": 200, "done": True}
    assert wire.decode(frames(MessageType.RPC_EVENT, header)).retry_after_s is None


@pytest.mark.parametrize(
    ("code", "header", "expected"),
    [
        (MessageType.RPC_REQUEST, {"call_id": "1", "kind": "chat", "body": "{}", "stream": 1},
         "RpcRequest.stream: expected bool, got int"),
        (MessageType.RPC_REQUEST, {"call_id": "1", "kind": "embed", "body": "{}", "stream": False},
         "RpcRequest.kind: expected one of ['completion', 'chat', 'tokenize', 'detokenize']"),
        (MessageType.RPC_REQUEST, {"call_id": 1, "kind": "chat", "body": "{}", "stream": False},
         "RpcRequest.call_id: expected str, got int"),
        (MessageType.RPC_REQUEST, {"call_id": "1", "kind": "chat", "body": {"model": "m"},
                                   "stream": False},
         "RpcRequest.body: expected str, got dict"),
        (MessageType.RPC_CANCEL, {"call_id": "x" * 129}, "RpcCancel.call_id: string of 129"),
        (MessageType.RPC_EVENT, {"call_id": "1", "kind": "chunk", "body": "{}", "status": "200",
                                 "done": False},
         "RpcEvent.status: expected int, got str"),
    ],
)  # fmt: skip
def test_wrong_types_are_refused_naming_the_field(code, header, expected):
    with pytest.raises(WireError, match=re.escape(expected)):
        wire.decode(frames(code, header))


def test_a_client_with_no_gateway_to_talk_to_times_out_instead_of_hanging(tmp_path):
    import asyncio
    import time

    from services.gateway.rpc_client import AsyncTandemClient, TandemClient

    address = f"ipc://{tmp_path}/nobody.sock"
    start = time.monotonic()
    with TandemClient(address, timeout_s=0.5) as client, pytest.raises(TimeoutError) as raised:
        client.completion(model="m", prompt="hi")
    assert "no connection" in str(raised.value) and time.monotonic() - start < 5

    async def call() -> None:
        async with AsyncTandemClient(address, timeout_s=0.5) as client:
            await client.completion(model="m", prompt="hi")

    with pytest.raises(TimeoutError, match="no connection"):
        asyncio.run(asyncio.wait_for(call(), 10))
