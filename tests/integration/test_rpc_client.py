"""The RPC client's calls when the gateway cannot answer them: a connection that drops with
calls in flight, and a client closed while other tasks wait on its calls. A raw ROUTER plays
the gateway (one that takes a call and goes, or never answers); the client is the real one."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import zmq
import zmq.asyncio


def _gateway_that_takes_a_call_then_goes(address: str, taken: threading.Event) -> threading.Thread:
    """A gateway's ROUTER that reads one call and closes without answering: a gateway that
    restarted, with the call in flight (its answer will never come)."""

    def serve() -> None:
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        assert router.poll(10_000), "no call came"
        router.recv_multipart()
        taken.set()
        time.sleep(0.2)
        router.close()
        context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_a_call_in_flight_when_the_connection_drops_fails_at_once(tmp_path):
    """Calls in flight when the connection to the gateway drops are lost (a reconnection is a
    new peer to the gateway's ROUTER, which cancels the old one's calls): they waited out
    their whole timeout (300 s by default). They fail when the connection drops, saying so."""
    from services.gateway.rpc_client import TandemClient

    taken = threading.Event()
    thread = _gateway_that_takes_a_call_then_goes(f"ipc://{tmp_path}/gw.sock", taken)
    start = time.monotonic()
    with (
        TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=60) as client,
        pytest.raises(ConnectionError, match="connection to .* dropped"),
    ):
        client.completion(model="m", prompt="hi")
    assert taken.is_set() and time.monotonic() - start < 10
    thread.join(5)


def test_an_async_call_in_flight_when_the_connection_drops_fails_at_once(tmp_path):
    from services.gateway.rpc_client import AsyncTandemClient

    taken = threading.Event()
    thread = _gateway_that_takes_a_call_then_goes(f"ipc://{tmp_path}/gw.sock", taken)

    async def call() -> None:
        async with AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=60) as client:
            await client.completion(model="m", prompt="hi")

    start = time.monotonic()
    with pytest.raises(ConnectionError, match="connection to .* dropped"):
        asyncio.run(asyncio.wait_for(call(), 30))
    assert taken.is_set() and time.monotonic() - start < 10
    thread.join(5)


def test_closing_an_async_client_ends_the_calls_other_tasks_wait_on(tmp_path):
    """`close()` from one task: another task's call waited out its whole timeout."""
    from services.gateway.rpc_client import AsyncTandemClient

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)  # a gateway that takes calls and never answers
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{tmp_path}/gw.sock")
        client = AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=60)
        waiting = asyncio.create_task(client.completion(model="m", prompt="hi"))
        await router.recv_multipart()  # the call is in flight
        await client.close()
        with pytest.raises(ConnectionError, match="closed"):
            await asyncio.wait_for(waiting, 5)
        router.close()
        context.term()

    asyncio.run(scenario())


def test_a_client_closed_twice_is_closed():
    from services.gateway.rpc_client import AsyncTandemClient, TandemClient

    client = TandemClient("ipc:///nonexistent/gw.sock")
    client.close()
    client.close()

    async def twice() -> None:
        client = AsyncTandemClient("ipc:///nonexistent/gw.sock")
        await client.close()
        await client.close()

    asyncio.run(twice())


def test_a_green_client_waiting_for_an_answer_lets_other_greenlets_run(tmp_path):
    """Locust's agent users share one process with gevent: a call's wait must yield (it took a
    plain zmq.Poller, which blocks the whole process)."""
    import gevent
    import zmq.green

    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes calls, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"ipc://{tmp_path}/gw.sock")
    ticks = []

    def tick() -> None:
        for _ in range(20):
            ticks.append(time.monotonic())
            gevent.sleep(0.02)

    from services.gateway.rpc_client import TandemClient

    green = zmq.green.Context()
    client = TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=1.0, context=green)
    ticker = gevent.spawn(tick)
    with pytest.raises(TimeoutError):
        client.completion(model="m", prompt="hi")
    ticker.join()
    client.close()
    green.term()
    silent.close()
    context.term()
    assert len(ticks) == 20 and ticks[-1] - ticks[0] < 0.9  # they ran during the call's wait


def test_a_call_the_wire_refuses_is_answered_with_a_400_naming_why(tmp_path):
    """A call whose frames the door's wire refuses (an unknown kind, `stream` as 1 from a
    client in another language) was dropped, logged only: its client waited out its whole
    timeout. When its call id can be read, it is answered 400 with the wire's reason; frames
    with none are still dropped, and the door goes on serving."""
    import msgpack

    from services.gateway.rpc import RpcServer
    from services.gateway.rpc_client import AsyncTandemClient, RpcError
    from shared import wire

    address = f"ipc://{tmp_path}/rpc.sock"
    odd_stream = {"call_id": "s", "kind": "chat", "body": "{}", "stream": 1}

    async def scenario() -> None:
        door = RpcServer(generator=object(), address=address)  # type: ignore[arg-type]
        await door.start()
        raw = zmq.asyncio.Context.instance().socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(address)
        try:
            async with AsyncTandemClient(address, timeout_s=5) as client:
                with pytest.raises(RpcError) as refused:
                    await client.call("embeddings", {"model": "m", "input": "hi"})  # type: ignore[arg-type]
                assert refused.value.status == 400 and "RpcRequest.kind" in refused.value.message
            code = bytes([wire.MessageType.RPC_REQUEST])
            await raw.send_multipart([code, b"\x80"])  # no call id: dropped
            await raw.send_multipart([code, msgpack.packb(odd_stream)])
            assert await raw.poll(5_000), "no answer"
            event = wire.decode(await raw.recv_multipart())
            assert (event.call_id, event.kind, event.status) == ("s", "error", 400)
            assert "RpcRequest.stream: expected bool" in event.body
            assert await raw.poll(200) == 0  # (one answer: the garbage got none)
        finally:
            raw.close()
            await door.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def test_a_cancel_that_meets_an_answer_cancels_the_wait():
    """Python 3.11's `wait_for` returned an event that came in the turn its waiter was
    cancelled: the cancel was lost, and the caller (a batch line being stopped, a task with its
    own deadline) went on as if it had not been asked to stop."""
    from services.gateway.rpc_client import AsyncTandemClient
    from shared import wire

    async def scenario() -> None:
        client = AsyncTandemClient("ipc:///nonexistent/gw.sock")
        client._inbox["c1"] = asyncio.Queue()
        waiter = asyncio.create_task(client._next_event("c1", 60))
        await asyncio.sleep(0)  # it waits for the event
        event = wire.RpcEvent(call_id="c1", kind="response", body="{}", status=200, done=True)
        client._inbox["c1"].put_nowait(event)
        waiter.cancel()  # in the same turn
        with pytest.raises(asyncio.CancelledError):
            await waiter
        await client.close()

    asyncio.run(scenario())


def test_a_call_a_bug_fails_is_a_500_without_the_exceptions_text(tmp_path):
    """The RPC door sent the exception's own text (another request's data, the server's
    internals) where the HTTP API says only its type and points at the log."""
    from services.gateway.rpc import RpcServer
    from services.gateway.rpc_client import AsyncTandemClient, RpcError

    address = f"ipc://{tmp_path}/rpc.sock"

    async def scenario() -> None:
        door = RpcServer(generator=object(), address=address)  # type: ignore[arg-type]: a bug
        await door.start()
        try:
            async with AsyncTandemClient(address, timeout_s=5) as client:
                with pytest.raises(RpcError) as failed:
                    await client.chat(model="m", messages=[{"role": "user", "content": "hi"}])
            assert failed.value.status == 500
            assert "AttributeError" in failed.value.message
            assert "has no attribute" not in failed.value.message
        finally:
            await door.close()

    asyncio.run(asyncio.wait_for(scenario(), 30))


def _gateway_that_answers_every_call(address: str, stop: threading.Event) -> threading.Thread:
    """A gateway's ROUTER that answers each call with `{"call_id": ...}` until `stop`."""
    from shared import wire

    def serve() -> None:
        context = zmq.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(address)
        while not stop.is_set():
            if not router.poll(50):
                continue
            identity, call = wire.recv_from(router)
            if isinstance(call, wire.RpcRequest):
                body = json.dumps({"call_id": call.call_id})
                answer = wire.RpcEvent(call_id=call.call_id, kind="response", body=body,
                                       status=200, done=True)  # fmt: skip
                wire.send_to(router, identity, answer)
        router.close()
        context.term()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_an_async_client_serves_one_event_loop_after_another(tmp_path):
    """A client used by one `asyncio.run` after another (a script's steps, a test per loop):
    its reader was a task of the first loop, which ended with it, so every later call waited
    out its whole timeout with its answer unread, and `close()` raised "Event loop is closed"."""
    from services.gateway.rpc_client import AsyncTandemClient

    stop = threading.Event()
    thread = _gateway_that_answers_every_call(f"ipc://{tmp_path}/gw.sock", stop)
    client = AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=5)
    try:
        for _ in range(2):
            started = time.monotonic()
            answer = asyncio.run(client.completion(model="m", prompt="hi"))
            assert "call_id" in answer and time.monotonic() - started < 2
    finally:
        asyncio.run(client.close())
        stop.set()
        thread.join(5)
