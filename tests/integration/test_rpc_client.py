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


@pytest.mark.parametrize("timeout_s", [1e300, 1e7, 3e6])
def test_a_timeout_longer_than_one_poll_takes_is_waited(tmp_path, timeout_s):
    """ZeroMQ polls for at most 2**31 - 1 ms (24.8 days): a sync call given longer (a caller's
    "wait for good") raised OverflowError before it was even sent."""
    from services.gateway.rpc_client import AsyncTandemClient, TandemClient

    stop = threading.Event()
    thread = _gateway_that_answers_every_call(f"ipc://{tmp_path}/gw.sock", stop)
    try:
        with TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=timeout_s) as client:
            assert "call_id" in client.completion(model="m", prompt="hi")
            assert "call_id" in client.chat(model="m", messages=[], timeout_s=timeout_s)
            assert len(list(client.stream_completion(model="m", prompt="hi"))) == 1

        async def call() -> dict:
            async with AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=timeout_s) as c:
                return await c.completion(model="m", prompt="hi")

        assert "call_id" in asyncio.run(asyncio.wait_for(call(), 10))
    finally:
        stop.set()
        thread.join(5)


def test_a_wait_made_of_several_polls_still_ends_at_its_timeout(tmp_path, monkeypatch):
    """A long wait is polled in slices: the call times out at its own timeout, not the first
    slice's end, and answers that come in a later slice are read."""
    from services.gateway import rpc_client
    from services.gateway.rpc_client import TandemClient

    monkeypatch.setattr(rpc_client, "MAX_POLL_MS", 50)
    context = zmq.Context()
    silent = context.socket(zmq.ROUTER)  # takes calls, never answers
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind(f"ipc://{tmp_path}/gw.sock")
    try:
        with TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=0.5) as client:
            start = time.monotonic()
            with pytest.raises(TimeoutError, match="no answer"):
                client.completion(model="m", prompt="hi")
            assert 0.45 < time.monotonic() - start < 3
    finally:
        silent.close()
        context.term()
    stop = threading.Event()
    thread = _gateway_that_answers_every_call(f"ipc://{tmp_path}/gw2.sock", stop)
    try:
        with TandemClient(f"ipc://{tmp_path}/gw2.sock", timeout_s=5) as client:
            assert "call_id" in client.completion(model="m", prompt="hi")
    finally:
        stop.set()
        thread.join(5)


@pytest.mark.parametrize(
    "timeout_s",
    [True, False, "5", None, [1], float("nan"), -1.0, 0, 10**400],
    ids=["True", "False", "str", "None", "list", "nan", "negative", "zero", "10**400"],
)
def test_a_timeout_that_is_not_seconds_is_a_value_error_before_anything_is_sent(timeout_s):
    """`True` was taken for 1 s, `"5"` raised a TypeError about `<`, 10**400 (an int past any
    float) an OverflowError once called; `None` as a client's own timeout was the same
    TypeError (a call's `None` means the client's, as documented)."""
    from services.gateway.rpc_client import AsyncTandemClient, TandemClient

    with pytest.raises(ValueError, match="timeout_s must be"):
        TandemClient("ipc:///nonexistent/gw.sock", timeout_s=timeout_s)
    with TandemClient("ipc:///nonexistent/gw.sock") as client:
        if timeout_s is not None:
            with pytest.raises(ValueError, match="timeout_s must be"):
                client.completion(model="m", prompt="hi", timeout_s=timeout_s)
            with pytest.raises(ValueError, match="timeout_s must be"):
                client.stream_chat(model="m", messages=[], timeout_s=timeout_s)

    async def refused() -> None:
        with pytest.raises(ValueError, match="timeout_s must be"):
            AsyncTandemClient("ipc:///nonexistent/gw.sock", timeout_s=timeout_s)
        async with AsyncTandemClient("ipc:///nonexistent/gw.sock") as client:
            if timeout_s is not None:
                with pytest.raises(ValueError, match="timeout_s must be"):
                    await client.completion(model="m", prompt="hi", timeout_s=timeout_s)
                with pytest.raises(ValueError, match="timeout_s must be"):
                    client.stream_completion(model="m", prompt="hi", timeout_s=timeout_s)

    asyncio.run(refused())


def test_a_call_on_a_closed_client_says_the_client_is_closed():
    """It raised ZeroMQ's "Operation not supported" (and an async client's reader tasks then
    died unretrieved on the closed socket)."""
    from services.gateway.rpc_client import AsyncTandemClient, TandemClient

    client = TandemClient("ipc:///nonexistent/gw.sock", timeout_s=1)
    stream = client.stream_completion(model="m", prompt="hi")
    client.close()
    with pytest.raises(ConnectionError, match="closed"):
        client.completion(model="m", prompt="hi")
    with pytest.raises(ConnectionError, match="closed"):
        next(stream)

    async def closed() -> None:
        client = AsyncTandemClient("ipc:///nonexistent/gw.sock", timeout_s=1)
        stream = client.stream_chat(model="m", messages=[])
        await client.close()
        with pytest.raises(ConnectionError, match="closed"):
            await client.completion(model="m", prompt="hi")
        with pytest.raises(ConnectionError, match="closed"):
            await stream.__anext__()
        assert client._reader is None and client._watcher is None  # (none started to die)

    asyncio.run(closed())


def test_a_sync_client_used_by_two_threads_at_once_says_so(tmp_path):
    """A sync client is not thread-safe (documented): two threads' calls at once interleaved
    their frames on the one socket, and the gateway read garbage or another call's parts,
    while the callers hung. The second thread now gets a RuntimeError saying why, and the
    first thread's call is unharmed."""
    from services.gateway.rpc_client import TandemClient
    from shared import wire

    context = zmq.Context()
    router = context.socket(zmq.ROUTER)  # answers the first call once the second was tried
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/gw.sock")
    client = TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=10)
    answers: list = []
    first = threading.Thread(
        target=lambda: answers.append(client.completion(model="m", prompt="a"))
    )
    first.start()
    try:
        assert router.poll(5_000), "no call came"
        identity, call = wire.recv_from(router)
        with pytest.raises(RuntimeError, match="thread"):
            client.completion(model="m", prompt="b")
        with pytest.raises(RuntimeError, match="thread"):
            next(client.stream_completion(model="m", prompt="c"))
        assert router.poll(200) == 0  # nothing of theirs was sent
        answer = wire.RpcEvent(call_id=call.call_id, kind="response", body='{"ok": 1}',
                               status=200, done=True)  # fmt: skip
        wire.send_to(router, identity, answer)
        first.join(5)
        assert answers == [{"ok": 1}]
    finally:
        client.close()
        router.close()
        context.term()


_SILENT_GATEWAY = """
import sys, zmq
router = zmq.Context().socket(zmq.ROUTER)
router.bind(sys.argv[1])
router.recv_multipart()  # a call: then it is stopped, as a gateway host that went silent
print("taken", flush=True)
router.recv_multipart()
"""


@pytest.mark.parametrize("client_kind", ["sync", "async"])
def test_a_call_to_a_gateway_gone_silent_fails_once_heartbeats_go_unanswered(
    tmp_path, monkeypatch, client_kind
):
    """A gateway host that vanished without closing its connections (power lost, a network
    cut, a process stopped): the connection looked alive, so its calls waited out their whole
    timeout (300 s by default, and each new call the same). ZMTP heartbeats now close it once
    the gateway answers none for `GATEWAY_SILENCE_S`, and the calls in flight fail as on a
    dropped connection."""
    import signal
    import subprocess
    import sys

    from services.gateway import rpc_client

    monkeypatch.setattr(rpc_client, "GATEWAY_SILENCE_S", 1.0)
    address = f"ipc://{tmp_path}/gw.sock"
    gateway = subprocess.Popen(
        [sys.executable, "-c", _SILENT_GATEWAY, address], stdout=subprocess.PIPE, text=True
    )
    try:

        def stop_once_taken() -> None:
            assert gateway.stdout.readline().strip() == "taken"
            gateway.send_signal(signal.SIGSTOP)

        stopper = threading.Thread(target=stop_once_taken, daemon=True)
        stopper.start()
        start = time.monotonic()
        with pytest.raises(ConnectionError, match="dropped"):
            if client_kind == "sync":
                with rpc_client.TandemClient(address, timeout_s=30) as client:
                    client.completion(model="m", prompt="hi")
            else:

                async def call() -> None:
                    async with rpc_client.AsyncTandemClient(address, timeout_s=30) as client:
                        await client.completion(model="m", prompt="hi")

                asyncio.run(call())
        assert time.monotonic() - start < 10
        stopper.join(5)
    finally:
        gateway.kill()
        gateway.wait()
