"""The RPC door's limits, on real ZeroMQ sockets against a real `Generator` (its cluster played):
a call id reused while its call is in flight, and the events queued for a client that reads
none."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator

import zmq
import zmq.asyncio

from services.gateway import rpc
from services.gateway.generation import Generator
from services.gateway.rpc import RpcServer
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import MODEL, PlayedCluster, delta, tokenizer  # noqa: F401


class HoldsTheFirstCall(PlayedCluster):
    """Holds the first request submitted (its queue stays empty: it generates for ever) and
    answers every later one with one token."""

    def __init__(self) -> None:
        super().__init__({})
        self.submitted: list[str] = []

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        if self.submitted:
            queue.put_nowait(delta([28], finish="length"))
        self.submitted.append(submit.request_id)
        return queue


@contextlib.asynccontextmanager
async def door_and_client(address: str, generator: Generator) -> AsyncIterator[zmq.asyncio.Socket]:
    """The RPC door and a raw DEALER (which may reuse a call id, as no `rpc_client` does)."""
    door = RpcServer(generator, address=address)
    await door.start()
    client = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVHWM, 1)  # (its share of the pipe is full at once: see the flood)
    client.connect(address)
    try:
        yield client
    finally:
        client.close()
        await door.close()


def _generator(tokenizer, cluster: PlayedCluster) -> Generator:  # noqa: F811
    return Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()))


def _call(call_id: str, kind: str, body: dict, stream: bool = False) -> list[bytes]:
    return wire.encode(
        wire.RpcRequest(call_id=call_id, kind=kind, body=json.dumps(body), stream=stream)
    )


async def _events_until_done(client: zmq.asyncio.Socket, call_id: str) -> list[wire.RpcEvent]:
    """Every event the client is sent (probes left out) until `call_id`'s last one."""
    events = []
    while not events or events[-1].call_id != call_id or not events[-1].done:
        assert await client.poll(10_000), f"call {call_id} was not answered"
        event = wire.decode(await client.recv_multipart())
        if event.kind != "waiting":
            events.append(event)
    return events


def test_a_call_id_reused_in_flight_ends_the_first_call_with_one_409(tmp_path, tokenizer):  # noqa: F811
    """The door answered the second call 409 (done) under the id the first call's events carry,
    so its client took the first call for ended, while the cluster kept generating it."""
    cluster = HoldsTheFirstCall()
    body = {"model": MODEL, "prompt": "Once", "max_tokens": 4}

    async def scenario() -> None:
        generator = _generator(tokenizer, cluster)
        async with door_and_client(f"ipc://{tmp_path}/rpc.sock", generator) as client:
            await client.send_multipart(_call("a", "completion", body, stream=True))
            while not cluster.submitted:  # (generating, in the cluster)
                await asyncio.sleep(0.01)
            await client.send_multipart(_call("a", "completion", body, stream=True))
            (ended,) = await _events_until_done(client, "a")
            assert (ended.kind, ended.status, ended.done) == ("error", 409, True)
            assert "in flight" in json.loads(ended.body)["error"]["message"]
            assert cluster.cancelled == cluster.submitted  # the first call's generation
            # A fresh call is served; nothing more came for "a" (it would have come first).
            await client.send_multipart(_call("b", "completion", body))
            (answered,) = await _events_until_done(client, "b")
            assert (answered.kind, answered.status) == ("response", 200)
            assert len(cluster.submitted) == 2 and cluster.cancelled == cluster.submitted[:1]

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_the_events_a_client_reads_none_of_wait_in_the_door_not_in_zeromq(
    tmp_path,
    tokenizer,  # noqa: F811
    monkeypatch,
):
    """ZeroMQ's send pipe is counted in messages (1,000 by default), and an event may be MiBs:
    a client that sent calls with big answers and read none had them all queued in the pipe
    (GiBs). Its events now find the pipe full after a few, and wait in line in the door, where
    a call in flight holds its answer (at most `MAX_CALLS_PER_CLIENT` of them)."""
    num_calls = rpc.MAX_EVENTS_IN_PIPE + 150
    # 128 KiB of text per answer (at 80 characters a token): the socket buffers between hold
    # only a few of them.
    token_ids = tokenizer("#" * (128 << 10), add_special_tokens=False).input_ids
    body = {"model": MODEL, "tokens": token_ids}
    sent: list[str] = []  # the kinds of the events ZeroMQ took
    refused = asyncio.Event()  # ZeroMQ refused one (zmq.Again: the client's pipe is full)
    send = wire.async_send_to

    async def counted_send(socket, identity, message, flags=0) -> None:
        try:
            await send(socket, identity, message, flags)
        except zmq.Again:
            refused.set()
            raise
        sent.append(message.kind)

    monkeypatch.setattr(wire, "async_send_to", counted_send)
    generator = _generator(tokenizer, PlayedCluster({}))

    async def scenario() -> None:
        async with door_and_client(f"ipc://{tmp_path}/rpc.sock", generator) as client:
            for n in range(num_calls):
                await client.send_multipart(_call(str(n), "detokenize", body))
            deadline = time.monotonic() + 30  # (answered, or refused 429 past 256 in flight)
            while len(sent) < num_calls and not refused.is_set():
                assert time.monotonic() < deadline, f"{len(sent)} events sent in 30 s"
                await asyncio.sleep(0.05)
            assert refused.is_set(), f"all {num_calls} calls' events were queued in ZeroMQ"
            # (and the few the socket buffers between hold)
            assert sent.count("response") <= rpc.MAX_EVENTS_IN_PIPE + 16

    asyncio.run(asyncio.wait_for(scenario(), 60))
