"""Peers and the scheduler: joining (HELLO), liveness and load (HEARTBEAT), and the cluster at a
glance that the scheduler sends gateways (CLUSTER_STATUS, with its per-party and per-worker maps).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, ClassVar, Literal

from shared.wire_base import (
    MAX_HELD_IDS,
    MAX_RECENT_STEPS,
    MAX_TOKEN_IDS,
    Count,
    MaxLen,
    Message,
    MessageType,
    RequestId,
    Role,
)


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


@dataclass(frozen=True, slots=True, kw_only=True)
class Goodbye(Message):
    """Worker -> scheduler, as it stops (SIGTERM: a scale-down, a rolling restart): it leaves
    rotation now and what it held is re-routed, where the scheduler would have sent it work
    and found it silent only a heartbeat timeout later (10 s of stalled streams)."""

    TYPE: ClassVar[MessageType] = MessageType.GOODBYE
    peer_id: str


# HelloAck.error when the scheduler hears from a peer it does not know (it restarted, or took the
# peer for dead): the peer says HELLO again.
UNKNOWN_PEER = "unknown peer: say HELLO again"


@dataclass(frozen=True, slots=True, kw_only=True)
class Heartbeat(Message):
    """Worker -> scheduler, periodically: liveness, load, and progress (honest health)."""

    TYPE: ClassVar[MessageType] = MessageType.HEARTBEAT
    peer_id: str
    num_waiting: Count  # sequences queued, not yet running
    num_running: Count  # sequences in the running batch
    num_free_blocks: Count  # free KV blocks (not reserved, not in use, not claimed by preempted)
    num_total_blocks: Count
    steps_completed: Count  # engine steps since start; stuck while busy means unhealthy
    sent_at: float  # sender's wall clock (time.time()), seconds
    num_swapped: Count = 0  # preempted sequences whose KV waits in host memory
    num_swap_preemptions: Count = 0  # since start: sequences swapped out to make room
    num_recompute_preemptions: Count = 0  # since start: sequences dropped to be recomputed
    # The requests it holds state for (reservations, jobs, transfers, sequences): the lease
    # check. The scheduler cancels any it has given up on, in case that cancel went astray.
    request_ids: Annotated[list[RequestId], MaxLen(MAX_HELD_IDS)] = field(default_factory=list)
    # Sequences in each engine step since the last heartbeat, oldest first (the batch picture).
    recent_batch_sizes: Annotated[list[Count], MaxLen(MAX_RECENT_STEPS)] = field(
        default_factory=list
    )
    # Prefix cache events (block hashes) since the previous heartbeat. Heartbeats are numbered
    # 1, 2, ... from HELLO on: a number skipped means events were lost, and the scheduler
    # forgets the worker's set until the next full one (the first, then every few seconds).
    cache_events_seq: Count = 0  # 0: the worker keeps no prefix cache
    cache_full: bool = False  # cache_stored is the worker's whole set, not a change
    cache_stored: Annotated[list[int], MaxLen(MAX_TOKEN_IDS)] = field(default_factory=list)
    cache_evicted: Annotated[list[int], MaxLen(MAX_TOKEN_IDS)] = field(default_factory=list)
    num_prefix_query_tokens: Count = 0  # since start: prompt tokens looked up in the cache
    num_prefix_hit_tokens: Count = 0  # since start: of them, found (their computation skipped)
    prefill_tokens_per_s: float = 0.0  # the engine's measured prefill rate (0: not yet)
    step_s: float = 0.0  # its engine steps' recent duration (moving average), seconds; 0: none


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
    # The largest decode worker's KV pool, in tokens (0: none): a request's prompt plus its
    # max_tokens fit no more, and a gateway caps a max_tokens the client left out to it.
    max_decode_pool_tokens: int = 0
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
    # The wait forecast: first tokens, and their prompt tokens (its pace), a second while the
    # queue is backlogged (0: not known yet), and the requests it refused since the scheduler
    # started.
    first_tokens_per_s: float = 0.0
    prompt_tokens_per_s: float = 0.0
    num_refused_past_deadline: int = 0


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
