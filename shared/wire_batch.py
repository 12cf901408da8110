"""The batch conversation: a gateway's DEALER to the batch service's ROUTER.

The gateway forwards the OpenAI Files and Batches calls as they came over HTTP, with the caller's
tenant already resolved from its API key: one `BatchCall` in, one `BatchReply` out, matched by
`call_id`. Bodies are JSON text (as the RPC door's), so the service answers in OpenAI's shapes
and the gateway only relays them. File bytes travel raw in one extra frame (an upload chunk in,
a content chunk out), never inside MessagePack, and each frame is bounded by `MAX_CHUNK_BYTES`.
Both ends receive frames of at most `MAX_FRAME_BYTES` (their zmq.MAXMSGSIZE: a bigger frame
drops the connection), so `encode` refuses a header past it: an answer too big to receive is a
`WireError` its sender can turn into an error answer, not a reply that never arrives.

Frames: [type byte, MessagePack header, optional data frame]. The header is checked by the same
codecs as every message of `shared.wire` (bounded strings, literal choices, unknown fields
refused); a frame that fails is a `WireError` the receiver logs and drops.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

import msgpack
import zmq.asyncio

from shared.wire_base import CallId, FrameLike, JsonText, MaxLen, WireError
from shared.wire_codec import _as_view, _struct_codec, _unpack_header

MAX_CHUNK_BYTES = 4 << 20  # one upload or content frame
MAX_FRAME_BYTES = MAX_CHUNK_BYTES + (1 << 20)  # any frame, header too: the sockets' MAXMSGSIZE

# What a call asks for. The file_upload_* three carry one upload: begin (purpose, filename) ->
# an upload id; chunks in order (the data frame); end -> the stored file object.
Op = Literal[
    "file_upload_begin",
    "file_upload_chunk",
    "file_upload_end",
    "file_list",
    "file_get",
    "file_delete",
    "file_content",  # params {"file_id", "offset"}: a chunk from offset; body says if more follow
    "batch_create",
    "batch_get",
    "batch_list",
    "batch_cancel",
    "metrics",  # the service's Prometheus text in the data frame, for the gateway's /metrics
]
OPS: tuple[str, ...] = Op.__args__


class BatchMessageType(enum.IntEnum):
    """Frame 0's code; apart from `shared.wire.MessageType`'s so neither socket mistakes one."""

    BATCH_CALL = 64
    BATCH_REPLY = 65


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchCall:
    """Gateway -> batch service: one Files or Batches call (an upload chunk in the data frame)."""

    TYPE: ClassVar[BatchMessageType] = BatchMessageType.BATCH_CALL
    call_id: CallId  # unique among the gateway's calls in flight; its reply carries it back
    op: Op
    tenant: Annotated[str, MaxLen(256)]  # the owner, from the caller's API key
    params: JsonText  # the path and query parameters and JSON body, as one JSON object


@dataclass(frozen=True, slots=True, kw_only=True)
class BatchReply:
    """Batch service -> gateway: the answer to one call (a content chunk in the data frame)."""

    TYPE: ClassVar[BatchMessageType] = BatchMessageType.BATCH_REPLY
    call_id: CallId
    status: int  # as HTTP would answer
    body: JsonText  # OpenAI's object, list or error object, as JSON text


BatchMessage = BatchCall | BatchReply
_CLASSES: dict[int, type] = {BatchCall.TYPE: BatchCall, BatchReply.TYPE: BatchReply}
_CODECS = {code: _struct_codec(cls) for code, cls in _CLASSES.items()}


def encode(msg: BatchMessage, data: bytes | None = None) -> list[bytes]:
    """The frames of `msg`, with `data` (at most MAX_CHUNK_BYTES) as its own last frame."""
    try:
        header = msgpack.packb(_CODECS[msg.TYPE].to_wire(msg, []), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:  # a lone surrogate, an int past uint64
        raise WireError(f"{type(msg).__name__}: cannot pack header: {e}") from e
    if len(header) > MAX_FRAME_BYTES:
        raise WireError(
            f"{type(msg).__name__}: header of {len(header)} bytes exceeds {MAX_FRAME_BYTES}"
        )
    frames = [bytes((msg.TYPE,)), header]
    if data is not None:
        if len(data) > MAX_CHUNK_BYTES:
            raise WireError(f"{type(msg).__name__}: data frame over {MAX_CHUNK_BYTES} bytes")
        frames.append(bytes(data))
    return frames


def decode(frames: Sequence[FrameLike]) -> tuple[BatchMessage, bytes | None]:
    """(the message, its data frame or None), checked field by field; WireError if not."""
    if not 2 <= len(frames) <= 3:
        raise WireError(f"a batch message has 2 or 3 frames, got {len(frames)}")
    views = [_as_view(f) for f in frames]
    if views[0].nbytes != 1 or views[0][0] not in _CLASSES:
        raise WireError(f"unknown batch message type {bytes(views[0][:4])!r}")
    cls = _CLASSES[views[0][0]]
    fields = _unpack_header(views[1])
    if type(fields) is not dict:
        raise WireError(f"{cls.__name__}: header must be a map")
    msg = _CODECS[cls.TYPE].from_wire(fields, cls.__name__, None)
    data = None
    if len(views) == 3:
        if views[2].nbytes > MAX_CHUNK_BYTES:
            raise WireError(f"{cls.__name__}: data frame over {MAX_CHUNK_BYTES} bytes")
        data = bytes(views[2])
    return msg, data


async def async_send(
    socket: zmq.asyncio.Socket, msg: BatchMessage, data: bytes | None = None
) -> None:
    await socket.send_multipart(encode(msg, data))


async def async_send_to(
    socket: zmq.asyncio.Socket, identity: bytes, msg: BatchMessage, data: bytes | None = None
) -> None:
    await socket.send_multipart([identity, *encode(msg, data)])
