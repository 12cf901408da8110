"""The wire: every message that crosses a socket between tandem's services, and its encoding.

A message is a multipart ZeroMQ message:

    frame 0   one byte, the message type (`MessageType`), so a receiver routes without decoding
    frame 1   the header: MessagePack of a map {field name: value}
    frame 2.. raw tensor bytes, one frame per tensor field (consecutive frames for one larger
              than a frame carries), named in the header by a `TensorRef`

Messages are frozen dataclasses; their type annotations are the schema. At import each annotation
becomes a small codec (int, float, bool, bounded str or list, literal choice, optional, nested map,
tensor, packed token ids) that checks a decoded value and names the offending field in its
`WireError`. The header is unpacked with explicit limits and ext types refused; pickle is never
used. `decode` trusts nothing; `encode` trusts its (typed) caller and checks only what it cannot
send.

Tensors travel without copies. `encode` exposes each tensor's bytes as a memoryview over its own
storage; that view owns a reference to the storage, so the frames themselves keep the tensors
alive: `socket.send_multipart(frames, copy=False)` hands them to pyzmq, which holds them until
libzmq has sent them. A tensor must not be modified until then (over inproc, that is until the
receiver drops the decoded tensor: libzmq passes the same buffer across). `decode` wraps a writable
frame (a `zmq.Frame` from `recv_multipart(copy=False)`) with `torch.frombuffer`, no copy; an
immutable one (`bytes`) is copied once into a `bytearray`, because a tensor over immutable memory
is a write waiting to corrupt it (torch warns about exactly that).

Token ids of a prompt or an output (`TokenIds`) travel in the header as one MessagePack bin of
little-endian int32s and arrive as a `TokenArray` (an `array.array` of int32, equal to a list of
the same ids): packed and unpacked in C, and held in 4 bytes a token by whoever keeps them.

A field with a default may be left out of a header (it takes the default); every other field is
required, and an unknown field is refused, so a schema change needs `SCHEMA_VERSION` bumped.

The messages live by conversation: `shared.wire_registry` (peers and the scheduler: HELLO,
HEARTBEAT, GOODBYE, CLUSTER_STATUS), `shared.wire_requests` (a request's path: SUBMIT, RESERVE,
PREFILL_JOB, TOKENS, REQUEST_DONE, CANCEL), `shared.wire_kv` (prefill -> decode: KV_TRANSFER,
KV_ACK), `shared.wire_rpc` (the RPC front door); their field types in `shared.wire_base`, the
codecs in `shared.wire_codec`. This module ties them together (every code to its class, encode
and decode, the socket helpers) and re-exports them, so callers say `wire.Submit`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import msgpack
import zmq
import zmq.asyncio

from shared.wire_base import (
    DTYPE_NAMES,
    MAX_CONSTRAINT_CHARS,
    MAX_COUNT,
    MAX_HEADER_BYTES,
    MAX_HELD_IDS,
    MAX_JSON_LEN,
    MAX_LIST_LEN,
    MAX_MESSAGE_BYTES,
    MAX_RECENT_STEPS,
    MAX_REQUEST_ID_LEN,
    MAX_STR_LEN,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TOKEN_IDS,
    SCHEMA_VERSION,
    CallId,
    ConstraintSpec,
    Count,
    FrameLike,
    GeneratorState,
    JsonText,
    KvBlocks,
    MaxLen,
    Message,
    MessageType,
    PackedInt32,
    Phase,
    Range,
    RequestId,
    Role,
    SamplingSpec,
    Tensor,
    TensorOf,
    TensorRef,
    TokenArray,
    TokenDelta,
    TokenIds,
    WireError,
)
from shared.wire_codec import (
    _as_view,
    _Decoding,
    _struct_codec,
    _type_name,
    _unpack_header,
    tensor_frames,
)
from shared.wire_kv import KvAck, KvTransfer
from shared.wire_registry import (
    UNKNOWN_PEER,
    ClusterStatus,
    Goodbye,
    Heartbeat,
    Hello,
    HelloAck,
    PartyService,
    WorkerStatus,
)
from shared.wire_requests import (
    Cancel,
    PrefillGrant,
    PrefillJob,
    RequestDone,
    Reserve,
    ReserveReply,
    StreamEnded,
    Submit,
    SubmitReply,
    Tokens,
)
from shared.wire_rpc import RpcCancel, RpcEvent, RpcRequest

# Everything a caller names as `wire.X`: the messages of every conversation and their vocabulary.
__all__ = [
    "CallId",
    "Cancel",
    "ClusterStatus",
    "ConstraintSpec",
    "Count",
    "DTYPE_NAMES",
    "FrameLike",
    "GeneratorState",
    "Goodbye",
    "Heartbeat",
    "Hello",
    "HelloAck",
    "JsonText",
    "KvAck",
    "KvBlocks",
    "KvTransfer",
    "MAX_CONSTRAINT_CHARS",
    "MAX_COUNT",
    "MAX_HEADER_BYTES",
    "MAX_HELD_IDS",
    "MAX_JSON_LEN",
    "MAX_LIST_LEN",
    "MAX_MESSAGE_BYTES",
    "MAX_RECENT_STEPS",
    "MAX_REQUEST_ID_LEN",
    "MAX_STR_LEN",
    "MAX_TENSOR_BYTES",
    "MAX_TENSOR_DIMS",
    "MAX_TOKEN_IDS",
    "MaxLen",
    "Message",
    "MessageType",
    "PackedInt32",
    "PartyService",
    "Phase",
    "PrefillGrant",
    "PrefillJob",
    "Range",
    "RequestDone",
    "RequestId",
    "Reserve",
    "ReserveReply",
    "Role",
    "RpcCancel",
    "RpcEvent",
    "RpcRequest",
    "SCHEMA_VERSION",
    "SamplingSpec",
    "StreamEnded",
    "Submit",
    "SubmitReply",
    "Tensor",
    "TensorOf",
    "TensorRef",
    "TokenArray",
    "TokenDelta",
    "TokenIds",
    "Tokens",
    "UNKNOWN_PEER",
    "WireError",
    "WorkerStatus",
    "MESSAGE_CLASSES",
    "async_recv",
    "async_recv_from",
    "async_send",
    "async_send_to",
    "decode",
    "encode",
    "message_type",
    "peek_type",
    "recv",
    "recv_from",
    "send",
    "send_or_drop",
    "send_to",
]

MESSAGE_CLASSES: dict[MessageType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloAck, Heartbeat, Submit, SubmitReply, Cancel, Reserve, ReserveReply,
        PrefillJob, Tokens, KvTransfer, KvAck, RequestDone, ClusterStatus,
        RpcRequest, RpcCancel, RpcEvent, PrefillGrant, StreamEnded, Goodbye,
    )
}  # fmt: skip
assert set(MESSAGE_CLASSES) == set(MessageType), "every message type has one class"


def message_type(msg: Message) -> MessageType:
    return msg.TYPE


_MESSAGE_CODECS = {code: _struct_codec(cls) for code, cls in MESSAGE_CLASSES.items()}


# ----------------------------------------------------------------------------------------------
# Encoding and decoding


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of `msg`. Tensor frames are views of the tensors' memory and keep it alive;
    send with `socket.send_multipart(frames, copy=False)` and leave the tensors unmodified."""
    if not isinstance(msg, Message):
        raise WireError(f"not a message: {_type_name(msg)}")
    tensors: list[Tensor] = []
    fields = _MESSAGE_CODECS[msg.TYPE].to_wire(msg, tensors)
    try:
        header = msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"{type(msg).__name__}: cannot pack header: {e}") from e
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(
            f"{type(msg).__name__}: a header of {len(header):,} bytes, more than a message "
            f"carries ({MAX_HEADER_BYTES:,})"
        )
    frames: list[bytes | memoryview] = [bytes((msg.TYPE,)), header]
    for tensor in tensors:
        frames.extend(tensor_frames(tensor))
    return frames


def peek_type(frames: Sequence[FrameLike]) -> MessageType:
    """The message type from frame 0 alone, for routing before (or without) decoding."""
    if not frames:
        raise WireError("empty message: no frames")
    view = _as_view(frames[0])
    if view.nbytes != 1:
        raise WireError(f"type frame must be one byte, got {view.nbytes} bytes")
    try:
        return MessageType(view[0])
    except ValueError:
        raise WireError(f"unknown message type {view[0]}") from None


def decode(frames: Sequence[FrameLike]) -> Message:
    """The message in `frames`, checked field by field; `WireError` naming the problem if not."""
    code = peek_type(frames)
    name = MESSAGE_CLASSES[code].__name__
    if len(frames) < 2:
        raise WireError(f"{name}: missing header frame")
    views = [_as_view(f) for f in frames]
    fields = _unpack_header(views[1])
    if type(fields) is not dict:
        raise WireError(f"{name}: header must be a map, got {_type_name(fields)}")
    ctx = _Decoding(views)
    try:
        msg = _MESSAGE_CODECS[code].from_wire(fields, name, ctx)
    except WireError as error:
        raise WireError(f"{error}{_version_note(fields)}") from None
    unclaimed = set(range(2, len(frames))) - ctx.claimed
    if unclaimed:
        raise WireError(f"{name}: frames {sorted(unclaimed)} are not named by any tensor field")
    return msg


def _version_note(fields: dict) -> str:
    """Why a HELLO (or its answer) failed, when its sender speaks another schema version: its
    fields differ, and the message fails before anyone reads the version it carries."""
    version = fields.get("schema_version")
    if type(version) is not int or version == SCHEMA_VERSION:
        return ""
    return f" (the sender speaks schema version {version}, this one's {SCHEMA_VERSION})"


# ----------------------------------------------------------------------------------------------
# Sockets. ROUTER helpers expect DEALER peers: [identity, type, header, tensors...], no delimiter.


def connect_refusal(socket: zmq.Socket, address: str) -> str | None:
    """Connects `socket` to an address a peer sent; if ZeroMQ refuses it (not an endpoint, an
    unknown transport, "tcp://*:5", an ipc path too long), closes the socket and says why. An
    address from the wire is tried so before anything relies on it: a connect that raised in
    the middle of a worker's step ended the worker."""
    try:
        socket.connect(address)
    except zmq.ZMQError as error:
        socket.close(linger=0)
        return f"address {address!r} cannot be connected to: {error.strerror}"
    return None


def send(socket: zmq.Socket, msg: Message) -> None:
    socket.send_multipart(encode(msg), copy=False)


def recv(socket: zmq.Socket) -> Message:
    return decode(socket.recv_multipart(copy=False))


def send_to(socket: zmq.Socket, identity: bytes, msg: Message) -> None:
    socket.send_multipart([identity, *encode(msg)], copy=False)


def recv_from(socket: zmq.Socket) -> tuple[bytes, Message]:
    identity, *frames = socket.recv_multipart(copy=False)
    return identity.bytes, _decode_from(identity.bytes, frames)


def send_or_drop(socket: zmq.Socket, msg: Message) -> bool:
    """A best-effort message (a cancel) sent without waiting: False, dropped, when the socket
    has no room or no connection to take it. An asyncio socket answers NOBLOCK with a future
    done at once (zmq.Again its error); its outcome is taken, never left unretrieved."""
    try:
        sent = socket.send_multipart(encode(msg), flags=zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return False
    if not isinstance(sent, asyncio.Future):
        return True
    if not sent.done():  # (not expected: then its outcome is taken when it comes)
        sent.add_done_callback(lambda done: done.cancelled() or done.exception())
        return True
    return sent.cancelled() or not isinstance(sent.exception(), zmq.Again)


async def async_send(socket: zmq.asyncio.Socket, msg: Message) -> None:
    await socket.send_multipart(encode(msg), copy=False)


async def async_recv(socket: zmq.asyncio.Socket) -> Message:
    return decode(await socket.recv_multipart(copy=False))


async def async_send_to(
    socket: zmq.asyncio.Socket, identity: bytes, msg: Message, flags: int = 0
) -> None:
    await socket.send_multipart([identity, *encode(msg)], flags=flags, copy=False)


async def async_recv_from(socket: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    identity, *frames = await socket.recv_multipart(copy=False)
    return identity.bytes, _decode_from(identity.bytes, frames)


def _decode_from(identity: bytes, frames: Sequence[FrameLike]) -> Message:
    try:
        return decode(frames)
    except WireError as e:
        raise WireError(f"from peer {identity!r}: {e}") from None
