"""The gateway's cluster link at the edges of what its workers and its settings may hold: a
token id no tokenizer has (the wire carries int32, so a broken worker can send a negative one),
and time settings that are no lengths of time. The scheduler is played by the test on a real
ROUTER socket (tests.integration.test_gateway_resume)."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest
import zmq
import zmq.asyncio

from services.gateway.cluster import ClusterClient
from services.gateway.rpc_client import AsyncTandemClient, TandemClient
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import delta, opened


def with_tops(request_id: str, tokens: list[int], tops: list[list[tuple[int, float]]]):
    return wire.Tokens(
        deltas=[wire.TokenDelta(request_id=request_id, token_ids=tokens,
                                logprobs=[-0.5] * len(tokens), top_logprobs=tops)]
    )  # fmt: skip


def with_prompt_tops(request_id: str, tokens: list[int], tops: list[list[tuple[int, float]]]):
    return wire.Tokens(
        deltas=[wire.TokenDelta(request_id=request_id, token_ids=tokens,
                                prompt_logprobs=[-1.0] * len(tops), prompt_top_logprobs=tops)]
    )  # fmt: skip


async def negative_token(tmp_path, bad: wire.Tokens) -> tuple[list[wire.TokenDelta], wire.Cancel]:
    async with opened(tmp_path) as link:
        await link.scheduler.send(delta("r", [7]))
        await link.scheduler.send(bad)
        await link.scheduler.send(delta("r", [9], finish="length"))  # late: dropped
        got = [await asyncio.wait_for(link.queue.get(), 5) for _ in range(2)]
        cancel = await asyncio.wait_for(link.scheduler.expect(wire.Cancel), 5)
        await asyncio.sleep(0.05)
        assert link.queue.empty()
    return got, cancel


@pytest.mark.parametrize(
    "bad",
    [
        delta("r", [8, -3]),
        with_tops("r", [8], [[(8, -0.5), (-3, -2.0)]]),
        with_prompt_tops("r", [8], [[(-3, -1.0)], [(2, -0.1)]]),
    ],
    ids=["token", "top_logprob", "prompt_top_logprob"],
)
def test_a_negative_token_id_from_a_worker_fails_its_request_naming_it(tmp_path, bad):
    """Its decoding raised OverflowError in the handler: the client got a bare 500 (a stream
    cut off) naming no cause. Now the request ends with an error that names the id, its
    attempt is called off, and the attempt's later deltas are dropped."""
    got, cancel = asyncio.run(negative_token(tmp_path, bad))
    assert got[0].token_ids == [7]
    assert got[1].finish_reason == "error" and got[1].token_ids == []
    assert "-3" in got[1].error
    assert cancel.request_id == "r"


def cluster_client(**settings) -> ClusterClient:
    return ClusterClient("ipc:///nowhere/scheduler", "ipc:///nowhere/stream",
                         "ipc:///nowhere/stream", "g", "m", GatewayEvents(get_logger()),
                         **settings)  # fmt: skip


TIME_SETTINGS = ["status_timeout_s", "stream_end_grace_s", "orphan_silence_s"]


@pytest.mark.parametrize("name", TIME_SETTINGS)
@pytest.mark.parametrize("value", [0.0, -1.0, math.nan, math.inf])
def test_a_time_setting_that_is_no_length_of_time_is_refused_naming_it(name, value):
    """A NaN grace never ended its sleep (a chore left for good per request whose end the
    scheduler told), a zero or negative one took every stream end told ahead of its tokens as
    lost (a needless resumption), and a zero status timeout said HELLO in a busy loop."""
    with pytest.raises(ValueError, match=name):
        cluster_client(**{name: value})


@pytest.mark.parametrize("value", [0, -1, 2.5])
def test_a_pending_submits_bound_that_is_no_count_is_refused_naming_it(value):
    """Zero (or less) refused every request with a 429 that asked to retry shortly."""
    with pytest.raises(ValueError, match="max_pending_submits"):
        cluster_client(max_pending_submits=value)


def test_sound_settings_are_kept():
    client = cluster_client(status_timeout_s=0.5, stream_end_grace_s=0.01,
                            orphan_silence_s=1e-3, max_pending_submits=1)  # fmt: skip
    assert (client.status_timeout_s, client.stream_end_grace_s) == (0.5, 0.01)
    assert (client.orphan_silence_s, client.max_pending_submits) == (1e-3, 1)


BAD_SECONDS = [0.0, -1.0, math.nan, math.inf]


@pytest.mark.parametrize("client_class", [TandemClient, AsyncTandemClient])
@pytest.mark.parametrize("value", BAD_SECONDS)
def test_an_rpc_client_timeout_that_is_no_length_of_time_is_refused(client_class, value):
    """A negative timeout waited for a connection for good (a negative poll is an endless
    one); a NaN one failed each call at once, after sending it."""
    with pytest.raises(ValueError, match="timeout_s"):
        client_class("ipc:///nowhere/gw.sock", timeout_s=value)


@pytest.mark.parametrize("value", BAD_SECONDS)
def test_an_rpc_calls_timeout_that_is_no_length_of_time_is_refused_before_it_is_sent(value):
    """A call's own timeout: 0 silently meant the client's, a negative or NaN one timed the call
    out at once after sending it (the gateway began the work, then was told to cancel it)."""
    with TandemClient("ipc:///nowhere/gw.sock", timeout_s=0.2) as client:
        with pytest.raises(ValueError, match="timeout_s"):
            client.completion(model="m", prompt="hi", timeout_s=value)
        with pytest.raises(ValueError, match="timeout_s"):
            client.stream_chat(model="m", messages=[], timeout_s=value)
        assert not client._inbox  # nothing was sent

    async def asynchronous() -> None:
        async with AsyncTandemClient("ipc:///nowhere/gw.sock", timeout_s=0.2) as client:
            with pytest.raises(ValueError, match="timeout_s"):
                await client.chat(model="m", messages=[], timeout_s=value)
            with pytest.raises(ValueError, match="timeout_s"):
                client.stream_completion(model="m", prompt="hi", timeout_s=value)
            assert not client._inbox

    asyncio.run(asynchronous())


def chunk_event(call_id: str) -> wire.RpcEvent:
    body = '{"choices": [{"index": 0, "text": "a"}]}'
    return wire.RpcEvent(call_id=call_id, kind="chunk", body=body, status=200, done=False)


def test_a_stream_read_after_its_client_closed_says_so(tmp_path):
    """The next chunk of a stream whose client was closed raised KeyError (its call's inbox
    was gone): it is the ConnectionError the client's other calls get when it closes."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)  # a gateway that answers one chunk, then nothing
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/gw.sock")
    try:
        client = TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=5)
        stream = client.stream_completion(model="m", prompt="hi")
        assert router.poll(5000, zmq.POLLOUT)
        thread = threading.Thread(target=answer_one_chunk, args=(router,))
        thread.start()
        assert next(stream)["choices"][0]["text"] == "a"
        thread.join(5)
        client.close()
        with pytest.raises(ConnectionError, match="closed"):
            next(stream)
    finally:
        router.close()
        context.term()


def answer_one_chunk(router) -> None:
    assert router.poll(5000)
    identity, *frames = router.recv_multipart()
    request = wire.decode(frames)
    router.send_multipart([identity, *wire.encode(chunk_event(request.call_id))])


def test_an_async_stream_read_after_its_client_closed_says_so(tmp_path):
    async def scenario() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{tmp_path}/gw.sock")
        try:
            client = AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=5)
            stream = client.stream_completion(model="m", prompt="hi")
            reading = asyncio.create_task(anext(stream))
            identity, *frames = await router.recv_multipart()
            call_id = wire.decode(frames).call_id
            await router.send_multipart([identity, *wire.encode(chunk_event(call_id))])
            assert (await asyncio.wait_for(reading, 5))["choices"][0]["text"] == "a"
            await client.close()
            with pytest.raises(ConnectionError, match="closed"):
                await anext(stream)
        finally:
            router.close()
            context.term()

    asyncio.run(scenario())


def test_an_async_call_cancelled_while_it_is_sent_leaves_no_inbox_and_is_called_off(
    tmp_path, monkeypatch
):
    """A caller cancelled while its call waited to be sent (the socket's queue full: a slow
    gateway under a batch's flood of lines) left the call's inbox behind for good, and, were it
    sent as the caller left, nothing called it off: the gateway ran it for nobody."""

    async def scenario() -> None:
        context = zmq.asyncio.Context()
        router = context.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.bind(f"ipc://{tmp_path}/gw.sock")
        sending = asyncio.Event()

        async def stuck_send(socket, message) -> None:
            sending.set()
            await asyncio.Event().wait()  # the socket's queue never frees

        try:
            client = AsyncTandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=5)
            with monkeypatch.context() as patched:
                patched.setattr(wire, "async_send", stuck_send)
                call = asyncio.create_task(client.completion(model="m", prompt="hi"))
                await asyncio.wait_for(sending.wait(), 5)
                call.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await call
            assert not client._inbox
            identity, *frames = await asyncio.wait_for(router.recv_multipart(), 5)
            assert wire.decode(frames) == wire.RpcCancel(call_id="0")
            await client.close()
        finally:
            router.close()
            context.term()

    asyncio.run(scenario())


def test_a_call_interrupted_as_it_is_sent_leaves_no_inbox_and_is_called_off(tmp_path, monkeypatch):
    """The sync client's twin: Ctrl-C as a call was sent."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind(f"ipc://{tmp_path}/gw.sock")
    send = wire.send

    def interrupted_send(socket, message) -> None:
        send(socket, message)
        raise KeyboardInterrupt

    try:
        with TandemClient(f"ipc://{tmp_path}/gw.sock", timeout_s=5) as client:
            with monkeypatch.context() as patched:
                patched.setattr(wire, "send", interrupted_send)
                with pytest.raises(KeyboardInterrupt):
                    client.completion(model="m", prompt="hi")
            assert not client._inbox
            assert router.poll(5000)
            assert isinstance(wire.decode(router.recv_multipart()[1:]), wire.RpcRequest)
            assert router.poll(5000)
            assert wire.decode(router.recv_multipart()[1:]) == wire.RpcCancel(call_id="0")
    finally:
        router.close()
        context.term()


@pytest.mark.parametrize("streamed", [False, True])
def test_a_calls_own_timeout_bounds_its_wait_for_a_connection(streamed):
    """With no gateway to connect to, a call given 0.2 s waited out its client's timeout (300 s
    by default) before it raised."""
    with TandemClient("ipc:///nowhere/gw.sock", timeout_s=3) as client:
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="0.2 s"):
            if streamed:
                next(client.stream_chat(model="m", messages=[], timeout_s=0.2))
            else:
                client.completion(model="m", prompt="hi", timeout_s=0.2)
        assert time.monotonic() - start < 1.5


@pytest.mark.parametrize("streamed", [False, True])
def test_an_async_calls_own_timeout_bounds_its_wait_for_a_connection(streamed):
    async def scenario() -> None:
        async with AsyncTandemClient("ipc:///nowhere/gw.sock", timeout_s=3) as client:
            with pytest.raises(TimeoutError, match="0.2 s"):
                if streamed:
                    await anext(client.stream_completion(model="m", prompt="hi", timeout_s=0.2))
                else:
                    await client.chat(model="m", messages=[], timeout_s=0.2)

    start = time.monotonic()
    asyncio.run(scenario())
    assert time.monotonic() - start < 1.5
