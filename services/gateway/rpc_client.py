"""A small Python client for the gateway's ZeroMQ RPC door (`rpc`): sync and asyncio.

    with TandemClient("tcp://127.0.0.1:8001") as client:
        response = client.chat(model="smollm2", messages=[{"role": "user", "content": "Hi"}])
        for chunk in client.stream_completion(model="smollm2", prompt="Once", max_tokens=8):
            print(chunk["choices"][0]["text"], end="")

The keyword arguments are the HTTP API's body (`model`, `prompt` or `messages`, `max_tokens`,
`temperature`, ...), and the results are its JSON as dicts: a response, or stream chunks. An
error answer raises `RpcError` with the HTTP status and OpenAI's error object. `timeout_s`
(keyword-only, not part of the body) bounds the wait for each answer: the connection to the
gateway, then the whole response of a non-streaming call, the next chunk of a stream; on timeout
the call is cancelled in the gateway and `TimeoutError` raised. It is seconds, > 0 and finite
(else `ValueError`, before anything is sent); the client's own `timeout_s` is the default. A
stream starts on its first iteration; leaving it early (`break`, `close()`, the end of a `with`
block) cancels its request in the cluster.

One socket (a DEALER) carries every call of a client, each under its own call id; events are
sorted into per-call inboxes, so streams may be read interleaved. A client is not thread-safe
(ZeroMQ sockets are not): use one per thread, or the asyncio client from many tasks. A sync
client's call while another thread (or greenlet) is in one of its calls raises `RuntimeError`
(their frames would interleave on the socket). A call on a closed client raises
`ConnectionError`.

When the connection to the gateway drops (it restarted, or the network did; or it answers no
heartbeat for `GATEWAY_SILENCE_S`, a host gone silent), the calls in flight raise
`ConnectionError` at once: their answers will not come (the gateway takes the
reconnection for a new client and cancels the old one's calls), so they no longer wait out
their timeout. Closing a client ends its calls that other tasks wait on the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import math
import numbers
import threading
import time
from collections import deque
from collections.abc import Iterator
from typing import Any, Literal

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from shared import wire
from shared.curve import ClientKeys
from shared.endpoints import connect

DEFAULT_TIMEOUT_S = 300.0
CLOSE_LINGER_MS = 1000  # how long a closing socket lets queued cancels reach the gateway
# The longest one ZeroMQ poll may wait (a C int of ms, 24.8 days): a longer wait is several.
MAX_POLL_MS = 2**31 - 1
# A connection whose gateway answers no ZMTP heartbeat for this long is closed, its calls in
# flight failed (a host gone without closing it: its calls waited out their whole timeout).
GATEWAY_SILENCE_S = 30.0

CallKind = Literal["completion", "chat", "tokenize", "detokenize"]
log = logging.getLogger(__name__)


def _seconds(timeout_s: float) -> float:
    """A timeout as given: > 0 and finite. A negative one waited for a connection for good (a
    negative poll is an endless one), a NaN one timed every call out at once, after sending it;
    `True` is no number of seconds (it was taken for 1), and an int past any float (10**400)
    raised OverflowError once a deadline was added to it."""
    is_number = isinstance(timeout_s, numbers.Real) and not isinstance(timeout_s, bool)
    try:
        seconds = float(timeout_s) if is_number else math.nan
    except OverflowError:
        seconds = math.inf
    if not 0 < seconds < math.inf:  # (NaN fails every comparison)
        raise ValueError(f"timeout_s must be > 0 and finite (seconds), got {timeout_s!r}")
    return seconds


def _poll_ms(deadline: float) -> float:
    """How long the next poll of a wait until `deadline` (`time.monotonic()`) may take: 0 when
    it is past, at most `MAX_POLL_MS` (a longer one raised OverflowError)."""
    return min(max(0.0, (deadline - time.monotonic()) * 1000), MAX_POLL_MS)


def _call_wait_s(timeout_s: float | None, client_timeout_s: float) -> float:
    """A call's timeout: its own, or its client's."""
    return client_timeout_s if timeout_s is None else _seconds(timeout_s)


class RpcError(Exception):
    """The gateway answered with an error: `status` as HTTP would answer, `body` OpenAI's error
    object ({"error": {"message", "type", "param", "code"}}), `retry_after_s` with 429/503."""

    def __init__(self, status: int, body: dict[str, Any], retry_after_s: float | None = None):
        self.status = status
        self.body = body
        self.retry_after_s = retry_after_s
        error = body.get("error") or {}
        self.message: str = error.get("message", "")
        self.param: str | None = error.get("param")
        super().__init__(f"{status}: {self.message}")


def _request(
    call_id: str,
    kind: CallKind,
    body: dict[str, Any],
    stream: bool,
    api_key: str | None,
    bulk: bool = False,
) -> wire.RpcRequest:
    text = _json_text(body)
    if len(text) > wire.MAX_JSON_LEN:  # the gateway would drop it as malformed, and we wait
        # Answered here as the HTTP API answers a body over its limit (nothing was sent).
        message = (
            f"the request body is {len(text):,} characters of JSON, more than one RPC call "
            f"carries ({wire.MAX_JSON_LEN:,}); nothing was sent"
        )
        error = {"message": message, "type": "invalid_request_error", "param": None, "code": None}
        raise RpcError(413, {"error": error})
    return wire.RpcRequest(
        call_id=call_id, kind=kind, body=text, stream=stream, api_key=api_key, bulk=bulk
    )


def _json_text(body: dict[str, Any]) -> str:
    """The body as JSON text, its characters as they are (as an HTTP client sends UTF-8): the
    gateway bounds it in UTF-8 bytes, as HTTP does, and escaped (6 characters each, 12 past the
    BMP) text of CJK or emoji was refused here at a half or a third of that. A body holding a
    lone surrogate, which the wire cannot carry, travels escaped: the gateway refuses it with
    HTTP's 400."""
    text = json.dumps(body, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(body)
    return text


def _payload(event: wire.RpcEvent) -> dict[str, Any] | None:
    """The event's JSON; None for a stream's end; RpcError for an error."""
    if event.kind == "error":
        raise RpcError(event.status, json.loads(event.body), event.retry_after_s)
    return None if event.kind == "end" else json.loads(event.body)


def _as_event(frames: list) -> wire.RpcEvent | None:
    try:
        message = wire.decode(frames)
    except wire.WireError as error:
        log.warning("dropped malformed message from the gateway: %s", error)
        return None
    if not isinstance(message, wire.RpcEvent) or message.kind == "waiting":
        return None  # (`waiting`: the gateway's probe that this client is still there)
    return message


class _Ended:
    """Put in a call's inbox in place of an event: the call's answer will not come."""

    def __init__(self, why: str):
        self.why = why


def _dropped(address: str) -> _Ended:
    return _Ended(
        f"the connection to {address} dropped with the call in flight (did the gateway "
        "restart?): its answer will not come"
    )


_CLOSED = _Ended("the client was closed while the call waited")
_CLIENT_CLOSED = "the client is closed: make a new one"
_SHARED = (
    "this TandemClient is in a call of another thread (or greenlet): a client is not "
    "thread-safe, use one per thread"
)


def _disconnected(frames: list) -> bool:
    """Whether a monitor event says a connection dropped."""
    return parse_monitor_message(frames)["event"] == zmq.EVENT_DISCONNECTED


def _unreachable(address: str, timeout_s: float) -> str:
    return (
        f"no connection to {address} within {timeout_s} s (is the gateway's RPC door there, "
        "and do the CurveZMQ keys match?)"
    )


def _dealer(context: zmq.Context, address: str, curve: ClientKeys | None = None) -> zmq.Socket:
    socket = context.socket(zmq.DEALER)
    if curve is not None:
        curve.apply(socket)
    socket.setsockopt(zmq.LINGER, CLOSE_LINGER_MS)  # an unclosed client never blocks the exit
    socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    socket.setsockopt(zmq.IMMEDIATE, 1)  # no queueing for a connection not made: say so instead
    # ZMTP heartbeats, a few in `GATEWAY_SILENCE_S`: the gateway's ZeroMQ I/O thread answers
    # them, not its event loop, so a busy gateway is not taken for gone.
    silence_ms = round(GATEWAY_SILENCE_S * 1000)
    socket.setsockopt(zmq.HEARTBEAT_IVL, max(1, silence_ms // 4))
    socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, silence_ms)
    connect(socket, address)
    return socket


# -- sync ---------------------------------------------------------------------------------------


class TandemClient:
    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        context: zmq.Context | None = None,
        api_key: str | None = None,
        curve: ClientKeys | None = None,
    ):
        """`context`: another ZeroMQ context, such as a `zmq.green` one under gevent;
        `api_key`: one of the gateway's keys, when it has some; `curve`: this client's
        CurveZMQ keys (`ClientKeys.from_dir`), when the cluster uses CurveZMQ."""
        self.address = address
        self.timeout_s = _seconds(timeout_s)
        self.api_key = api_key
        self._socket = _dealer(context or zmq.Context.instance(), address, curve)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._call_ids = (str(n) for n in itertools.count())
        # Events received for calls in flight and not yet read; a call leaves it when done.
        self._inbox: dict[str, deque[wire.RpcEvent | _Ended]] = {}
        self._in_use = threading.Lock()  # held by the call using the socket (`_using`)
        self._orphans: deque[str] = deque()  # calls left where the socket was in use: `_release`

    def completion(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return self._call("completion", body, timeout_s)

    def chat(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return self._call("chat", body, timeout_s)

    def tokenize(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        """`/tokenize`'s answer: the prompt tokens of a completion (`prompt`) or chat
        (`messages`) body, as that call would send them."""
        return self._call("tokenize", body, timeout_s)

    def detokenize(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return self._call("detokenize", body, timeout_s)

    def stream_completion(self, *, timeout_s: float | None = None, **body: Any) -> ChunkStream:
        return ChunkStream(self, "completion", body, _call_wait_s(timeout_s, self.timeout_s))

    def stream_chat(self, *, timeout_s: float | None = None, **body: Any) -> ChunkStream:
        return ChunkStream(self, "chat", body, _call_wait_s(timeout_s, self.timeout_s))

    def cancel(self, call_id: str) -> None:
        """Asks the gateway to cancel a call in flight; the call ends with RpcError 499."""
        with self._using():
            if call_id in self._inbox:
                wire.send_or_drop(self._socket, wire.RpcCancel(call_id=call_id))

    def close(self) -> None:
        if self._socket.closed:
            return
        with self._using():
            for call_id in list(self._inbox):
                self._abandon(call_id)
            self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._socket.close()

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @contextlib.contextmanager
    def _using(self) -> Iterator[None]:
        """The socket and the inboxes for this thread's call: another thread (or greenlet) in a
        call of this client is refused (ZeroMQ sockets are not thread-safe: two threads' calls
        interleaved their frames, and hung); so is a closed client."""
        if not self._in_use.acquire(blocking=False):
            raise RuntimeError(_SHARED)
        try:
            if self._socket.closed:  # (ZeroMQ said "Operation not supported")
                raise ConnectionError(_CLIENT_CLOSED)
            while self._orphans:
                self._abandon(self._orphans.popleft())
            yield
        finally:
            self._in_use.release()

    def _call(self, kind: CallKind, body: dict[str, Any], timeout_s: float | None) -> dict:
        wait_s = _call_wait_s(timeout_s, self.timeout_s)  # (refused before the call is sent)
        with self._using():
            call_id = self._start(kind, body, stream=False, timeout_s=wait_s)
            try:
                event = self._next_event(call_id, wait_s)
            except BaseException:  # a timeout or Ctrl-C: the gateway should stop working on it
                self._abandon(call_id)
                raise
            self._inbox.pop(call_id, None)
        result = _payload(event)
        assert result is not None, "a non-streaming call ends with a response or an error"
        return result

    def _start(self, kind: CallKind, body: dict[str, Any], stream: bool, timeout_s: float) -> str:
        # A DEALER with no connection (no gateway there, or a CurveZMQ handshake that failed)
        # holds a send forever: wait for one only as long as the call may take.
        deadline = time.monotonic() + timeout_s
        while not self._socket.poll(_poll_ms(deadline), zmq.POLLOUT):
            if time.monotonic() >= deadline:
                raise TimeoutError(_unreachable(self.address, timeout_s))
        self._read_connection_events()  # (a drop before this call is not its own)
        call_id = next(self._call_ids)
        request = _request(call_id, kind, body, stream, self.api_key)  # (may refuse: 413)
        self._inbox[call_id] = deque()
        try:
            wire.send(self._socket, request)
        except BaseException:  # Ctrl-C while the send waited (a full queue): perhaps sent as
            self._abandon(call_id)  # it was interrupted, so it is called off either way
            raise
        return call_id

    def _next_event(self, call_id: str, timeout_s: float) -> wire.RpcEvent:
        deadline = time.monotonic() + timeout_s
        inbox = self._inbox.get(call_id)
        if inbox is None:  # (only `close()` drops the inbox of a call still read)
            raise ConnectionError(_CLOSED.why)
        poller = self._socket._poller_class()  # (a green socket's: it yields to other greenlets)
        poller.register(self._socket, zmq.POLLIN)
        poller.register(self._monitor, zmq.POLLIN)
        while not inbox:
            wait_ms = _poll_ms(deadline)
            ready = dict(poller.poll(wait_ms)) if wait_ms > 0 else {}
            if not ready:
                if time.monotonic() < deadline:
                    continue  # (one slice of a wait longer than a poll takes)
                raise TimeoutError(f"no answer from {self.address} within {timeout_s} s")
            if self._monitor in ready:
                self._read_connection_events()
            else:
                self._receive()
        event = inbox.popleft()
        if isinstance(event, _Ended):
            self._inbox.pop(call_id, None)
            raise ConnectionError(event.why)
        if event.done:
            self._inbox.pop(call_id, None)
        return event

    def _receive(self) -> None:
        event = _as_event(self._socket.recv_multipart(copy=False))
        if event is not None and event.call_id in self._inbox:
            self._inbox[event.call_id].append(event)  # else: a call already left

    def _read_connection_events(self) -> None:
        """A dropped connection ends every call in flight (`_Ended` in each inbox). (Events
        unread when it dropped are gone with it: the socket is IMMEDIATE, its pipe ends with
        the connection.)"""
        while self._monitor.poll(0):
            if _disconnected(self._monitor.recv_multipart()):
                for inbox in self._inbox.values():
                    inbox.append(_dropped(self.address))

    def _abandon(self, call_id: str) -> None:
        """Cancels a call nobody waits for any more; its late events are dropped."""
        if self._inbox.pop(call_id, None) is not None and not self._socket.closed:
            wire.send_or_drop(self._socket, wire.RpcCancel(call_id=call_id))

    def _release(self, call_id: str) -> None:
        """`_abandon` from anywhere (a stream's finalizer, another thread): at once when the
        socket is free, else by the next call (the socket and the inboxes are its)."""
        if not self._in_use.acquire(blocking=False):
            self._orphans.append(call_id)
            return
        try:
            self._abandon(call_id)
        finally:
            self._in_use.release()


class ChunkStream:
    """The chunks of one streaming call. Started by the first `next()`; closing it before the
    end (or dropping it, or leaving its `with` block) cancels the call."""

    def __init__(self, client: TandemClient, kind: CallKind, body: dict, timeout_s: float):
        self._client, self._kind, self._body, self._timeout_s = client, kind, body, timeout_s
        self.call_id: str | None = None  # set once started
        self._finished = False

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return self

    def __next__(self) -> dict[str, Any]:
        if self._finished:
            raise StopIteration
        client = self._client
        with client._using():
            if self.call_id is None:
                self.call_id = client._start(self._kind, self._body, True, self._timeout_s)
            try:
                event = client._next_event(self.call_id, self._timeout_s)
            except BaseException:
                self._finished = True
                client._abandon(self.call_id)
                raise
        self._finished = event.done
        chunk = _payload(event)
        if chunk is None:
            raise StopIteration
        return chunk

    def close(self) -> None:
        if self.call_id is not None and not self._finished:
            self._client._release(self.call_id)
        self._finished = True

    def __enter__(self) -> ChunkStream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()


# -- asyncio ------------------------------------------------------------------------------------


class AsyncTandemClient:
    """The asyncio twin of `TandemClient`: the same methods, awaited; streams are `async for`.
    Calls may run concurrently from many tasks; a reader task sorts events into their inboxes."""

    def __init__(
        self,
        address: str,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        api_key: str | None = None,
        curve: ClientKeys | None = None,
        bulk: bool = False,
    ):
        """`bulk`: every call is a batch line, served from capacity interactive calls leave."""
        self.address = address
        self.timeout_s = _seconds(timeout_s)
        self.api_key = api_key
        self.bulk = bulk
        self._socket = _dealer(zmq.asyncio.Context.instance(), address, curve)
        self._monitor = self._socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._call_ids = (str(n) for n in itertools.count())
        self._inbox: dict[str, asyncio.Queue[wire.RpcEvent | _Ended]] = {}
        # Started with the first call, on its loop (and again on a later loop: `_run_readers`).
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None  # of the connection: started with the reader
        self._pending: set[asyncio.Task] = set()  # cancels sent from finalizers

    async def completion(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return await self._call("completion", body, timeout_s)

    async def chat(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return await self._call("chat", body, timeout_s)

    async def tokenize(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return await self._call("tokenize", body, timeout_s)

    async def detokenize(self, *, timeout_s: float | None = None, **body: Any) -> dict[str, Any]:
        return await self._call("detokenize", body, timeout_s)

    def stream_completion(self, *, timeout_s: float | None = None, **body: Any) -> AsyncChunkStream:
        return AsyncChunkStream(self, "completion", body, _call_wait_s(timeout_s, self.timeout_s))

    def stream_chat(self, *, timeout_s: float | None = None, **body: Any) -> AsyncChunkStream:
        return AsyncChunkStream(self, "chat", body, _call_wait_s(timeout_s, self.timeout_s))

    async def cancel(self, call_id: str) -> None:
        """Asks the gateway to cancel a call in flight; the call ends with RpcError 499."""
        if call_id in self._inbox:
            wire.send_or_drop(self._socket, wire.RpcCancel(call_id=call_id))

    async def close(self) -> None:
        if self._socket.closed:
            return
        for call_id, inbox in list(self._inbox.items()):
            inbox.put_nowait(_CLOSED)  # (another task may wait on it)
            await self._abandon(call_id)
        # (An earlier loop's tasks ended with it, and cannot be awaited from this one.)
        loop = asyncio.get_running_loop()
        pending = [task for task in self._pending if task.get_loop() is loop]
        await asyncio.gather(*pending, return_exceptions=True)
        for task in (self._reader, self._watcher):
            if task is not None and task.get_loop() is loop:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        self._socket.disable_monitor()
        self._monitor.close(linger=0)
        self._socket.close()

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def call(
        self, kind: CallKind, body: dict[str, Any], timeout_s: float | None = None
    ) -> dict[str, Any]:
        """One non-streaming call with `body` as it is (the keyword methods take the body as
        keywords, so a field named like their own arguments could not be sent)."""
        return await self._call(kind, body, timeout_s)

    async def _call(self, kind: CallKind, body: dict[str, Any], timeout_s: float | None) -> dict:
        wait_s = _call_wait_s(timeout_s, self.timeout_s)  # (refused before the call is sent)
        call_id = await self._start(kind, body, stream=False, timeout_s=wait_s)
        try:
            event = await self._next_event(call_id, wait_s)
        except BaseException:  # a timeout, or the caller's task was cancelled
            self._abandon_soon(call_id)
            raise
        result = _payload(event)
        assert result is not None, "a non-streaming call ends with a response or an error"
        return result

    async def _start(
        self, kind: CallKind, body: dict[str, Any], stream: bool, timeout_s: float
    ) -> str:
        if self._socket.closed:  # (ZeroMQ said "Operation not supported", its readers died)
            raise ConnectionError(_CLIENT_CLOSED)
        self._run_readers()
        deadline = asyncio.get_running_loop().time() + timeout_s
        if not await self._socket.poll(timeout_s * 1000, zmq.POLLOUT):  # (as long as it may take)
            raise TimeoutError(_unreachable(self.address, timeout_s))
        call_id = next(self._call_ids)
        request = _request(call_id, kind, body, stream, self.api_key, self.bulk)  # (may be 413)
        self._inbox[call_id] = asyncio.Queue()
        try:
            await self._send_by(deadline, request)
        except BaseException:  # the caller left while the send waited (a full queue): perhaps
            await self._abandon(call_id)  # sent as it left, so it is called off either way
            raise
        return call_id

    async def _send_by(self, deadline: float, request: wire.RpcRequest) -> None:
        """Sends `request`, waiting for room in the pipe until `deadline` (the loop's clock) at
        most. The pipe had room when the call polled, but other tasks' calls may fill it first:
        to a gateway that reads none (stopped, its loop stuck) the send waited for good, past
        the call's timeout."""
        waiting = asyncio.timeout_at(deadline)
        try:
            async with waiting:
                await wire.async_send(self._socket, request)
        except TimeoutError:
            if not waiting.expired():
                raise
            raise TimeoutError(
                f"{self.address} took no call by the timeout (the pipe to it is full: is its "
                "RPC door reading?); nothing was sent"
            ) from None

    def _run_readers(self) -> None:
        """Starts the reader and the connection's watcher on the running loop, unless they run
        there already. A client used by one `asyncio.run` after another (a script's steps, a
        test per loop) had them on the first loop, ended with it: every later call waited out
        its timeout with its answer unread."""
        loop = asyncio.get_running_loop()
        reader = self._reader
        if reader is not None and reader.get_loop() is loop and not reader.done():
            return
        if self._watcher is not None and self._watcher.get_loop() is loop:
            self._watcher.cancel()  # (its reader failed: a second would share its events)
        self._reader = loop.create_task(self._read())
        self._watcher = loop.create_task(self._watch_connection())

    async def _next_event(self, call_id: str, timeout_s: float) -> wire.RpcEvent:
        inbox = self._inbox.get(call_id)
        if inbox is None:  # (only `close()` drops the inbox of a call still read)
            raise ConnectionError(_CLOSED.why)
        try:  # (asyncio.timeout: on Python 3.11 wait_for lost a cancel that met an event)
            async with asyncio.timeout(timeout_s):
                event = await inbox.get()
        except TimeoutError:
            raise TimeoutError(f"no answer from {self.address} within {timeout_s} s") from None
        if isinstance(event, _Ended):
            self._inbox.pop(call_id, None)
            raise ConnectionError(event.why)
        if event.done:
            self._inbox.pop(call_id, None)
        return event

    async def _read(self) -> None:
        while True:
            event = _as_event(await self._socket.recv_multipart(copy=False))
            if event is not None and event.call_id in self._inbox:
                self._inbox[event.call_id].put_nowait(event)  # else: a call already left

    async def _watch_connection(self) -> None:
        """A dropped connection ends every call in flight (`_Ended` in each inbox)."""
        while True:
            if _disconnected(await self._monitor.recv_multipart()):
                for inbox in self._inbox.values():
                    inbox.put_nowait(_dropped(self.address))

    async def _abandon(self, call_id: str) -> None:
        """Cancels a call nobody waits for any more; its late events are dropped."""
        if self._inbox.pop(call_id, None) is not None and not self._socket.closed:
            wire.send_or_drop(self._socket, wire.RpcCancel(call_id=call_id))

    def _abandon_soon(self, call_id: str) -> None:
        """`_abandon` from where nothing may be awaited: a cancelled task, a finalizer."""
        try:
            task = asyncio.get_running_loop().create_task(self._abandon(call_id))
        except RuntimeError:  # no loop any more: close() (or the process's end) covers it
            self._inbox.pop(call_id, None)
            return
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)


class AsyncChunkStream:
    """The chunks of one streaming call, for `async for`. Started by the first iteration;
    `aclose()` (or leaving its `async with` block, or dropping it) before the end cancels it."""

    def __init__(self, client: AsyncTandemClient, kind: CallKind, body: dict, timeout_s: float):
        self._client, self._kind, self._body, self._timeout_s = client, kind, body, timeout_s
        self.call_id: str | None = None  # set once started
        self._finished = False

    def __aiter__(self) -> AsyncChunkStream:
        return self

    async def __anext__(self) -> dict[str, Any]:
        if self._finished:
            raise StopAsyncIteration
        if self.call_id is None:
            self.call_id = await self._client._start(self._kind, self._body, True, self._timeout_s)
        try:
            event = await self._client._next_event(self.call_id, self._timeout_s)
        except BaseException:
            self._close_soon()
            raise
        self._finished = event.done
        chunk = _payload(event)
        if chunk is None:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        if self.call_id is not None and not self._finished:
            await self._client._abandon(self.call_id)
        self._finished = True

    def _close_soon(self) -> None:
        if self.call_id is not None and not self._finished:
            self._client._abandon_soon(self.call_id)
        self._finished = True

    async def __aenter__(self) -> AsyncChunkStream:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.aclose()

    def __del__(self) -> None:
        self._close_soon()
