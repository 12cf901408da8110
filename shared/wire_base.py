"""The wire's vocabulary: limits, the field types every conversation uses (bounded strings and
lists, tensors, sampling parameters, token deltas), the one-byte message codes and the base of
every message. The messages themselves live with their conversation (`shared.wire` lists them);
how they are encoded is `shared.wire_codec`.
"""

from __future__ import annotations

import array
import enum
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, ClassVar, Literal

import zmq

SCHEMA_VERSION = 18  # 3: prefix cache fields, bulk submits; 4: structured-output constraints;
# 5: the heartbeat's step time, bulk prefill jobs and transfers, speculative prefill; 6: the
# submit's first-token deadline; 7: the status's prompt-token pace; 8: token positions, and the
# first token carried with the KV; 9: where a stream ended, told its gateway by the scheduler;
# 10: the sampling's logit bias; 11: prompts and outputs as packed int32 token ids; 12: prompt
# logprobs (the sampling's ask, the first delta's answer), the RPC's tokenizer calls; 13: the
# RPC's `waiting` event (the gateway's probe of a client whose calls wait); 14: the reserve
# reply's peer id (a late reply from a worker since passed over is told apart); 15: a worker's
# GOODBYE as it stops; 16: the batch link's `metrics` op (the batch conversation has no HELLO:
# a batch service older than its gateway drops the call, and shows as not scraped); a tensor
# over several frames (`TensorRef.num_frames`: a long prompt's KV on a big model); the attempt a
# RESERVE and its reply name; 17: the constraint `answer_or_calls` (a response format or tool
# calls: a worker of 16 would refuse it); 18: the status's largest decode pool (a default
# max_tokens the gateway caps to it)
MAX_MESSAGE_BYTES = 256 << 20  # per frame; services set it as zmq.MAXMSGSIZE on their sockets
# A tensor larger than a frame travels in consecutive frames (a long prompt's KV: Llama-3-8B's
# keys in bfloat16 are 128 KiB a token, one frame's worth at 2,048 tokens).
MAX_TENSOR_BYTES = 64 << 30
MAX_HEADER_BYTES = 16 << 20
MAX_RECENT_STEPS = 256  # step batch sizes a heartbeat carries
MAX_HELD_IDS = 8192  # request ids a heartbeat carries
MAX_TOKEN_IDS = 1 << 20  # a prompt (or prompt + output) of up to a million tokens
MAX_REQUEST_ID_LEN = 128
MAX_STR_LEN = 4096  # any other string
MAX_JSON_LEN = 8 << 20  # an RPC call's JSON body or event (the HTTP API's body limit)
MAX_LIST_LEN = 4096  # any other list
MAX_TENSOR_DIMS = 8
MAX_COUNT = 1 << 40  # any count a worker reports (tokens, blocks, steps): centuries of steps
MAX_CONSTRAINT_CHARS = 64 << 10  # a schema, regex or grammar (the engine's cap)

# The dtypes a tensor frame may hold, by their header name (torch's name for each).
DTYPE_NAMES = ("float32", "float16", "bfloat16", "int64", "int32", "uint8")

if TYPE_CHECKING:
    from torch import Tensor
else:

    class Tensor:
        """`torch.Tensor` in the messages' annotations without importing torch (a scheduler,
        a planner and a client never touch a tensor): the codec frames a field of this type as
        a tensor, and imports torch when one is sent or received."""


FrameLike = bytes | memoryview | zmq.Frame  # what decode accepts per frame


class WireError(ValueError):
    """A message that cannot be decoded (or encoded). Receivers log it and drop the message."""


@dataclass(frozen=True)
class MaxLen:
    """Annotation metadata: the most characters (str) or entries (list) a field may hold."""

    value: int


@dataclass(frozen=True)
class Range:
    """Annotation metadata: the least and the most an int field may be (both included)."""

    low: int
    high: int


@dataclass(frozen=True)
class TensorOf:
    """Annotation metadata: the dtypes (header names) and number of dimensions a tensor may have."""

    dtypes: tuple[str, ...] = DTYPE_NAMES
    ndim: int | None = None  # None: any, up to MAX_TENSOR_DIMS


@dataclass(frozen=True)
class PackedInt32:
    """Annotation metadata: a sequence of ints carried as one MessagePack bin of little-endian
    int32s and decoded to a `TokenArray`."""


class TokenArray(array.array):
    """Token ids as the wire decodes a prompt or an output: C int32s in one buffer, 4 bytes a
    token. As a list they cost 8 bytes of pointer and a ~32-byte int object each, and the
    scheduler holds every queued prompt (1.6 GiB of token ids at 100,000 queued of ~415) and
    decoded and checked them one by one (a 32,768-token SUBMIT: 0.95 ms). Equal to a list or
    tuple of the same ids, so that a message equals itself whichever form its sender built it
    with; slices are plain arrays. The collector visits one (a subclass is tracked) but none of
    its ids: they are not objects."""

    __slots__ = ()

    def __new__(cls, ids: Iterable[int] = ()) -> TokenArray:
        return super().__new__(cls, "i", ids)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, array.array):
            return array.array.__eq__(self, other)
        if isinstance(other, (list, tuple)):
            return self.tolist() == list(other)
        return NotImplemented

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = None  # type: ignore[assignment]  # mutable, as a list


if array.array("i").itemsize != 4:  # C's int: 4 bytes on every platform CPython builds for
    raise ImportError("the wire packs token ids as int32, and this platform's C int is not")


RequestId = Annotated[str, MaxLen(MAX_REQUEST_ID_LEN)]
# A prompt or an output: any sequence of ints within int32 when sent (a list, a tuple, an
# array), a `TokenArray` when received.
TokenIds = Annotated[Sequence[int], MaxLen(MAX_TOKEN_IDS), PackedInt32()]
# One token id in a list (a delta's new tokens): within int32, as a prompt's, so that what a
# gateway was streamed it can send again (a resumed request's output).
TokenId = Annotated[int, Range(-(2**31), 2**31 - 1)]
# A worker's count of tokens, blocks, sequences or steps. MessagePack carries any int up to
# 2**64 - 1; bounded, a count fits the scheduler's C indexes, and the cluster's sums of them
# fit the status it encodes again.
Count = Annotated[int, Range(0, MAX_COUNT)]
Role = Literal["gateway", "prefill", "decode"]
Phase = Literal["prefill", "decode"]
KvBlocks = Annotated[Tensor, TensorOf(ndim=5)]
GeneratorState = Annotated[Tensor, TensorOf(dtypes=("uint8",), ndim=1)]
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
    PREFILL_GRANT = 18
    STREAM_ENDED = 19
    GOODBYE = 20


# ----------------------------------------------------------------------------------------------
# Nested map types (not messages)


@dataclass(frozen=True, slots=True, kw_only=True)
class TensorRef:
    """How a header names a tensor: its bytes, C-contiguous, native order, are frame `frame`,
    or frames `frame` to `frame + num_frames - 1` in order when it is larger than a frame
    carries (each then `MAX_MESSAGE_BYTES`, the last the rest)."""

    dtype: Literal["float32", "float16", "bfloat16", "int64", "int32", "uint8"]
    shape: Annotated[list[int], MaxLen(MAX_TENSOR_DIMS)]
    frame: int  # >= 2; each tensor frame is named by exactly one TensorRef
    num_frames: int = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ConstraintSpec:
    """A structured-output constraint (`shared.engine.constraint.Constraint`) on the wire."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar", "answer_or_calls"]
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
    prompt_logprobs: int | None = None  # the prompt tokens' too (with their top n); None: not
    ignore_eos: bool = False  # keep generating past EOS
    min_tokens: int = 0  # EOS and stop tokens suppressed until this many tokens
    stop_token_ids: list[int] = field(default_factory=list)  # finish on any of these
    constraint: ConstraintSpec | None = None  # what the output must match (structured output)
    logit_bias: list[tuple[int, float]] = field(default_factory=list)  # (token id, added logit)


@dataclass(frozen=True, slots=True, kw_only=True)
class TokenDelta:
    """One request's new tokens from one engine step."""

    request_id: RequestId
    token_ids: list[TokenId]  # new tokens, in order (usually one)
    logprobs: list[float] | None = None  # per new token the chosen token's logprob, if asked
    # per new token its top-n (token id, logprob), best first, if asked with logprobs >= 1;
    # each id within int32 as `token_ids`' (the gateway decodes it to text)
    top_logprobs: list[list[tuple[TokenId, float]]] | None = None
    # On the first token's delta, when asked (`prompt_logprobs`): each prompt token's logprob
    # but the first's (it has none), and their top n as `top_logprobs`. As long as a prompt.
    prompt_logprobs: Annotated[list[float], MaxLen(MAX_TOKEN_IDS)] | None = None
    prompt_top_logprobs: (
        Annotated[list[list[tuple[TokenId, float]]], MaxLen(MAX_TOKEN_IDS)] | None
    ) = None
    # "stop", "length" or "abort" on the request's last delta; "lost" when the worker holding
    # it is gone (its gateway resumes it elsewhere from the tokens it has, or fails it);
    # "timeout" (with `error`) when it waited past a limit, such as the queue's; "preempted"
    # when its decode worker handed it back for recompute (resumed like "lost", not counted).
    finish_reason: str | None = None
    error: str | None = None  # set when the request failed; the gateway answers with it
    # On a prefill's first delta: prompt tokens whose computation its prefix cache skipped
    # (never KV received over the wire); None from decode steps.
    num_cached_tokens: int | None = None
    # The position of token_ids[0] in the request's output (the tokens a resumed attempt was
    # given count), so the gateway drops what it has and sees what it lacks: two workers stream
    # one request (the first token from prefill, the rest from decode) on two connections.
    # None on the scheduler's deltas, which carry no tokens.
    index: int | None = None


# ----------------------------------------------------------------------------------------------
# Messages


class Message:
    """Base of every message; `TYPE` is its code in frame 0."""

    __slots__ = ()
    TYPE: ClassVar[MessageType]
