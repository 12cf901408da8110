"""The wire: every message that crosses a socket between tandem's services, and its encoding.

A message is a multipart ZeroMQ message:

    frame 0   one byte, the message type (`MessageType`), so a receiver routes without decoding
    frame 1   the header: MessagePack of a map {field name: value}
    frame 2.. raw tensor bytes, one frame per tensor field, named in the header by a `TensorRef`

Messages are frozen dataclasses; their type annotations are the schema. At import each annotation
becomes a small codec (int, float, bool, bounded str or list, literal choice, optional, nested
map, tensor) that checks a decoded value and names the offending field in its `WireError`. The
header is unpacked with explicit limits and ext types refused; pickle is never used. `decode`
trusts nothing; `encode` trusts its (typed) caller and checks only what it cannot send.

Tensors travel without copies. `encode` exposes each tensor's bytes as a memoryview over its own
storage; that view owns a reference to the storage, so the frames themselves keep the tensors
alive: `socket.send_multipart(frames, copy=False)` hands them to pyzmq, which holds them until
libzmq has sent them. A tensor must not be modified until then (over inproc, that is until the
receiver drops the decoded tensor: libzmq passes the same buffer across). `decode` wraps a writable
frame (a `zmq.Frame` from `recv_multipart(copy=False)`) with `torch.frombuffer`, no copy; an
immutable one (`bytes`) is copied once into a `bytearray`, because a tensor over immutable memory
is a write waiting to corrupt it (torch warns about exactly that).

A field with a default may be left out of a header (it takes the default); every other field is
required, and an unknown field is refused, so a schema change needs `SCHEMA_VERSION` bumped.
"""

from __future__ import annotations

import abc
import dataclasses
import enum
import types
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin, get_type_hints

import msgpack
import torch
import zmq
import zmq.asyncio

SCHEMA_VERSION = 4  # 3: prefix cache fields, bulk submits; 4: structured-output constraints
MAX_MESSAGE_BYTES = 256 << 20  # per frame; services set it as zmq.MAXMSGSIZE on their sockets
MAX_HEADER_BYTES = 16 << 20
MAX_RECENT_STEPS = 256  # step batch sizes a heartbeat carries
MAX_HELD_IDS = 8192  # request ids a heartbeat carries
MAX_TOKEN_IDS = 1 << 20  # a prompt (or prompt + output) of up to a million tokens
MAX_REQUEST_ID_LEN = 128
MAX_STR_LEN = 4096  # any other string
MAX_JSON_LEN = 8 << 20  # an RPC call's JSON body or event (the HTTP API's body limit)
MAX_LIST_LEN = 4096  # any other list
MAX_TENSOR_DIMS = 8
MAX_CONSTRAINT_CHARS = 64 << 10  # a schema, regex or grammar (the engine's cap)

# The dtypes a tensor frame may hold, by their header name.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "uint8": torch.uint8,
}
_DTYPE_NAMES = {dtype: name for name, dtype in DTYPES.items()}

FrameLike = bytes | memoryview | zmq.Frame  # what decode accepts per frame


class WireError(ValueError):
    """A message that cannot be decoded (or encoded). Receivers log it and drop the message."""


@dataclass(frozen=True)
class MaxLen:
    """Annotation metadata: the most characters (str) or entries (list) a field may hold."""

    value: int


@dataclass(frozen=True)
class TensorOf:
    """Annotation metadata: the dtypes (header names) and number of dimensions a tensor may have."""

    dtypes: tuple[str, ...] = tuple(DTYPES)
    ndim: int | None = None  # None: any, up to MAX_TENSOR_DIMS


RequestId = Annotated[str, MaxLen(MAX_REQUEST_ID_LEN)]
TokenIds = Annotated[list[int], MaxLen(MAX_TOKEN_IDS)]
Role = Literal["gateway", "prefill", "decode"]
Phase = Literal["prefill", "decode"]
KvBlocks = Annotated[torch.Tensor, TensorOf(ndim=5)]
GeneratorState = Annotated[torch.Tensor, TensorOf(dtypes=("uint8",), ndim=1)]
CallId = Annotated[str, MaxLen(MAX_REQUEST_ID_LEN)]
JsonText = Annotated[str, MaxLen(MAX_JSON_LEN)]


class MessageType(enum.IntEnum):
    """The one-byte code in frame 0."""

    HELLO = 1
    HELLO_ACK = 2
    HEARTBEAT = 3
    SUBMIT = 4
    SUBMIT_REPLY = 5
    CANCEL = 6
    RESERVE = 7
    RESERVE_REPLY = 8
    PREFILL_JOB = 9
    TOKENS = 10
    KV_TRANSFER = 11
    KV_ACK = 12
    REQUEST_DONE = 13
    CLUSTER_STATUS = 14
    RPC_REQUEST = 15
    RPC_CANCEL = 16
    RPC_EVENT = 17


# ----------------------------------------------------------------------------------------------
# Nested map types (not messages)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """How a header names a tensor: its bytes are frame `frame`, C-contiguous, native order."""

    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32", "uint8"]
    shape: Annotated[list[int], MaxLen(MAX_TENSOR_DIMS)]
    frame: int  # >= 2; each tensor frame is named by exactly one TensorRef


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstraintSpec:
    """A structured-output constraint (`shared.engine.constraint.Constraint`) on the wire."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    spec: Annotated[str, MaxLen(MAX_CONSTRAINT_CHARS)] = ""  # schema, regex, choices or EBNF


@dataclass(frozen=True, slots=True, kw_only=True)
class SamplingSpec:
    """The engine's `SamplingParams` on the wire, same names and defaults; the engine validates
    ranges when it builds `SamplingParams` from it."""

    max_tokens: int = 16  # most tokens to generate
    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0 or -1: off
    top_p: float = 1.0  # nucleus mass kept
    min_p: float = 0.0  # drop tokens below min_p * the best token's probability
    seed: int | None = None  # None: the worker seeds from the OS
    presence_penalty: float = 0.0  # subtracted once for every token present in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (or multiplies) logits of seen tokens
    logprobs: int | None = None  # None: none; 0: the chosen token's; n: also the top n
    ignore_eos: bool = False  # keep generating past EOS
    min_tokens: int = 0  # EOS and stop tokens suppressed until this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # finish on any of these
    constraint: ConstraintSpec | None = None  # what the output must match (structured output)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta:
    """One request's new tokens from one engine step."""

    request_id: RequestId
    token_ids: list[int]  # new tokens, in order (usually one)
    logprobs: list[float] | None = None  # per new token the chosen token's logprob, if asked
    # per new token its top-n (token id, logprob), best first, if asked with logprobs >= 1
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # "stop", "length" or "abort" on the request's last delta; "lost" when the worker holding
    # it is gone (its gateway resumes it elsewhere from the tokens it has, or fails it);
    # "timeout" (with `error`) when it waited past a limit, such as the queue's; "preempted"
    # when its decode worker handed it back for recompute (resumed like "lost", not counted).
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed; the gateway answers with it
    # On a prefill's first delta: prompt tokens whose computation its prefix cache skipped
    # (never KV received over the wire); None from decode steps.
    num_cached_tokens: int | None = None


# ----------------------------------------------------------------------------------------------
# Messages


class Message:
    """Base of every message; `TYPE` is its code in frame 0."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]


@dataclass(frozen=True, slots=True, kw_only=True)
class Hello(Message):
    """Peer -> scheduler, first message on connecting. The scheduler refuses another version."""

    TYPE: ClassVar[MessageType] = MessageType.HELLO
    schema_version: int  # the peer's SCHEMA_VERSION
    role: Role
    peer_id: str  # unique per process; names the peer in every later message
    model: str  # the model served; peers of one cluster must agree
    # Where others connect to this peer: a gateway's token-stream PULL, a decode worker's KV
    # ROUTER; None for a prefill worker, which only connects out.
    address: str | None
    num_kv_blocks: int  # KV pool size in blocks (0 for a gateway)
    block_size: int  # tokens per KV block (0 for a gateway)
    max_num_seqs: int  # most sequences in one batch (0 for a gateway)
    metrics_address: str | None = None  # http://host:port of its Prometheus /metrics, if served
    dtype: str | None = None  # a worker's weights and KV dtype (auto resolved); None: gateway
    # A worker's prefix cache key (model, dtype, block size, hash scheme); the scheduler refuses
    # a worker whose key differs from the cluster's (its hashes would never match). None: off.
    cache_key: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class HelloAck(Message):
    """Scheduler -> peer, answer to HELLO."""

    TYPE: ClassVar[MessageType] = MessageType.HELLO_ACK
    schema_version: int  # the scheduler's SCHEMA_VERSION
    accepted: bool
    error: str | None  # why not, when refused
    heartbeat_interval_s: float  # send a HEARTBEAT this often; missing several means dead


# HelloAck.error when the scheduler hears from a peer it does not know (it restarted, or took the
# peer for dead): the peer says HELLO again.
UNKNOWN_PEER = "unknown peer: say HELLO again"


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Worker -> scheduler, periodically: liveness, load, and progress (honest health)."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    peer_id: str
    num_waiting: int  # sequences queued, not yet running
    num_running: int  # sequences in the running batch
    num_free_blocks: int  # free KV blocks (not reserved, not in use, not claimed by preempted)
    num_total_blocks: int
    steps_completed: int  # engine steps since start; stuck while busy means unhealthy
    sent_at: float  # sender's wall clock (time.time()), seconds
    num_swapped: int = 0  # preempted sequences whose KV waits in host memory
    num_swap_preemptions: int = 0  # since start: sequences swapped out to make room
    num_recompute_preemptions: int = 0  # since start: sequences dropped to be recomputed
    # The requests it holds state for (reservations, jobs, transfers, sequences): the lease
    # check. The scheduler cancels any it has given up on, in case that cancel went astray.
    request_ids: Annotated[list[RequestId], MaxLen(MAX_HELD_IDS)] = field(default_factory=list)
    # Sequences in each engine step since the last heartbeat, oldest first (the batch picture).
    recent_batch_sizes: Annotated[list[int], MaxLen(MAX_RECENT_STEPS)] = field(default_factory=list)
    # Prefix cache events (block hashes) since the previous heartbeat. Heartbeats are numbered
    # 1, 2, ... from HELLO on: a number skipped means events were lost, and the scheduler
    # forgets the worker's set until the next full one (the first, then every few seconds).
    cache_events_seq: int = 0  # 0: the worker keeps no prefix cache
    cache_full: bool = False  # cache_stored is the worker's whole set, not a change
    cache_stored: Annotated[list[int], MaxLen(MAX_TOKEN_IDS)] = field(default_factory=list)
    cache_evicted: Annotated[list[int], MaxLen(MAX_TOKEN_IDS)] = field(default_factory=list)
    num_prefix_query_tokens: int = 0  # since start: prompt tokens looked up in the cache
    num_prefix_hit_tokens: int = 0  # since start: of them, found (their computation skipped)
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: not yet)


@dataclass(frozen=True, slots=True, kw_only=True)
class Submit(Message):
    """Gateway -> scheduler: a new, tokenized request."""

    TYPE: ClassVar[MessageType] = MessageType.SUBMIT
    request_id: RequestId  # unique in the cluster, chosen by the gateway
    prompt_token_ids: TokenIds
    sampling: SamplingSpec
    tenant: str  # fair-share account the request is charged to
    priority: int  # larger is more urgent
    gateway_peer_id: str  # the gateway to stream tokens to (its HELLO gave the address)
    arrival_time: float  # gateway's wall clock when the request arrived, seconds
    # A resumed request (its worker was lost): the tokens its client already has, prefilled
    # after the prompt, and the attempt it continues (admitted already: not refused for load).
    output_token_ids: TokenIds = field(default_factory=list)
    resumed_from: RequestId | None = None
    bulk: bool = False  # a batch job's line: served only from capacity interactive work leaves


@dataclass(frozen=True, slots=True, kw_only=True)
class SubmitReply(Message):
    """Scheduler -> gateway, answer to SUBMIT: queued, or refused with an HTTP-like status."""

    TYPE: ClassVar[MessageType] = MessageType.SUBMIT_REPLY
    request_id: RequestId
    accepted: bool
    status_code: int  # 200 queued; 400 invalid; 429 queue full; 503 no worker
    message: str | None  # why not, when refused
    retry_after_s: float | None  # with 429/503: when to try again


@dataclass(frozen=True, slots=True, kw_only=True)
class Cancel(Message):
    """Abort a request: gateway -> scheduler, then scheduler -> every worker holding its state."""

    TYPE: ClassVar[MessageType] = MessageType.CANCEL
    request_id: RequestId
    reason: str  # for logs: "client disconnected", "worker died", ...


@dataclass(frozen=True, slots=True, kw_only=True)
class Reserve(Message):
    """Scheduler -> decode worker: hold KV blocks for a request before its prefill is sent."""

    TYPE: ClassVar[MessageType] = MessageType.RESERVE
    request_id: RequestId
    num_tokens: int  # tokens whose K/V will arrive (blocks = ceil(num_tokens / block_size))
    lease_s: float  # the reservation lapses unless the KV arrives within this many seconds
    # The tokens whose K/V will arrive and their cache salt: the worker holds (pins) the leading
    # full blocks it has cached, and only the rest is sent. Empty: no lookup.
    token_ids: TokenIds = field(default_factory=list)
    cache_salt: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ReserveReply(Message):
    """Decode worker -> scheduler, answer to RESERVE."""

    TYPE: ClassVar[MessageType] = MessageType.RESERVE_REPLY
    request_id: RequestId
    ok: bool  # blocks held for the lease
    num_free_blocks: int  # free blocks after the reservation (or now, when refused)
    num_cached_blocks: int = 0  # leading blocks of the KV it holds already (pinned for the lease)


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillJob(Message):
    """Scheduler -> prefill worker: run this prompt, then hand the KV to the decode target."""

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_JOB
    request_id: RequestId
    prompt_token_ids: TokenIds
    sampling: SamplingSpec
    gateway_address: str  # where the first token is streamed (the gateway's PULL)
    decode_peer_id: str  # the decode worker holding the reservation
    decode_address: str  # its KV ROUTER address
    # Tokens already generated (re-prefill after a decode worker died): their K/V is rebuilt
    # too, and generation continues after them. Usually empty.
    output_token_ids: TokenIds = field(default_factory=list)
    priority: int = 0  # the request's priority: under memory pressure, larger is preempted last
    # Separates prefix cache entries: only prompts with the same salt (the tenant, unless the
    # cluster shares its cache between tenants) share cached blocks. None: the shared space.
    cache_salt: str | None = None
    # Leading blocks of the KV the decode worker holds already (its ReserveReply): not sent.
    num_skip_blocks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens(Message):
    """Worker -> gateway (PUSH to its PULL): one message per engine step per gateway."""

    TYPE: ClassVar[MessageType] = MessageType.TOKENS
    deltas: list[TokenDelta]  # one per request of this gateway that advanced in the step


# Tensors make `==` ambiguous, so KvTransfer compares by identity (eq=False).
@dataclass(frozen=True, slots=True, kw_only=True, eq=False)
class KvTransfer(Message):
    """Prefill worker -> decode worker (DEALER to its ROUTER): a prefilled request and its KV."""

    TYPE: ClassVar[MessageType] = MessageType.KV_TRANSFER
    request_id: RequestId
    prompt_token_ids: TokenIds
    output_token_ids: TokenIds  # at least the first sampled token (already streamed)
    sampling: SamplingSpec
    gateway_address: str  # where the decode worker streams the following tokens
    num_tokens: int  # tokens whose K/V the sequence has; the last block may be partly filled
    block_size: int  # tokens per block in `keys`/`values`; must equal the decode worker's
    # The first block carried: the receiver holds blocks [0, first_block) from its own cache
    # (pinned at reservation), so keys/values hold blocks first_block.. only.
    first_block: int = 0
    keys: KvBlocks  # [num_layers, num_blocks, block_size, num_kv_heads, head_dim]
    values: KvBlocks  # same shape and dtype as keys
    # uint8, torch.Generator.get_state() after the first token, so a seeded request draws on
    # where it left off; None for greedy requests.
    generator_state: GeneratorState | None = None
    priority: int = 0  # the request's priority, as in PrefillJob
    cache_salt: str | None = None  # as in PrefillJob: names the blocks in the decode cache


@dataclass(frozen=True, slots=True, kw_only=True)
class KvAck(Message):
    """Decode worker -> prefill worker, answer to KV_TRANSFER; the prefill side frees its copy."""

    TYPE: ClassVar[MessageType] = MessageType.KV_ACK
    request_id: RequestId
    ok: bool  # admitted: the decode worker owns the request now
    error: str | None  # why not (lease lapsed, shape mismatch, ...)


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDone(Message):
    """Worker -> scheduler: a request left this worker (finished, aborted or handed on)."""

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_DONE
    request_id: RequestId
    peer_id: str  # the reporting worker
    phase: Phase  # prefill: KV handed to decode; decode: generation over
    finish_reason: str | None  # None when the prefill phase ends normally
    num_prompt_tokens: int
    num_output_tokens: int  # tokens generated on this worker
    num_cached_tokens: int = 0  # prefill phase: prompt tokens its prefix cache spared computing


@dataclass(frozen=True, slots=True, kw_only=True)
class ClusterStatus(Message):
    """Scheduler -> gateway, periodically: the cluster at a glance, for health and /metrics."""

    TYPE: ClassVar[MessageType] = MessageType.CLUSTER_STATUS
    num_prefill: int  # live prefill workers
    num_decode: int  # live decode workers
    num_queued: int  # requests waiting for a prefill worker
    num_in_flight: int  # requests admitted and not yet finished
    num_decode_free_blocks: int = 0  # free KV blocks over all decode workers (last heartbeats)
    num_decode_total_blocks: int = 0  # KV blocks over all decode workers
    num_swap_preemptions: int = 0  # over the decode workers, since each started
    num_recompute_preemptions: int = 0
    policy: Literal["fair", "fcfs"] = "fair"  # the queue's order
    max_queue_wait_s: float = 0.0  # the longest any dispatched request waited in the queue
    service: Annotated[list[PartyService], MaxLen(256)] = field(default_factory=list)
    workers: Annotated[list[WorkerStatus], MaxLen(1024)] = field(default_factory=list)
    scheduler_metrics_address: str | None = None  # http://host:port of the scheduler's /metrics
    # Names this run of the scheduler: a new value tells a gateway the scheduler restarted and
    # forgot the requests it held.
    scheduler_epoch: str = ""
    # Prompt tokens the prefix index predicted cached where each prompt went, and those the
    # workers then found, since the scheduler started: a drifting index shows as a gap.
    num_predicted_cached_tokens: int = 0
    num_actual_cached_tokens: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class PartyService:
    """One fair-share account (tenant and prompt class) and the service it has received."""

    tenant: Annotated[str, MaxLen(256)]
    class_name: Annotated[str, MaxLen(64)]
    served_tokens: int  # prompt tokens prefilled plus tokens generated
    virtual_tokens: float  # the policy's weighted counter
    num_queued: int = 0  # its requests waiting in the queue


@dataclass(frozen=True, slots=True, kw_only=True)
class WorkerStatus:
    """One registered worker as the scheduler last heard from it."""

    peer_id: str
    role: Role
    healthy: bool  # making progress (stuck workers stay listed, out of rotation)
    heartbeat_age_s: float  # since its last heartbeat arrived
    num_running: int
    num_waiting: int
    num_swapped: int
    num_free_blocks: int
    num_total_blocks: int
    steps_completed: int
    recent_batch_sizes: Annotated[list[int], MaxLen(MAX_RECENT_STEPS)] = field(default_factory=list)
    metrics_address: str | None = None
    dtype: str | None = None  # as its HELLO said
    num_prefix_query_tokens: int = 0  # since its start: prompt tokens looked up in its cache
    num_prefix_hit_tokens: int = 0  # of them, found


# The RPC front door: a client's DEALER to the gateway's RPC ROUTER. Bodies are the HTTP API's
# JSON as text, so both doors share one parser and one response shape, field for field.


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcRequest(Message):
    """Client -> gateway: one completion or chat call."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_REQUEST
    call_id: CallId  # chosen by the client, unique among its calls in flight; names its events
    kind: Literal["completion", "chat"]  # /v1/completions or /v1/chat/completions
    body: JsonText  # the HTTP API's request body, as JSON text
    stream: bool  # chunks as they come, or one response; the body's `stream` must agree
    api_key: Annotated[str, MaxLen(256)] | None = None  # when the gateway has keys: one of them
    bulk: bool = False  # a batch job's line (the scheduler's bulk class: spare capacity only)


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcCancel(Message):
    """Client -> gateway: abandon a call; its request is cancelled in the cluster."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_CANCEL
    call_id: CallId


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcEvent(Message):
    """Gateway -> client: one event of a call. A streaming call gets chunks and then an `end`
    (SSE's `[DONE]`); a non-streaming one gets one response; either may end with an error."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_EVENT
    call_id: CallId
    kind: Literal["chunk", "response", "error", "end"]
    # JSON text: an OpenAI stream chunk, the whole OpenAI response, or OpenAI's error object
    # ({"error": {"message", "type", "param", "code"}}); empty for `end`.
    body: JsonText
    status: int  # as HTTP would answer: 200 for chunks, responses and end; the error's status
    retry_after_s: float | None = None  # with 429/503: when to try again
    done: bool  # the call's last event; the gateway forgets the call


MESSAGE_CLASSES: dict[MessageType, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, HelloAck, Heartbeat, Submit, SubmitReply, Cancel, Reserve, ReserveReply,
        PrefillJob, Tokens, KvTransfer, KvAck, RequestDone, ClusterStatus,
        RpcRequest, RpcCancel, RpcEvent,
    )
}  # fmt: skip
assert set(MESSAGE_CLASSES) == set(MessageType), "every message type has one class"


def message_type(msg: Message) -> MessageType:
    return msg.TYPE


# ----------------------------------------------------------------------------------------------
# Codecs: one per annotation, built once at import


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


class _Decoding:
    """State of one decode: the frames, and which tensor frames the header has claimed."""

    def __init__(self, frames: Sequence[memoryview]):
        self.frames = frames
        self.claimed: set[int] = set()

    def claim(self, index: int, path: str) -> memoryview:
        if not 2 <= index < len(self.frames):
            raise WireError(
                f"{path}: tensor frame index {index} out of range [2, {len(self.frames)})"
            )
        if index in self.claimed:
            raise WireError(f"{path}: tensor frame {index} is named twice")
        self.claimed.add(index)
        return self.frames[index]


class _Codec(abc.ABC):
    """Turns a field value into its header form (collecting tensors) and checks it back.
    `leaf`: the header form is the value itself, so lists of leaves pass through unwalked."""

    leaf = True

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return value

    @abc.abstractmethod
    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        """The checked value; raises WireError naming `path`."""


class _Exact(_Codec):
    """int, bool or str: msgpack yields exactly these types, and a bool is not an int here."""

    def __init__(self, kind: type, max_len: int | None = None):
        self.kind, self.max_len = kind, max_len

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        if type(value) is not self.kind:
            raise WireError(f"{path}: expected {self.kind.__name__}, got {_type_name(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise WireError(f"{path}: string of {len(value)} chars exceeds {self.max_len}")
        return value


class _Float(_Codec):
    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> float:
        if type(value) is not float and type(value) is not int:
            raise WireError(f"{path}: expected float, got {_type_name(value)}")
        # An int (e.g. "lease_s: 5") means the same number. Non-finite values pass: a logprob
        # may be -inf; ranges are the receiver's business.
        return float(value)


class _Choice(_Codec):
    def __init__(self, choices: tuple[str, ...]):
        self.choices = choices

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> str:
        if type(value) is not str or value not in self.choices:
            raise WireError(f"{path}: expected one of {list(self.choices)}, got {value!r:.80}")
        return value


class _Optional(_Codec):
    def __init__(self, inner: _Codec):
        self.inner, self.leaf = inner, inner.leaf

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return None if value is None else self.inner.to_wire(value, tensors)

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        return None if value is None else self.inner.from_wire(value, path, ctx)


class _List(_Codec):
    def __init__(self, item: _Codec, max_len: int):
        self.item, self.max_len, self.leaf = item, max_len, item.leaf

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return value if self.leaf else [self.item.to_wire(x, tensors) for x in value]

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> list:
        if type(value) is not list:
            raise WireError(f"{path}: expected list, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise WireError(f"{path}: list of {len(value)} entries exceeds {self.max_len}")
        # Fast path for token id lists (up to a million entries): one pass over the types.
        int_items = isinstance(self.item, _Exact) and self.item.kind is int
        if int_items and all(type(x) is int for x in value):
            return value
        return [self.item.from_wire(x, f"{path}[{i}]", ctx) for i, x in enumerate(value)]


class _Tuple(_Codec):
    """A fixed-length pair such as (token id, logprob); an array on the wire."""

    def __init__(self, items: tuple[_Codec, ...]):
        self.items = items

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> tuple:
        if type(value) is not list or len(value) != len(self.items):
            raise WireError(f"{path}: expected an array of {len(self.items)}, got {value!r:.80}")
        return tuple(
            c.from_wire(x, f"{path}[{i}]", ctx)
            for i, (c, x) in enumerate(zip(self.items, value, strict=True))
        )


class _Struct(_Codec):
    """A dataclass as a map of its fields. `_struct_codec` fills `fields` in after registering
    the codec, so that nested (and recursive) types share one codec."""

    leaf = False

    def __init__(self, cls: type):
        self.cls = cls
        self.fields: dict[str, _Codec] = {}
        self.required: frozenset[str] = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> dict:
        return {name: c.to_wire(getattr(value, name), tensors) for name, c in self.fields.items()}

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        if type(value) is not dict:
            raise WireError(f"{path}: expected a map, got {_type_name(value)}")
        unknown = value.keys() - self.fields.keys()
        if unknown:
            raise WireError(f"{path}: unknown field(s) {sorted(map(str, unknown))}")
        missing = self.required - value.keys()
        if missing:
            raise WireError(f"{path}: missing required field(s) {sorted(missing)}")
        return self.cls(
            **{name: c.from_wire(value[name], f"{path}.{name}", ctx)
               for name, c in self.fields.items() if name in value}
        )  # fmt: skip


class _Tensor(_Codec):
    leaf = False

    def __init__(self, spec: TensorOf):
        self.spec = spec

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> dict:
        tensor = _sendable(value, self.spec)
        tensors.append(tensor)
        return {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                "frame": 1 + len(tensors)}  # fmt: skip

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> torch.Tensor:
        ref: TensorRef = _TENSOR_REF.from_wire(value, path, ctx)
        _check_tensor_spec(ref.dtype, ref.shape, self.spec, path)
        buf = ctx.claim(ref.frame, path)
        dtype = DTYPES[ref.dtype]
        numel = _numel(ref.shape)
        if buf.nbytes != numel * dtype.itemsize:
            raise WireError(
                f"{path}: frame {ref.frame} holds {buf.nbytes} bytes, but {ref.dtype}"
                f"{ref.shape} needs {numel * dtype.itemsize}"
            )
        return _tensor_from_buffer(buf, dtype, ref.shape)


def _codec_for(tp: Any, max_len: int | None = None, spec: TensorOf | None = None) -> _Codec:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        meta = tp.__metadata__
        max_len = next((m.value for m in meta if isinstance(m, MaxLen)), max_len)
        spec = next((m for m in meta if isinstance(m, TensorOf)), spec)
        return _codec_for(args[0], max_len, spec)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is supported
        return _Optional(_codec_for(inner, max_len, spec))
    if origin is Literal:
        return _Choice(args)
    if origin is list:
        return _List(_codec_for(args[0]), max_len or MAX_LIST_LEN)
    if origin is tuple:
        return _Tuple(tuple(_codec_for(a) for a in args))
    if tp is float:
        return _Float()
    if tp in (int, bool):
        return _Exact(tp)
    if tp is str:
        return _Exact(str, max_len or MAX_STR_LEN)
    if tp is torch.Tensor:
        return _Tensor(spec or TensorOf())
    if dataclasses.is_dataclass(tp):
        return _struct_codec(tp)
    raise TypeError(f"no wire codec for {tp!r}")


_STRUCTS: dict[type, _Struct] = {}


def _struct_codec(cls: type) -> _Struct:
    if cls not in _STRUCTS:
        codec = _STRUCTS[cls] = _Struct(cls)
        hints = get_type_hints(cls, include_extras=True)
        codec.fields = {f.name: _codec_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return _STRUCTS[cls]


_TENSOR_REF = _struct_codec(TensorRef)
assert _TENSOR_REF.fields["dtype"].choices == tuple(DTYPES), "TensorRef.dtype lists DTYPES"
_MESSAGE_CODECS = {code: _struct_codec(cls) for code, cls in MESSAGE_CLASSES.items()}


# ----------------------------------------------------------------------------------------------
# Tensors


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


def _check_tensor_spec(dtype: str, shape: Sequence[int], spec: TensorOf, path: str) -> None:
    if dtype not in spec.dtypes:
        raise WireError(f"{path}: dtype {dtype} not allowed here, expected one of {spec.dtypes}")
    ndim = len(shape)
    if (spec.ndim is not None and ndim != spec.ndim) or ndim > MAX_TENSOR_DIMS:
        raise WireError(f"{path}: tensor of {ndim} dims, expected {spec.ndim or 'at most 8'}")
    if any(size < 0 for size in shape):
        raise WireError(f"{path}: negative size in shape {list(shape)}")


def _sendable(value: Any, spec: TensorOf) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise WireError(f"expected a torch.Tensor, got {_type_name(value)}")
    if value.device.type != "cpu":
        raise WireError(f"tensors are sent from CPU memory, got one on {value.device}")
    if value.dtype not in _DTYPE_NAMES:
        raise WireError(f"dtype {value.dtype} cannot be sent")
    _check_tensor_spec(_DTYPE_NAMES[value.dtype], value.shape, spec, "tensor")
    return value.detach().contiguous()  # no copy when already contiguous


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes. Viewed as uint8 first, because numpy
    has no bfloat16; the view owns a reference to the storage (memoryview -> ndarray -> tensor)."""
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _tensor_from_buffer(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if buf.readonly:
        buf = memoryview(bytearray(buf))  # one copy: a tensor must not alias immutable bytes
    tensor = torch.frombuffer(buf, dtype=dtype)  # holds a reference to buf (and its frame)
    if tensor.data_ptr() % tensor.element_size():
        tensor = tensor.clone()  # tiny zmq messages live unaligned inside zmq_msg_t
    return tensor.view(shape)


# ----------------------------------------------------------------------------------------------
# Encoding and decoding


def encode(msg: Message) -> list[bytes | memoryview]:
    """The frames of `msg`. Tensor frames are views of the tensors' memory and keep it alive;
    send with `socket.send_multipart(frames, copy=False)` and leave the tensors unmodified."""
    if not isinstance(msg, Message):
        raise WireError(f"not a message: {_type_name(msg)}")
    tensors: list[torch.Tensor] = []
    fields = _MESSAGE_CODECS[msg.TYPE].to_wire(msg, tensors)
    try:
        header = msgpack.packb(fields, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as e:
        raise WireError(f"{type(msg).__name__}: cannot pack header: {e}") from e
    if len(header) > MAX_HEADER_BYTES:
        raise WireError(f"{type(msg).__name__}: header of {len(header)} bytes exceeds the limit")
    frames: list[bytes | memoryview] = [bytes((msg.TYPE,)), header]
    for tensor in tensors:
        view = _tensor_bytes(tensor)
        if view.nbytes > MAX_MESSAGE_BYTES:
            raise WireError(f"{type(msg).__name__}: tensor frame of {view.nbytes} bytes too large")
        frames.append(view)
    return frames


def _as_view(frame: FrameLike) -> memoryview:
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


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


def _refuse_ext(code: int, data: bytes) -> None:
    raise WireError(f"msgpack extension type {code} is not allowed")


def _unpack_header(view: memoryview) -> Any:
    if view.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {view.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,  # called for every ext, so none gets through
            # Any string fits in the header's bytes; each field's codec then checks its own
            # limit in characters (UTF-8 is up to 4 bytes per character).
            max_str_len=MAX_HEADER_BYTES,
            max_bin_len=0,  # no field is binary; tensors travel in their own frames
            max_array_len=MAX_TOKEN_IDS,
            max_map_len=64,  # more than any message's field count
        )
    except WireError:
        raise
    except Exception as e:  # untrusted bytes: any failure of the unpacker is the sender's fault
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None


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
    msg = _MESSAGE_CODECS[code].from_wire(fields, name, ctx)
    unclaimed = set(range(2, len(frames))) - ctx.claimed
    if unclaimed:
        raise WireError(f"{name}: frames {sorted(unclaimed)} are not named by any tensor field")
    return msg


# ----------------------------------------------------------------------------------------------
# Sockets. ROUTER helpers expect DEALER peers: [identity, type, header, tensors...], no delimiter.


def send(socket: zmq.Socket, msg: Message) -> None:
    socket.send_multipart(encode(msg), copy=False)


def recv(socket: zmq.Socket) -> Message:
    return decode(socket.recv_multipart(copy=False))


def send_to(socket: zmq.Socket, identity: bytes, msg: Message) -> None:
    socket.send_multipart([identity, *encode(msg)], copy=False)


def recv_from(socket: zmq.Socket) -> tuple[bytes, Message]:
    identity, *frames = socket.recv_multipart(copy=False)
    return identity.bytes, _decode_from(identity.bytes, frames)


async def async_send(socket: zmq.asyncio.Socket, msg: Message) -> None:
    await socket.send_multipart(encode(msg), copy=False)


async def async_recv(socket: zmq.asyncio.Socket) -> Message:
    return decode(await socket.recv_multipart(copy=False))


async def async_send_to(socket: zmq.asyncio.Socket, identity: bytes, msg: Message) -> None:
    await socket.send_multipart([identity, *encode(msg)], copy=False)


async def async_recv_from(socket: zmq.asyncio.Socket) -> tuple[bytes, Message]:
    identity, *frames = await socket.recv_multipart(copy=False)
    return identity.bytes, _decode_from(identity.bytes, frames)


def _decode_from(identity: bytes, frames: Sequence[FrameLike]) -> Message:
    try:
        return decode(frames)
    except WireError as e:
        raise WireError(f"from peer {identity!r}: {e}") from None
