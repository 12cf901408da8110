"""A request's path: gateway -> scheduler (SUBMIT, CANCEL), scheduler -> decode worker (RESERVE)
and prefill worker (PREFILL_JOB), workers -> gateway (TOKENS) and -> scheduler (REQUEST_DONE).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from shared.wire_base import (
    Count,
    Message,
    MessageType,
    Phase,
    RequestId,
    SamplingSpec,
    TokenDelta,
    TokenIds,
)


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
    # Seconds from now the gateway waits for the first token before it gives up (504): the
    # scheduler refuses at once a request it forecasts to wait longer. None: no deadline.
    first_token_deadline_s: float | None = None


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
    num_tokens: Count  # tokens whose K/V will arrive (blocks = ceil(num_tokens / block_size))
    lease_s: float  # the reservation lapses unless the KV arrives within this many seconds
    # The tokens whose K/V will arrive and their cache salt: the worker holds (pins) the leading
    # full blocks it has cached, and only the rest is sent. Empty: no lookup.
    token_ids: TokenIds = field(default_factory=list)
    cache_salt: str | None = None
    # Which of the request's reservations this is (1, 2, ...): a worker asked again after a
    # timeout may answer both, in either order, and the reply names the one it answers.
    attempt: Count = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class ReserveReply(Message):
    """Decode worker -> scheduler, answer to RESERVE."""

    TYPE: ClassVar[MessageType] = MessageType.RESERVE_REPLY
    request_id: RequestId
    peer_id: str  # the answering worker: a late answer from one since passed over is dropped
    ok: bool  # blocks held for the lease
    num_free_blocks: Count  # free blocks after the reservation (or now, when refused)
    num_cached_blocks: Count = 0  # leading blocks of the KV it holds already (pinned for the lease)
    attempt: Count = 0  # the RESERVE's, echoed; 0: it names none (taken for the current one)


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
    bulk: bool = False  # a batch job's line: a worker queues it after interactive prompts
    # Separates prefix cache entries: only prompts with the same salt (the tenant, unless the
    # cluster shares its cache between tenants) share cached blocks. None: the shared space.
    cache_salt: str | None = None
    # Leading blocks of the KV the decode worker holds already (its ReserveReply): not sent.
    num_skip_blocks: int = 0
    # Speculative: sent while the decode worker's reservation is still in flight. The prefill
    # runs and its first token streams at once; the KV waits for a PrefillGrant (or a Cancel).
    await_grant: bool = False


@dataclass(frozen=True, slots=True, kw_only=True)
class PrefillGrant(Message):
    """Scheduler -> prefill worker: the decode worker reserved room for a speculative job; ship
    its KV, less the leading blocks the decode worker holds already."""

    TYPE: ClassVar[MessageType] = MessageType.PREFILL_GRANT
    request_id: RequestId
    num_skip_blocks: int = 0


@dataclass(frozen=True, slots=True, kw_only=True)
class Tokens(Message):
    """Worker -> gateway (PUSH to its PULL): one message per engine step per gateway."""

    TYPE: ClassVar[MessageType] = MessageType.TOKENS
    deltas: list[TokenDelta]  # one per request of this gateway that advanced in the step


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestDone(Message):
    """Worker -> scheduler: a request left this worker (finished, aborted or handed on)."""

    TYPE: ClassVar[MessageType] = MessageType.REQUEST_DONE
    request_id: RequestId
    peer_id: str  # the reporting worker
    phase: Phase  # prefill: KV handed to decode; decode: generation over
    finish_reason: str | None  # None when the prefill phase ends normally
    num_prompt_tokens: Count
    num_output_tokens: Count  # tokens generated on this worker
    num_cached_tokens: Count = 0  # prefill phase: prompt tokens its prefix cache spared computing
    # Where the request's stream ended, when it ended here (finished, or refused): the output's
    # length, a resumed attempt's given tokens included. None when it went on elsewhere.
    output_length: Count | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamEnded(Message):
    """Scheduler -> gateway: a worker ended this request's stream at `output_length` tokens,
    for `finish_reason`. The stream says so too, on another connection and usually first; this
    copy lets a gateway whose stream lost its last delta (a connection cut as it was sent)
    finish or resume the request instead of waiting for its time limit."""

    TYPE: ClassVar[MessageType] = MessageType.STREAM_ENDED
    request_id: RequestId
    finish_reason: str
    output_length: int
