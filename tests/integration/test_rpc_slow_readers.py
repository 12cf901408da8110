"""The RPC door and clients that read their events slower than their calls answer: every
answer still arrives once the client reads, other clients are served meanwhile, and a client
that reads nothing for `client_timeout_s` has its calls cancelled.

The calls here carry bodies that are not JSON, so each is answered with a 400 by the door
itself: no generator is needed to fill a client's pipe with answers (the door's answers to
a real generation take the same `_route`). The pipes are made short (`SNDHWM`, `RCVHWM`)
so that a few thousand answers overflow them and the socket buffers between."""

from __future__ import annotations

import asyncio
import time

import zmq
import zmq.asyncio

from services.gateway import rpc
from services.gateway.rpc import RpcServer
from shared import wire

NUM_CALLS = 3_000


def _bad_call(call_id: int) -> wire.RpcRequest:
    return wire.RpcRequest(call_id=str(call_id), kind="completion", body="{not json",
                           stream=False, api_key=None, bulk=False)  # fmt: skip


async def _door(address: str, client_timeout_s: float) -> RpcServer:
    door = RpcServer(generator=object(), address=address, client_timeout_s=client_timeout_s)  # type: ignore[arg-type]
    await door.start()
    door.socket.setsockopt(zmq.SNDHWM, 10)  # (before any client connects: its pipe's bound)
    return door


def _client(context: zmq.asyncio.Context, address: str) -> zmq.asyncio.Socket:
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RCVHWM, 10)
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    return socket


async def _flood(socket: zmq.asyncio.Socket, num_calls: int = NUM_CALLS) -> None:
    for call_id in range(num_calls):
        await socket.send_multipart(wire.encode(_bad_call(call_id)))


async def _answers(socket: zmq.asyncio.Socket, expected: int, within_s: float) -> list:
    events = []
    deadline = time.monotonic() + within_s
    while len(events) < expected and time.monotonic() < deadline:
        if await socket.poll(100):
            events.append(wire.decode(await socket.recv_multipart()))
    return [event for event in events if event.kind != "waiting"]


def test_a_client_that_reads_late_gets_every_answer_once(tmp_path):
    async def scenario() -> None:
        door = await _door(f"ipc://{tmp_path}/rpc.sock", client_timeout_s=30)
        context = zmq.asyncio.Context()
        slow = _client(context, door.address)
        try:
            await _flood(slow)
            await asyncio.sleep(1.0)  # the door answers into a full pipe meanwhile

            other = _client(context, door.address)  # served while the slow one's pipe is full
            await other.send_multipart(wire.encode(_bad_call(0)))
            answered = await _answers(other, 1, within_s=5)
            assert [(e.call_id, e.status) for e in answered] == [("0", 400)]
            other.close()

            events = await _answers(slow, NUM_CALLS, within_s=60)
            call_ids = [event.call_id for event in events]
            assert sorted(call_ids, key=int) == [str(n) for n in range(NUM_CALLS)]  # once each
            # 400 for a body that is not JSON; 429 once 256 calls waited on the full pipe
            assert {event.status for event in events} <= {400, 429}
            assert all(event.done for event in events)
            assert door._probe_task is not None and not door._probe_task.done()
            # Its calls all ended: its count of calls in flight is back to none, and its next
            # call is served, not refused for the 256 of before.
            assert not door._calls and not door._num_calls
            await slow.send_multipart(wire.encode(_bad_call(NUM_CALLS)))
            again = await _answers(slow, 1, within_s=5)
            assert [(e.call_id, e.status) for e in again] == [(str(NUM_CALLS), 400)]
        finally:
            slow.close()
            await door.close()
            context.term()

    asyncio.run(scenario())


def test_a_client_that_never_reads_has_its_calls_cancelled(tmp_path, monkeypatch):
    monkeypatch.setattr(rpc, "PROBE_S", 60.0)  # (its pruning would hide who dropped the client)

    async def scenario() -> None:
        door = await _door(f"ipc://{tmp_path}/rpc.sock", client_timeout_s=1.0)
        context = zmq.asyncio.Context()
        stuck = _client(context, door.address)
        try:
            await _flood(stuck)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and (door._calls or door._replies):
                await asyncio.sleep(0.1)
            assert not door._calls and not door._replies  # nothing waits on it for ever
            assert not door._num_calls
            assert len(door._stalled) == 1  # dropped for reading nothing, not by a heartbeat
            assert not door._send_lines  # each line went with its last sender
            assert door._probe_task is not None and not door._probe_task.done()
        finally:
            stuck.close()
            await door.close()
            context.term()

    asyncio.run(scenario())


def test_refusals_to_a_client_that_reads_nothing_are_bounded(tmp_path, monkeypatch):
    """Past its 256 calls in flight each call is refused (429); to a client that reads nothing
    each refusal waits in line, a task each, for up to its timeout: without a bound a flood of
    calls grew the gateway's memory without one."""
    monkeypatch.setattr(rpc, "MAX_REPLIES_IN_LINE", 100)

    async def scenario() -> None:
        door = await _door(f"ipc://{tmp_path}/rpc.sock", client_timeout_s=30)
        context = zmq.asyncio.Context()
        flooding = _client(context, door.address)
        try:
            # More refusals than the socket buffers between take (some thousands of events).
            await _flood(flooding, 2 * NUM_CALLS)
            deadline = time.monotonic() + 5  # the door reads the flood meanwhile
            while time.monotonic() < deadline:
                assert len(door._replies) <= 100  # (unbounded, thousands)
                await asyncio.sleep(0.05)
            assert door._replies and max(door._num_replies.values()) <= 100
        finally:
            flooding.close()
            await door.close()
            context.term()

    asyncio.run(scenario())


def test_a_door_with_a_client_timeout_longer_than_zeromq_counts_serves(tmp_path):
    """`--rpc-client-timeout-s` is any positive, finite number of seconds; one over 24.8 days
    (ZeroMQ's heartbeat timeout is a C int of ms) raised OverflowError at the gateway's start."""

    async def scenario() -> None:
        for n, client_timeout_s in enumerate([1e300, 1e7, 1e-6]):
            address = f"ipc://{tmp_path}/rpc{n}.sock"
            door = await _door(address, client_timeout_s)
            context = zmq.asyncio.Context()
            client = _client(context, address)
            try:
                await _flood(client, num_calls=1)
                (answer,) = await _answers(client, expected=1, within_s=5)
                assert answer.status == 400
            finally:
                client.close()
                context.term()
                await door.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))
