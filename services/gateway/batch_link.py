"""The gateway's link to the batch service: a DEALER that relays Files and Batches calls.

Calls may run concurrently; a reader task matches each `BatchReply` to its call by `call_id`.
A batch service that does not answer within `timeout_s` (down, restarting) is answered 503 with
a Retry-After, so clients retry instead of hanging; a late reply is then dropped. A call is
sent only over a live connection (IMMEDIATE), never queued for a service that is down: queued,
it ran once the service came back, after its client had been told 503 and had retried (two
batches for one).

A call the service took is answered 503 at once when the connection it went over drops (the
service killed or stopped mid-call): its answer can never come, and the call waited out the
whole timeout while the service, restarted, was back within a second.

A reply no sound service sends (a status that is neither 200 nor an HTTP error, a body that is
not a JSON object, a header the wire refuses but whose call id can be read) answers its call 502
at once: until 2026-12-06 it raised in the call (the gateway's 500, or an ApiError with a status
no HTTP answer can carry) or, refused by the wire, left its call to wait out the timeout (a 503
that told the client to retry).
"""

from __future__ import annotations

import asyncio
import itertools
import json
from typing import Any

import msgpack
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from services.gateway.openai_protocol import ERROR_TYPES, ApiError
from shared import wire_batch
from shared.curve import CurveKeys, Security
from shared.endpoints import connect
from shared.logs import get_logger
from shared.wire import WireError

Reply = tuple[int, dict[str, Any], bytes | None]
# How soon a client may retry a call the service's going cut off: a restart takes about a second.
GONE_RETRY_AFTER_S = 1.0


class BatchLink:
    def __init__(self, address: str, timeout_s: float = 30.0, curve: CurveKeys | None = None):
        self.address = address
        self.timeout_s = timeout_s
        self.log = get_logger(component="batch_link")
        self.security = Security(curve, self.log)  # the cluster's keys, under CurveZMQ
        self._socket: zmq.asyncio.Socket | None = None
        self._call_ids = (str(n) for n in itertools.count())
        self._waiting: dict[str, asyncio.Future] = {}
        # The calls sent and not yet answered: those a dropped connection cuts off. (A call
        # still waiting for a connection to send over is not one: it goes to the next service.)
        self._sent: set[str] = set()
        self._reader: asyncio.Task | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._watcher: asyncio.Task | None = None

    async def start(self) -> None:
        socket = self.security.client(zmq.asyncio.Context.instance().socket(zmq.DEALER))
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.IMMEDIATE, 1)  # nothing queued for a service not connected
        socket.setsockopt(zmq.MAXMSGSIZE, wire_batch.MAX_FRAME_BYTES)
        self._monitor = socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        connect(socket, self.address)
        self._socket = socket
        self._reader = asyncio.create_task(self._read())
        self._watcher = asyncio.create_task(self._watch_connection())

    async def close(self) -> None:
        for task in (self._reader, self._watcher):
            if task is not None:
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
        if self._socket is not None:
            self._socket.disable_monitor()
            self._socket.close()
        if self._monitor is not None:
            self._monitor.close(linger=0)

    async def call(
        self,
        op: str,
        tenant: str,
        params: dict[str, Any],
        data: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Reply:
        """The service's answer; ApiError with its status and body when it is not a 200 (a 503
        when none came within `timeout_s`, by default the link's)."""
        assert self._socket is not None, "start() first"
        call_id = next(self._call_ids)
        future = self._waiting[call_id] = asyncio.get_running_loop().create_future()
        message = wire_batch.BatchCall(
            call_id=call_id, op=op, tenant=tenant, params=json.dumps(params)
        )
        try:
            # The send too: it waits for a link.
            async with asyncio.timeout(self.timeout_s if timeout_s is None else timeout_s):
                await wire_batch.async_send(self._socket, message, data)
                self._sent.add(call_id)
                reply, chunk = await future
        except TimeoutError:
            error = ApiError(503, "the batch service did not answer", "server_error")
            error.retry_after_s = 5.0
            raise error from None
        finally:
            self._waiting.pop(call_id, None)
            self._sent.discard(call_id)
        body = _body_of(reply)
        if reply.status != 200:
            raise _api_error(reply.status, body)
        return reply.status, body, chunk

    async def metrics(self, timeout_s: float) -> str | None:
        """The service's Prometheus exposition, for the gateway's /metrics; None when it did
        not answer with one within `timeout_s` (down, or older than the `metrics` op)."""
        try:
            _, _, text = await self.call("metrics", "", {}, timeout_s=timeout_s)
            return text.decode() if text is not None else None
        except (ApiError, UnicodeDecodeError) as error:
            self.log.warning("batch service metrics not scraped", error=str(error))
            return None

    async def _read(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:
                reply, chunk = wire_batch.decode(frames)
                if not isinstance(reply, wire_batch.BatchReply):
                    raise WireError(f"expected a BatchReply, got {type(reply).__name__}")
            except WireError as error:
                self.log.warning("dropped malformed batch reply", error=str(error))
                self._answer(_readable_call_id(frames), exception=_nonsense(str(error)[:200]))
                continue
            self._answer(reply.call_id, result=(reply, chunk))

    async def _watch_connection(self) -> None:
        """Answers the calls sent over a connection that dropped: 503, retry in a second. (The
        DEALER has one connection, to the one service. A call sent over the next connection
        before the drop is read would be answered so too; the read takes a turn of the loop,
        a service's restart a second.)"""
        assert self._monitor is not None
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for call_id in list(self._sent):
                error = ApiError(
                    503,
                    "the batch service went away during the call (it may have done it: "
                    "check before doing it again)",
                    "server_error",
                )
                error.retry_after_s = GONE_RETRY_AFTER_S
                self._answer(call_id, exception=error)
            self._sent.clear()

    def _answer(self, call_id: str | None, result: Any = None, exception: Any = None) -> None:
        """Wakes the call waiting for `call_id` (if any: it may have timed out) with the reply,
        or with `exception`."""
        future = self._waiting.get(call_id) if call_id is not None else None
        if future is None or future.done():
            return
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)


def _readable_call_id(frames: list[bytes]) -> str | None:
    """The call id in the header of a reply the wire refused, if it holds one (any bytes may
    have come: this raises on none)."""
    try:
        header = msgpack.unpackb(frames[1], raw=False) if len(frames) >= 2 else None
    except Exception:  # not even a header
        return None
    call_id = header.get("call_id") if isinstance(header, dict) else None
    return call_id if isinstance(call_id, str) else None


def field(body: dict[str, Any], name: str, *kinds: type | None) -> Any:
    """`body[name]`, which a route goes on with (an upload's id, a download's next offset); a
    502 when the service's answer lacks it or holds another kind (a KeyError was the gateway's
    500). `None` among `kinds` admits null; a bool is no int here."""
    value = body.get(name)
    if value is None and None in kinds and name in body:
        return value
    if type(value) not in kinds:
        wanted = " or ".join("null" if kind is None else kind.__name__ for kind in kinds)
        raise _nonsense(
            f"{name} is {str(value)[:100] if name in body else 'missing'}, not {wanted}"
        )
    return value


def _nonsense(why: str) -> ApiError:
    """A reply no sound batch service sends: the gateway's 502 (a bad answer from upstream)."""
    return ApiError(502, f"the batch service answered nonsense: {why}", "server_error")


def _body_of(reply: wire_batch.BatchReply) -> dict[str, Any]:
    """The reply's body, a JSON object; a 502 when the reply is none the service sends: its
    status neither 200 nor an HTTP error (relayed, it would be no HTTP answer), its body not a
    JSON object."""
    if reply.status != 200 and not 400 <= reply.status <= 599:
        raise _nonsense(f"status {reply.status}")
    try:
        body = json.loads(reply.body)
    except (ValueError, RecursionError) as error:  # (an int past 4,300 digits, deep nesting)
        raise _nonsense(f"a body that is not JSON: {str(error)[:200]}") from None
    if not isinstance(body, dict):
        raise _nonsense("a body that is not a JSON object")
    return body


def _api_error(status: int, body: dict[str, Any]) -> ApiError:
    error = body.get("error") if isinstance(body, dict) else None
    error = error if isinstance(error, dict) else {}
    kind = error.get("type") if error.get("type") in ERROR_TYPES else None
    return ApiError(
        status,
        str(error.get("message", "batch service error")),
        kind or ("server_error" if status >= 500 else "invalid_request_error"),
        error.get("param"),
        error.get("code"),
    )
