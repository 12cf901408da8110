"""The gateway's ZeroMQ RPC front door, for agent orchestrators and other internal callers.

A ROUTER socket takes `RpcRequest`s from DEALER clients (`rpc_client`). A request carries the
HTTP API's JSON body as text, so it goes through the same parser, the same `Generator` and the
same response builders as `/v1/completions` and `/v1/chat/completions` (or `/tokenize` and
`/detokenize`): the fields, defaults, validation errors and response shapes are the HTTP API's.
Each call runs in its own task, keyed by (client identity, call id), and answers with
`RpcEvent`s: a streaming call with one `chunk` per piece of text (OpenAI's chunk shape) and then
`end`; a non-streaming call with one `response`; any call may instead end with an `error`
carrying the HTTP status and OpenAI's error object.

Cancelling a call's task closes its generation iterator, which cancels its requests in the
cluster (queue entry, prefill job, KV blocks). That happens on `RpcCancel`, on a second call
under the id of one in flight (the id's call then ends with one 409: both calls' events would
carry that id, and their client could not tell them apart), and when a client has vanished:
the socket is ROUTER_MANDATORY, so an event to a peer that disconnected fails at once and every
call of that peer is cancelled. ZeroMQ does not tell a ROUTER when a peer leaves, so
a client whose calls wait with nothing sent to it for `PROBE_S` (queued, prefilling, or a whole
answer being generated) is sent a `waiting` event, which fails so once it has gone; and ZMTP
heartbeats close a connection whose peer answers none for `client_timeout_s` (a host gone
without closing its connections, a client process stopped). A client that reads its events
slower than they come has them wait for it, in order, and is taken for gone (its calls
cancelled) only once it has taken none for `client_timeout_s`. Malformed frames are logged and
dropped, but for a call whose id can still be read, which is answered 400 with the wire's reason
(its client would wait out its timeout); the loop never dies of a client's mistake.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import functools
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import zmq
import zmq.asyncio

from services.gateway.auth import ApiKeys, tenant_of
from services.gateway.generation import ChoiceEvent, Generation, Generator
from services.gateway.json_body import load_json_body
from services.gateway.openai_protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
    unforeseen,
)
from services.gateway.responses import StreamChunks, collect_response, final_usage_chunk
from services.gateway.tokenize_api import detokenize, tokenize_async
from shared import wire
from shared.binding import bind
from shared.curve import RPC_DOOR, CurveKeys, Security
from shared.logs import get_logger

MAX_CALLS_PER_CLIENT = 256  # calls in flight per client connection; more are answered 429
PROBE_S = 2.0  # a client with calls in flight and no event sent for this long is probed
MAX_REPLIES_IN_LINE = 16 * MAX_CALLS_PER_CLIENT  # a client's refusals waiting to be sent; more
# are dropped (a client flooding calls whose answers it never reads)
SLOW_READER_RETRY_S = 0.01  # an event for a client whose pipe is full is tried again after
# Events queued in ZeroMQ per client (SNDHWM; ZeroMQ's default, 1,000, counts messages, and an
# event may be MiBs: a client reading none had GiBs held for it). Room for a chunk of each of
# its streams at once (a decode step's), so that a client reading as they come waits in no line.
MAX_EVENTS_IN_PIPE = MAX_CALLS_PER_CLIENT
MAX_HEARTBEAT_TIMEOUT_MS = 2**31 - 1  # ZeroMQ's most (a C int)

# Per call kind: the HTTP endpoint's parser and its response id prefix.
_ENDPOINTS = {
    "completion": (parse_completion_request, "cmpl"),
    "chat": (parse_chat_request, "chatcmpl"),
}
# The tokenizer's kinds: one response, computed in the gateway (`tokenize_api`).
_TOKENIZER_CALLS = frozenset({"tokenize", "detokenize"})

CallKey = tuple[bytes, str]  # (client identity, call id)


class _ClientGone(Exception):
    """An event could not be routed: the client disconnected."""


class _SendLine:
    """A client's events waiting to be sent, one at a time, in order (`RpcServer._route`)."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.num_senders = 0  # holding the lock or waiting for it; the line goes at 0


class RpcServer:
    def __init__(
        self,
        generator: Generator,
        address: str,
        max_body_bytes: int = 8 << 20,
        keys: ApiKeys | None = None,
        curve: CurveKeys | None = None,
        client_timeout_s: float = 30.0,
    ):
        """`client_timeout_s`: a client connection that answers no ZMTP heartbeat for this long
        is closed (its calls are then cancelled)."""
        self.keys = keys or ApiKeys({})
        self.curve = curve
        self.generator = generator
        self.address = address
        self.max_body_bytes = max_body_bytes
        self.client_timeout_s = client_timeout_s
        self.log = get_logger(component="rpc", address=address)
        self._calls: dict[CallKey, asyncio.Task] = {}
        # Calls in flight per client, kept with `_calls`: the bound's check counted them by a
        # pass over every client's calls in flight, at each new call (quadratic in a flood).
        self._num_calls: dict[bytes, int] = {}
        self._replies: set[asyncio.Task] = set()  # refusals and cancel answers being sent
        self._num_replies: dict[bytes, int] = {}  # of them, per client
        self._last_sent: dict[bytes, float] = {}  # per client with calls: its last event's time
        self._send_lines: dict[bytes, _SendLine] = {}  # per client with events to send
        self._stalled: set[bytes] = set()  # clients dropped for reading nothing (`_route`)
        self._superseded: set[CallKey] = set()  # calls cancelled by a second one under their id
        self._loop_task: asyncio.Task | None = None
        self._probe_task: asyncio.Task | None = None
        self._closing = False

    async def start(self) -> None:
        self.context = zmq.asyncio.Context()
        self.security = Security(self.curve, self.log)
        self.security.start(self.context)
        self.socket = self.security.server(self.context.socket(zmq.ROUTER), RPC_DOOR)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # unroutable -> EHOSTUNREACH, not silence
        self.socket.setsockopt(zmq.SNDHWM, MAX_EVENTS_IN_PIPE)  # (a pipe takes it when made)
        timeout_ms = _heartbeat_timeout_ms(self.client_timeout_s)  # pings a few times in one
        self.socket.setsockopt(zmq.HEARTBEAT_IVL, min(5_000, max(1, timeout_ms // 4)))
        self.socket.setsockopt(zmq.HEARTBEAT_TIMEOUT, timeout_ms)
        bind(self.socket, self.address, "rpc_address")
        self._loop_task = asyncio.create_task(self._serve())
        self._probe_task = asyncio.create_task(self._probe_waiting_clients())
        self.log.info("rpc listening")

    async def close(self) -> None:
        self._closing = True
        tasks = [self._loop_task, self._probe_task, *self._calls.values(), *self._replies]
        tasks = [task for task in tasks if task is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.socket.close(linger=0)
        self.security.stop()  # its authenticator's socket, or the term below waits for ever
        self.context.term()

    # -- the socket loop ------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            frames = await self.socket.recv_multipart(copy=False)
            identity = frames[0].bytes
            try:
                message = wire.decode(frames[1:])
            except wire.WireError as error:
                self.log.warning("dropped malformed message", error=str(error), peer=identity.hex())
                self._refuse_malformed_call(identity, frames[1:], error)
                continue
            match message:
                case wire.RpcRequest():
                    self._start_call(identity, message)
                case wire.RpcCancel():
                    task = self._calls.get((identity, message.call_id))
                    if task is not None:
                        task.cancel()
                case _:
                    self.log.warning("dropped unexpected message", type=type(message).__name__)

    def _refuse_malformed_call(self, identity: bytes, frames: list, error: wire.WireError) -> None:
        """A call the wire refused (a field of the wrong type, an unknown kind) is answered with
        a 400 saying why, when its call id can be read: its client would wait out its timeout."""
        call_id = _readable_call_id(frames)
        if call_id is not None:
            self._reply(identity, call_id, ApiError(400, f"a malformed call: {error}"))

    async def _probe_waiting_clients(self) -> None:
        """Every `PROBE_S`, a `waiting` event to each client with calls in flight that has been
        sent nothing for as long: to a client gone it fails, and its calls are cancelled."""
        while True:
            await asyncio.sleep(PROBE_S)
            waiting: dict[bytes, str] = {}  # client -> one of its calls
            for identity, call_id in self._calls:
                waiting.setdefault(identity, call_id)
            for identity in self._last_sent.keys() - waiting.keys():
                del self._last_sent[identity]  # (no calls left: nothing to probe for)
            self._stalled &= waiting.keys() | self._send_lines.keys()  # (gone for good)
            probed_before = time.monotonic() - PROBE_S
            for identity, call_id in waiting.items():
                if self._last_sent.get(identity, -math.inf) > probed_before:
                    continue  # it was just sent something
                probe = wire.RpcEvent(call_id=call_id, kind="waiting", body="", status=200,
                                      done=False)  # fmt: skip
                with contextlib.suppress(_ClientGone):  # (its calls are cancelled)
                    await self._route(identity, probe, patient=False)  # full: it is there

    def _start_call(self, identity: bytes, request: wire.RpcRequest) -> None:
        key = (identity, request.call_id)
        refusal = None
        if key in self._calls:
            if self._supersede(key):
                return
            refusal = _in_flight_error()
        elif self._num_calls.get(identity, 0) >= MAX_CALLS_PER_CLIENT:
            refusal = ApiError(429, f"more than {MAX_CALLS_PER_CLIENT} calls in flight",
                               "rate_limit_error")  # fmt: skip
            refusal.retry_after_s = 1.0
        if refusal is not None:
            # Not registered: the call already in flight (if any) keeps its key.
            self._reply(identity, request.call_id, refusal)
            return
        self._stalled.discard(identity)  # (it reads again, or will: it is there)
        task = asyncio.create_task(self._run_call(identity, request))
        self._calls[key] = task
        self._num_calls[identity] = self._num_calls.get(identity, 0) + 1
        task.add_done_callback(functools.partial(self._call_done, key))

    def _supersede(self, key: CallKey) -> bool:
        """Cancels the call in flight under `key`, for a second call under its id; False when
        it has ended already (its last event sent), and the second call is refused alone.

        The events of both calls would carry the one id, so their client could not tell them
        apart: the first call's events would end with the second's refusal, and the cluster go
        on generating for a call its client no longer awaits. So the id's call ends, and with
        one event: the 409 `_call_done` answers in place of the 499 of a cancel. Calls under
        the id until then are answered by that one event too."""
        task = self._calls[key]
        if task.done():
            return False
        self._superseded.add(key)
        task.cancel()
        return True

    def _call_done(self, key: CallKey, task: asyncio.Task) -> None:
        if self._calls.pop(key, None) is not None:
            identity = key[0]
            self._num_calls[identity] -= 1
            if not self._num_calls[identity]:
                del self._num_calls[identity]
        superseded = key in self._superseded
        self._superseded.discard(key)
        if task.cancelled() and not self._closing:
            # RpcCancel, a vanished client or a second call under its id (the task may never
            # have started, so the answer is sent from here). It lets a caller still waiting on
            # the call (another task of an async client) return; a vanished client misses it.
            self._reply(*key, _superseded_error() if superseded else _cancelled_error())

    def _reply(self, identity: bytes, call_id: str, error: ApiError) -> None:
        num_replies = self._num_replies.get(identity, 0)
        if num_replies >= MAX_REPLIES_IN_LINE:
            # A client that floods calls and reads nothing: its refusals would wait in line (a
            # task each) for up to its timeout, without bound.
            self.log.warning("rpc refusal dropped: the client reads nothing", peer=identity.hex())
            return
        self._num_replies[identity] = num_replies + 1
        task = asyncio.create_task(self._send_error(identity, call_id, error))
        self._replies.add(task)  # the loop holds tasks weakly
        task.add_done_callback(self._replies.discard)
        task.add_done_callback(lambda _: self._reply_done(identity))
        task.add_done_callback(_log_failure)

    def _reply_done(self, identity: bytes) -> None:
        num_replies = self._num_replies.pop(identity) - 1
        if num_replies:
            self._num_replies[identity] = num_replies

    # -- one call -------------------------------------------------------------------------------

    async def _run_call(self, identity: bytes, request: wire.RpcRequest) -> None:
        call_id = request.call_id
        try:
            caller = self.keys.check(request.api_key)
            if request.kind in _TOKENIZER_CALLS:
                answer = await self._tokenizer_answer(request)
                await self._send_text(identity, call_id, "response", answer)
                return
            generation = await self._prepare(request)
            tenant = tenant_of(caller, generation.request.user)
            events = self.generator.events(generation, tenant, bulk=request.bulk)
            try:
                if request.stream:
                    await self._stream(identity, call_id, generation, events)
                else:
                    response = await collect_response(generation, events)
                    await self._send(identity, call_id, "response", response)
            finally:
                await events.aclose()  # cancels the cluster requests still running
        except ApiError as error:
            await self._send_error(identity, call_id, error)
        except _ClientGone:
            self.log.info("rpc client gone, call cancelled", call_id=call_id, peer=identity.hex())
        except Exception as error:  # a bug here must not take the loop or other calls down
            self.log.exception("rpc call failed", call_id=call_id)
            await self._send_error(identity, call_id, unforeseen(error))

    async def _tokenizer_answer(self, request: wire.RpcRequest) -> str:
        """The call's answer as JSON text: a long prompt's tokens (millions, with their strings)
        are counted and written off the event loop."""
        if request.stream:
            raise ApiError(400, f"a {request.kind} call is not streamed", param="stream")
        if request.kind == "detokenize":
            return _json(detokenize(self.generator, self._body(request)))
        return await tokenize_async(self.generator, self._body(request), _json)

    def _body(self, request: wire.RpcRequest) -> Any:
        if len(request.body.encode()) > self.max_body_bytes:
            raise ApiError(413, f"the request body exceeds {self.max_body_bytes} bytes")
        return load_json_body(request.body)

    async def _prepare(self, request: wire.RpcRequest) -> Generation:
        """The call's request tokenized (a long prompt off the event loop: cancelling the call
        while it waits for a thread drops its tokenization unstarted)."""
        body = self._body(request)
        if isinstance(body, dict):
            body.setdefault("stream", request.stream)
        parse, id_prefix = _ENDPOINTS[request.kind]
        parsed = parse(body, self.generator.model_name, self.generator.max_model_len)
        if parsed.stream != request.stream:
            raise ApiError(400, "`stream` disagrees with the RPC request's stream flag",
                           param="stream")  # fmt: skip
        return await self.generator.prepare_async(parsed, id_prefix)

    async def _stream(
        self,
        identity: bytes,
        call_id: str,
        generation: Generation,
        events: AsyncIterator[ChoiceEvent],
    ) -> None:
        req = generation.request
        chunks = StreamChunks(generation)
        num_tokens = 0
        async for event in events:
            num_tokens += len(event.token_ids)
            for chunk in chunks.chunks(event):
                await self._send(identity, call_id, "chunk", chunk)
        if req.include_usage:
            chunk = final_usage_chunk(generation, num_tokens)
            await self._send(identity, call_id, "chunk", chunk)
        await self._send(identity, call_id, "end", None)

    # -- events ---------------------------------------------------------------------------------

    async def _send(self, identity: bytes, call_id: str, kind: str, body: Any) -> None:
        await self._send_text(identity, call_id, kind, "" if body is None else _json(body))

    async def _send_text(self, identity: bytes, call_id: str, kind: str, text: str) -> None:
        """`_send` of a body already written as JSON `text`."""
        if len(text) > wire.MAX_JSON_LEN:  # the client would drop it as malformed, and wait
            raise ApiError(
                400,
                f"the answer is {len(text):,} characters of JSON, more than one RPC event "
                f"carries ({wire.MAX_JSON_LEN:,}): ask for less (fewer tokens, logprobs or "
                "choices), or use the HTTP API, which has no such limit",
            )
        event = wire.RpcEvent(call_id=call_id, kind=kind, body=text, status=200,
                              done=kind != "chunk")  # fmt: skip
        await self._route(identity, event)

    async def _send_error(self, identity: bytes, call_id: str, error: ApiError) -> None:
        event = wire.RpcEvent(
            call_id=call_id,
            kind="error",
            body=_json(error.body()),
            status=error.status,
            retry_after_s=getattr(error, "retry_after_s", None),
            done=True,
        )
        with contextlib.suppress(_ClientGone):  # nobody left to tell
            await self._route(identity, event)

    async def _route(self, identity: bytes, event: wire.RpcEvent, patient: bool = True) -> bool:
        """Sends `event`; False when the client's pipe is full and `patient` is not set.

        A full pipe (`SNDHWM` events queued, and the socket buffers behind them) is a client
        that reads slower than its calls answer. Its events wait in line, in the order they
        came, one of them retrying (`DONTWAIT`: pyzmq would queue a blocked send, fail it with
        `zmq.Again` at the next chance, and hold every other client's sends behind it). A
        client that takes nothing for `client_timeout_s` is taken for gone."""
        line = self._send_lines.get(identity)
        if line is None:
            line = self._send_lines[identity] = _SendLine()
        if not patient and line.lock.locked():
            return False
        line.num_senders += 1
        try:
            async with line.lock:
                if identity in self._stalled:  # (dropped while this event waited in line)
                    raise _ClientGone
                sent = await self._send_or_wait(identity, event, patient)
        finally:
            line.num_senders -= 1
            if line.num_senders == 0 and self._send_lines.get(identity) is line:
                del self._send_lines[identity]
        if sent:
            self._last_sent[identity] = time.monotonic()
        return sent

    async def _send_or_wait(self, identity: bytes, event: wire.RpcEvent, patient: bool) -> bool:
        stalled_since = None
        while True:
            try:
                await wire.async_send_to(self.socket, identity, event, flags=zmq.DONTWAIT)
                return True
            except zmq.Again:
                if not patient:
                    return False
                now = time.monotonic()
                stalled_since = stalled_since or now
                if now - stalled_since >= self.client_timeout_s:
                    self.log.warning(
                        "rpc client read nothing for its timeout; calls cancelled",
                        peer=identity.hex(),
                        timeout_s=self.client_timeout_s,
                    )
                    self._stalled.add(identity)  # (until it sends a call again)
                    self._drop_client(identity)
                    raise _ClientGone from None
                await asyncio.sleep(SLOW_READER_RETRY_S)
            except zmq.ZMQError as error:
                if error.errno != errno.EHOSTUNREACH:
                    raise
                self._drop_client(identity)
                raise _ClientGone from None

    def _drop_client(self, identity: bytes) -> None:
        """Cancels the other calls of a client that disconnected; the caller's own call ends by
        the `_ClientGone` it raises next."""
        for (peer, _), task in list(self._calls.items()):
            if peer == identity and task is not asyncio.current_task():
                task.cancel()


def _heartbeat_timeout_ms(client_timeout_s: float) -> int:
    """`client_timeout_s` as ZeroMQ's heartbeat timeout: a C int of ms, so at most 24.8 days (a
    longer one raised OverflowError at start-up), and at least 1 ms."""
    return max(1, min(MAX_HEARTBEAT_TIMEOUT_MS, round(client_timeout_s * 1000)))


def _in_flight_error() -> ApiError:
    return ApiError(409, "a call with this call_id is in flight", param="call_id")


def _superseded_error() -> ApiError:
    return ApiError(
        409, "a second call reused this call_id while it was in flight: both ended", param="call_id"
    )


def _cancelled_error() -> ApiError:
    return ApiError(499, "the call was cancelled")


def _readable_call_id(frames: list) -> str | None:
    """The call id in the header of an RPC_REQUEST the wire refused, if it holds a sound one.
    Strings are unpacked as bytes: a field that is no UTF-8 (a body, say) is a reason to refuse
    the call, and must not hide the call id the refusal is sent to."""
    try:
        if len(frames) < 2 or wire.peek_type(frames) != wire.MessageType.RPC_REQUEST:
            return None
        header = msgpack.unpackb(frames[1].buffer, raw=True)
        call_id = header.get(b"call_id") if isinstance(header, dict) else None
        call_id = call_id.decode() if isinstance(call_id, bytes) else None
    except Exception:  # not even a header (whatever bytes came, the loop must not die of them)
        return None
    sound = call_id is not None and len(call_id) <= wire.MAX_REQUEST_ID_LEN
    return call_id if sound else None


def _json(body: dict[str, Any]) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


def _log_failure(task: asyncio.Task) -> None:
    if not task.cancelled() and task.exception() is not None:
        get_logger(component="rpc").error("rpc send failed", error=repr(task.exception()))
