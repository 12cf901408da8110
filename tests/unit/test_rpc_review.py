"""The RPC door and its client against wrong input, on real sockets."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import msgpack
import pytest
import zmq
import zmq.asyncio

from services.gateway.openai_protocol import ApiError
from services.gateway.rpc import RpcServer
from services.gateway.rpc_client import AsyncTandemClient, RpcError
from shared import wire


def _header(call_id: bytes, body: bytes) -> bytes:
    """An RPC_REQUEST's header with its call id and body as the MessagePack bytes given."""
    rest = [b"kind", msgpack.packb("chat"), b"stream", msgpack.packb(False)]
    fields = [b"call_id", call_id, b"body", body, *rest]
    packed = [f if i % 2 else msgpack.packb(f.decode()) for i, f in enumerate(fields)]
    return b"\x84" + b"".join(packed)


@contextlib.asynccontextmanager
async def door_and_raw_socket(address: str) -> AsyncIterator[zmq.asyncio.Socket]:
    """The RPC door (no cluster behind it: these calls never reach one) and a raw DEALER."""
    door = RpcServer(generator=object(), address=address)  # type: ignore[arg-type]
    await door.start()
    raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(address)
    try:
        yield raw
    finally:
        raw.close()
        await door.close()


def test_a_call_whose_body_is_not_utf8_is_answered_400_and_the_door_serves_on(tmp_path):
    """A foreign client's body of bytes that are no UTF-8 in a MessagePack str: the wire refuses
    the header, and the door's reading of the call id unpacked it the same strict way, so the
    call was dropped unanswered (its client waited out its timeout)."""
    address = f"ipc://{tmp_path}/rpc.sock"
    not_utf8 = _header(call_id=msgpack.packb("u"), body=b"\xa1\xff")  # (a 1-byte str: 0xff)

    async def scenario() -> None:
        async with door_and_raw_socket(address) as raw:
            await raw.send_multipart([bytes([wire.MessageType.RPC_REQUEST]), not_utf8])
            assert await raw.poll(5_000), "the call was dropped unanswered"
            event = wire.decode(await raw.recv_multipart())
            assert (event.call_id, event.kind, event.status) == ("u", "error", 400)
            assert event.done and "a malformed call" in json.loads(event.body)["error"]["message"]
            call = wire.RpcRequest(call_id="v", kind="chat", body="{not json", stream=False)
            await raw.send_multipart(wire.encode(call))  # the door serves on
            assert await raw.poll(5_000)
            event = wire.decode(await raw.recv_multipart())
            assert (event.call_id, event.status) == ("v", 400) and "not valid JSON" in event.body

    asyncio.run(asyncio.wait_for(scenario(), 30))


@pytest.mark.parametrize("call_id", [b"\xa1\xff", msgpack.packb("x" * 200), msgpack.packb(7)])
def test_a_call_id_that_is_no_sound_string_gets_no_answer(tmp_path, call_id):
    """A call id that is no UTF-8 (nor a string, or too long) can name no answer: dropped."""
    address = f"ipc://{tmp_path}/rpc.sock"
    header = _header(call_id=call_id, body=b"\xa1\xff")

    async def scenario() -> None:
        async with door_and_raw_socket(address) as raw:
            await raw.send_multipart([bytes([wire.MessageType.RPC_REQUEST]), header])
            assert await raw.poll(300) == 0

    asyncio.run(asyncio.wait_for(scenario(), 30))


class _StopsAtTokenization:
    """A generator as far as the door needs one to parse a call's body: it refuses the call
    when asked to tokenize it (the body was taken, in full)."""

    model_name = "m"
    max_model_len = 8192

    async def prepare_async(self, request, id_prefix):
        raise ApiError(400, f"taken: a prompt of {len(request.prompt_text):,} characters")


def _door_answers(tmp_path, body: dict) -> RpcError:
    """The error the door (stopping at tokenization) answers a completion call of `body`."""
    address = f"ipc://{tmp_path}/rpc.sock"

    async def scenario() -> RpcError:
        door = RpcServer(generator=_StopsAtTokenization(), address=address)  # type: ignore[arg-type]
        await door.start()
        try:
            async with AsyncTandemClient(address, timeout_s=20) as client:
                with pytest.raises(RpcError) as answered:
                    await client.completion(**body)
                return answered.value
        finally:
            await door.close()

    return asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_body_of_non_ascii_text_within_the_http_limit_is_sent(tmp_path):
    """2,000,000 CJK characters: 6 MB of UTF-8, within the 8 MiB both doors take. The client
    wrote the body with every character escaped (`\\u8a9e`, 6 characters each) and refused it
    itself with a 413, as more than a call carries; ASCII-only text was taken up to 8 MiB."""
    answer = _door_answers(tmp_path, {"model": "m", "prompt": "語" * 2_000_000})
    assert (answer.status, answer.message) == (400, "taken: a prompt of 2,000,000 characters")


def test_a_body_over_the_doors_limit_in_utf8_is_refused_413_by_the_door(tmp_path):
    answer = _door_answers(tmp_path, {"model": "m", "prompt": "語" * 3_000_000})  # 9 MB
    assert answer.status == 413 and "exceeds" in answer.message


def test_a_body_holding_a_lone_surrogate_is_a_400_from_the_door(tmp_path):
    """The wire carries no lone surrogate: such a body still travels escaped, and is refused by
    the door as HTTP refuses it (not by a WireError in the client)."""
    answer = _door_answers(tmp_path, {"model": "m", "prompt": "a\ud800b 語"})
    assert answer.status == 400 and "lone UTF-16 surrogate" in answer.message


def test_async_calls_a_gateway_reads_none_of_time_out_even_past_the_pipes_room(tmp_path):
    """Thousands of calls at once to a gateway that reads none (stopped, or its loop stuck):
    each found room when it polled, but only the first thousand or so fit the pipe, and the rest
    waited in their sends, past their timeout, for as long as the gateway read nothing."""
    address = f"ipc://{tmp_path}/gw.sock"

    async def scenario() -> list:
        context = zmq.asyncio.Context()
        deaf = context.socket(zmq.ROUTER)  # takes a connection, reads no call
        deaf.setsockopt(zmq.RCVHWM, 1)
        deaf.setsockopt(zmq.LINGER, 0)
        deaf.bind(address)
        client = AsyncTandemClient(address, timeout_s=1)
        try:
            calls = [client.completion(model="m", prompt="x" * 1000) for _ in range(3000)]
            tasks = [asyncio.create_task(call) for call in calls]
            done, late = await asyncio.wait(tasks, timeout=8)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
            assert not late, f"{len(late)} calls waited past their timeout"
            return [task.exception() for task in done]
        finally:
            await client.close()
            deaf.close()
            context.term()

    errors = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert all(isinstance(error, TimeoutError) for error in errors)
    assert any("took no call" in str(error) for error in errors)  # (not "no answer")
