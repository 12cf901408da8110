"""The scheduler's decisions, as a pure state machine: events in, messages out, the clock passed in.

A request moves through phases:

    QUEUED ──RESERVE sent──▶ RESERVING ──blocks reserved──▶ PREFILLING ──KV acknowledged──▶ DECODING
       ▲                         │                              │
       └──── refused, timed out, or a worker left ◀─────────────┘

Speculative prefill: a decode worker answers a reservation between its steps, so behind a big
batch the first token would wait for a step it has nothing to do with. When the decode worker is
busy, has room to spare, and would not prefill the prompt itself (by what the index says it
holds), the prefill job goes out with the reservation (`await_grant`): the prefill runs and its
first token streams at once, and the KV waits at the prefill worker for a PREFILL_GRANT that
follows the reservation's confirmation and carries the blocks the decode worker holds. From
then on its first token may have reached the client, so a refusal, a timeout or a lost worker
hands it back to its gateway to resume (as after PREFILLING), never to the queue, which would
send the first token twice.

Admission bounds the queue by requests and by prompt tokens (past either, 429 with Retry-After),
refuses an interactive request forecast to wait too close to its gateway's first-token deadline
(429; `wait_forecast.py`), and a prompt no decode worker could ever hold (400). The queue is
ordered by the fair-share policy (`fair_share.py`; FCFS as a switch). Requests stay in the
scheduler's queue until a prefill worker has room in its window (`PrefillWindow`: one big prompt
and a few steps' worth of small ones in hand): the policy decides, not the order in which
workers happen to receive work.
Dispatch takes the policy's next request that a prefill window and a decode worker can take, asks
that decode worker to reserve blocks for the prompt, and once it confirms, hands the prompt to the
chosen prefill worker, naming the decode target. A request whose reservation is refused, or
whose worker stops sending heartbeats before its KV reached the decode worker, goes back to the
queue with its original arrival time (its prompt's charge refunded); one whose decode worker dies
mid-stream is failed with an error to its gateway. Cancels are forwarded to every worker holding
state for the request. The requests an earlier life of the scheduler left decoding are adopted
from their decode workers' heartbeats (`adopted.py`): when such a worker leaves, every gateway is
told they are lost, and the one running them resumes them.
"""

from __future__ import annotations

import enum
import heapq
import itertools
import math
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

from services.scheduler import lazy_heap
from services.scheduler.adopted import AdoptedRequests
from services.scheduler.awaiting_workers import SubmitsAwaitingWorkers
from services.scheduler.cache_holders import CacheHolders
from services.scheduler.cache_placement import CachePlacement, prefill_tokens
from services.scheduler.cache_routing import RoutingWeights, routing_rate, routing_step_s
from services.scheduler.candidates import prefill_candidates
from services.scheduler.decode_fit import DecodeFitAdmission
from services.scheduler.fair_share import (
    FairQueue,
    FairShareConfig,
    LengthRanges,
    Party,
    QueuedRequest,
)
from services.scheduler.native_indexes import check_choice
from services.scheduler.registry import DISCONNECT_GRACE_S, WorkerRegistry, WorkerState
from services.scheduler.wait_forecast import (
    DEADLINE_SHARE,
    InHand,
    ServiceRate,
    queued_work,
    refusal_for_deadline,
)
from services.scheduler.worker_index import (  # PrefillWindow: its home was here
    BULK_SEAT_SHARE,
    BULK_WINDOW_SHARE,
    PrefillWindow,  # noqa: F401
)
from shared import wire

MAX_ABANDONED = 65536  # request ids remembered as given up on, for the heartbeats' lease check
MAX_DROPPED_WORKERS = 4096  # decode workers remembered with the reservations they were dropped with
MAX_GONE_GATEWAYS = 64  # gateways remembered with the requests called off when they were gone
LOST_DELTAS_PER_MESSAGE = 1024  # (a gateway back is told of its requests lost in messages this big)
MAX_PARTIES_SHOWN = 256  # the status lists at most this many tenant/class accounts
# A SUBMIT's priority: an int32, as the gateway's API takes it (the fair queue's C index keeps
# it in 64 bits; the wire takes any int).
PRIORITY_MIN, PRIORITY_MAX = -(2**31), 2**31 - 1
T = TypeVar("T")
NOTHING_PLACEABLE = LengthRanges()  # shared: treated as frozen, and the usual answer under load

# Heartbeats of its decode worker that may leave out a decoding request (of its prefill worker,
# a prefilling one) before it is taken as ended unheard. One can be stale: sent before the
# worker took the KV, it may arrive after the prefill worker's report of the handoff (another
# connection); sent before a prefill job arrived, after the scheduler sent it. Two cannot.
UNLISTED_BEATS = 2


class Phase(enum.IntEnum):
    QUEUED = 0
    RESERVING = 1
    PREFILLING = 2
    DECODING = 3


# The limits that are shares of something, each in (0, 1].
SHARES = ("deadline_share", "bulk_window_share", "bulk_seat_share")
# Durations, each positive (infinite: never). A NaN one made deadlines NaN: one atop the heap of
# deadlines stopped the tick at it, and no reservation or prefill timed out again.
DURATIONS = (
    "heartbeat_timeout_s",
    "disconnect_grace_s",
    "progress_timeout_s",
    "reserve_timeout_s",
    "prefill_timeout_s",
    "max_queue_time_s",
)
# Counts of requests or tokens, each at least 1 (0 refused every request, or took none).
COUNTS = ("max_queued_requests", "max_queued_tokens", "prefill_window_tokens")


@dataclass(frozen=True)
class SchedulerLimits:
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    heartbeat_timeout_s: float = 10.0
    # A worker's connection closed (its process exited): gone unless it beats again this soon.
    disconnect_grace_s: float = DISCONNECT_GRACE_S
    progress_timeout_s: float = 60.0  # busy without completing a step: stuck (see registry)
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0  # prompt compute plus KV transfer, on a CPU
    max_queue_time_s: float = 600.0  # longer in the queue: failed with a timeout, not kept
    retry_after_s: float = 1.0
    prefill_window_tokens: int = 2048  # prompt tokens in hand per prefill worker (see above)
    bulk_window_share: float = BULK_WINDOW_SHARE  # ... of which batch lines may fill this share
    bulk_seat_share: float = BULK_SEAT_SHARE  # and of a decode worker's seats, this share
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    routing: RoutingWeights = field(default_factory=RoutingWeights)  # prefill choice by cache
    # Conditional disaggregation: a decode worker holding all but at most this many of a
    # prompt's tokens prefills them itself, and no KV crosses the wire (0: never).
    local_prefill_max_tokens: int = 256
    speculative_prefill: bool = True  # a busy decode worker's reservation off the TTFT path
    # Refuse (429) an interactive request whose forecast wait comes too close to its gateway's
    # first-token deadline, instead of queueing it to time out (`wait_forecast.py`).
    refuse_past_deadline: bool = True
    deadline_share: float = DEADLINE_SHARE  # ... once the forecast passes this share of it
    # The queue's and the decode room's indexes: C where it builds (`auto`), C or fail
    # (`native`), or `python`. The same decisions either way (`native_indexes.py`).
    indexes: str = "auto"

    def __post_init__(self) -> None:
        for name in SHARES:
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        for name in DURATIONS:
            if not getattr(self, name) > 0:  # (NaN fails it too)
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        for name in COUNTS:
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if not 0 < self.retry_after_s < math.inf:  # what a refusal's Retry-After says
            raise ValueError(f"retry_after_s must be positive and finite, got {self.retry_after_s}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(
                f"local_prefill_max_tokens must be >= 0 (0: never), "
                f"got {self.local_prefill_max_tokens}"
            )
        check_choice(self.indexes)


class TrackedRequest:
    """A request from its SUBMIT to its end, as the core follows it. A class with its own
    `__init__`, not a dataclass: mypyc compiles this one to C, where it runs a dataclass's
    generated `__init__` as Python, and the core makes one per request."""

    def __init__(
        self,
        submit: wire.Submit,
        gateway_peer_id: str,
        party: Party,  # the fair-share account it is charged to
        arrival: float = 0.0,  # the scheduler's clock when it was first queued (it ages from)
        index: int = 0,  # its place among the requests admitted: the order a tick handles them in
    ) -> None:
        self.submit = submit
        self.gateway_peer_id = gateway_peer_id
        self.party = party
        self.arrival = arrival
        # When it last entered the queue (a requeue's time, not its arrival): its queue time
        # for the metrics counts from here, so a request queued twice is not counted for the
        # time it spent reserving or prefilling in between.
        self.queued_at = arrival
        self.index = index
        self.phase = Phase.QUEUED
        self.decode_peer_id: str | None = None
        self.prefill_peer_id: str | None = None
        self.phase_deadline = math.inf
        self.num_blocks = 0  # blocks reserved on the decode worker
        self.num_predicted_cached_tokens = 0  # where its prefill went, as the prefix index knew
        self.speculative = False  # its prefill job went out with the reservation (await_grant)
        self.num_unlisted_beats = 0  # heartbeats in a row of its worker that left it out
        self.last_unlisted_beat = -2  # the worker's heartbeat number of the last that did
        self.num_charged_tokens = 0  # what its last dispatch charged its party: a requeue's refund
        self.num_reserves = 0  # RESERVEs sent for it: the attempt the last one named
        # Placed as a batch line (yielding to interactive work on its workers): a bulk request
        # younger than `bulk_max_wait_s` when dispatched. An older one competes as interactive.
        self.placed_as_bulk = submit.bulk
        # Read off the SUBMIT (which never changes) once: every decision asks them several times.
        self.request_id = submit.request_id
        self.num_prefill_tokens = num_prefill_tokens(submit)
        # The most its sequence may hold on a decode worker, whose pool must hold it all.
        self.num_needed_tokens = len(submit.prompt_token_ids) + submit.sampling.max_tokens

    @property
    def prefill_began(self) -> bool:
        """A prefill worker holds it, and its first token may have reached the client."""
        return self.phase >= Phase.PREFILLING or self.speculative


def remember(
    memory: OrderedDict[str, list[str]], peer_id: str, request_ids: list[str], bound: int
) -> None:
    """Adds `request_ids` to what `memory` keeps for the peer, a bounded memory of peers gone
    (`dropped_reservations`, `gone_gateways`): the peer's entry is its newest, and past `bound`
    peers those gone longest ago are forgotten."""
    memory.setdefault(peer_id, []).extend(request_ids)
    memory.move_to_end(peer_id)
    while len(memory) > bound:
        memory.popitem(last=False)


def ended_delta(request_id: str, finish_reason: str, error: str) -> wire.TokenDelta:
    """A delta with no tokens that ends a request's attempt so, with the error."""
    return wire.TokenDelta(
        request_id=request_id, token_ids=[], finish_reason=finish_reason, error=error
    )


def num_prefill_tokens(submit: wire.Submit) -> int:
    """What a prefill worker computes: the prompt, and the tokens a resumed request has."""
    return len(submit.prompt_token_ids) + len(submit.output_token_ids)


@dataclass
class GatewayState:
    peer_id: str
    identity: bytes
    address: str | None


class Dispatched:
    """A request handed on: for the service's log line and queue-time metric. (Its own
    `__init__`, as `Outgoing`'s: one per decision. Treated as frozen.)"""

    __slots__ = ("request_id", "queue_s", "prefill_peer_id", "decode_peer_id", "speculative")

    def __init__(
        self,
        request_id: str,
        queue_s: float,
        prefill_peer_id: str,
        decode_peer_id: str,
        speculative: bool = False,  # the prefill job went with the reservation
    ) -> None:
        self.request_id = request_id
        self.queue_s = queue_s
        self.prefill_peer_id = prefill_peer_id
        self.decode_peer_id = decode_peer_id
        self.speculative = speculative


class Outgoing:
    """A message and the identity of the peer it goes to. (Its own `__init__`: a dataclass's
    runs as Python under mypyc, and a request's life sends about five.)"""

    __slots__ = ("identity", "message")

    def __init__(self, identity: bytes, message: wire.Message) -> None:
        self.identity = identity
        self.message = message

    def __repr__(self) -> str:
        return f"Outgoing(identity={self.identity!r}, message={self.message!r})"


class AgedBulkAdmission:
    """Which queued requests dispatch can place now, while a batch line that has waited
    `bulk_max_wait_s` is queued. Such a line competes as interactive (`fair_share.py`), so it
    takes an interactive request's room, a window's and a decode worker's seat, not a batch
    line's: a stream of interactive work can keep every window past the bulk share, and every
    decode worker past its bulk seats, for good. The rest go by `lengths`. (Its own
    `__init__`, as `Outgoing`'s: compiled code runs a dataclass's as Python. Treated as frozen.)
    """

    __slots__ = ("lengths", "promise", "now", "bulk_max_wait_s")

    def __init__(self, lengths: LengthRanges, now: float, bulk_max_wait_s: float) -> None:
        self.lengths = lengths
        # What the choice may pass over whole parties and classes by (`LengthRanges`): a
        # batch line's lengths are a young line's or an aged one's.
        self.promise = LengthRanges(lengths.interactive, lengths.bulk + lengths.interactive)
        self.now = now
        self.bulk_max_wait_s = bulk_max_wait_s

    def __call__(self, item: QueuedRequest) -> bool:
        if item.bulk and self.now - item.arrival >= self.bulk_max_wait_s:  # (as the policy)
            n = item.num_prompt_tokens
            return self.lengths.meet(False, n, n)  # an interactive request's room
        return self.lengths(item)


def each(items: list[T], handle: Callable[[T], None]) -> None:
    """Calls `handle` on every item, past any whose handling raises (a bug: the core's refusals
    are answers, never raised), then raises the first exception: one request's failure in a
    pass over many does not strand the others."""
    first: Exception | None = None
    for item in items:
        try:
            handle(item)
        except Exception as error:
            if first is None:
                first = error
    if first is not None:
        raise first


@dataclass
class ClusterScheduler:
    limits: SchedulerLimits
    registry: WorkerRegistry = field(init=False)
    gateways: dict[str, GatewayState] = field(default_factory=dict)
    requests: dict[str, TrackedRequest] = field(default_factory=dict)
    queue: FairQueue = field(init=False)
    num_queued_tokens: int = 0
    max_queue_wait_s: float = 0.0  # the longest any dispatched request waited in the queue
    # Requests given up on (cancelled, lost, timed out), most recent last: a worker still
    # holding one after its cancel went astray is told again (see `on_heartbeat`). Ordered so
    # that the oldest leaves in O(1): a plain dict's first key is found by a scan past every
    # slot its deletions left empty at the front, up to 65,536 of them (13 us a request).
    abandoned: OrderedDict[str, None] = field(default_factory=OrderedDict)
    # Decode workers dropped while they held reservations of requests sent back to the queue,
    # by peer id, with those requests, oldest first. The cancel sent at the drop may never have
    # reached the worker (its link down past the service's hold of undelivered messages), and a
    # decode worker that registers again keeps its reservations until their lease: asked again
    # for the request, it refused it as a duplicate, and each refusal's requeue asked it again.
    # Told again at its HELLO, before any new RESERVE (`on_hello`). The heartbeats' check
    # (`abandoned`) misses these: the requests are still tracked.
    dropped_reservations: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)
    # Gateways taken for gone (`on_gateway_gone`), by peer id, with the requests called off
    # then, oldest first: one that comes back under that id (a cut past the heartbeat timeout,
    # not a death) is told they were lost, and resumes them (`_tell_lost_while_gone`).
    gone_gateways: OrderedDict[str, list[str]] = field(default_factory=OrderedDict)
    # Dispatches since the service last took them (`take_dispatched`).
    dispatched: list[Dispatched] = field(default_factory=list)
    # Messages built and not yet handed out: every message a handler makes goes here the
    # moment its decision is taken, and the handler returns them all (`take_outbox`). Should a
    # handler raise midway (a bug), what it had decided for other requests before is still
    # here for the service to send, not lost with the exception.
    outbox: list[Outgoing] = field(default_factory=list)
    # Requests whose placement raised in a dispatch pass (a bug), each failed to its gateway,
    # with the error: the handler that ran the pass went on (`take_placement_failures`).
    placement_failures: list[tuple[str, Exception]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry = WorkerRegistry(
            self.limits.heartbeat_timeout_s,
            self.limits.progress_timeout_s,
            self.limits.prefill_window_tokens,
            self.limits.bulk_window_share,
            self.limits.bulk_seat_share,
            self.limits.indexes,
            self.limits.disconnect_grace_s,
        )
        self.queue = FairQueue(self.limits.fair_share, self.limits.indexes)
        self.placement = CachePlacement(self.limits.routing, self.limits.local_prefill_max_tokens)
        self.prefix_index = self.placement.index
        self.cache_holders = CacheHolders(self.prefix_index)  # the index read backwards
        # Prompt tokens predicted cached at dispatch against those the workers found.
        self.num_predicted_cached_tokens = 0
        self.num_actual_cached_tokens = 0
        self._admissions = itertools.count()
        # (deadline, request id) of requests reserving or prefilling, for the tick (lazy).
        self._deadlines: list[tuple[float, str]] = []
        # For the wait forecast: first tokens (and their prompt tokens) per second during a
        # backlog, and the interactive requests dispatched that have not had theirs (in a
        # prefill window or reserving), with their prompt tokens.
        self.service_rate = ServiceRate()
        self.awaiting_first_token = InHand()
        self.num_refused_past_deadline = 0
        # The most tokens a request admitted may hold on its decode worker: while some decode
        # worker's pool is smaller, dispatch asks where each would fit (`decode_fit.py`).
        self.largest_need = 0
        # Requests an earlier life of the scheduler placed, still on the decode workers that
        # list them (`adopted.py`): a worker's death is told to the gateways all the same.
        self.adopted = AdoptedRequests(UNLISTED_BEATS)
        self.awaiting_workers = SubmitsAwaitingWorkers()

    # -- peers --------------------------------------------------------------------------------

    def on_hello(self, identity: bytes, hello: wire.Hello, now: float) -> list[Outgoing]:
        if hello.role == "gateway":
            self.gateways[hello.peer_id] = GatewayState(hello.peer_id, identity, hello.address)
            self._tell_lost_while_gone(identity, hello.peer_id)
        else:
            old = self.registry.remove(hello.peer_id)
            if old is not None:
                self._drop_worker(old, now)
            self.prefix_index.register(hello.peer_id, hello.cache_key, hello.block_size)
            self.cache_holders.forget(hello.peer_id)
            self.registry.add(
                WorkerState(
                    peer_id=hello.peer_id,
                    role=hello.role,
                    identity=identity,
                    address=hello.address,
                    num_total_blocks=hello.num_kv_blocks,
                    block_size=hello.block_size,
                    max_num_seqs=hello.max_num_seqs,
                    last_heartbeat=now,
                    last_progress=now,
                    num_free_blocks=hello.num_kv_blocks,
                    metrics_address=hello.metrics_address,
                    dtype=hello.dtype,
                )
            )
            for request_id in self.dropped_reservations.pop(hello.peer_id, []):
                self._send(identity, wire.Cancel(request_id=request_id, reason="lost"))
            self._admit_awaiting(now)
            self._dispatch(now)
        return self.take_outbox()

    def on_connection_closed(self, identity: bytes, now: float) -> WorkerState | None:
        """A peer's connection closed (the service's socket monitor saw it). A worker's leaves
        rotation at the first tick past `disconnect_grace_s` unless it beats again first: a
        killed worker's requests move on in a second or two, not after the heartbeat timeout.
        The worker, or None for another peer's (a gateway's)."""
        return self.registry.connection_closed(identity, now)

    def on_heartbeat(
        self, identity: bytes, heartbeat: wire.Heartbeat, now: float
    ) -> list[Outgoing]:
        worker = self.registry.get(heartbeat.peer_id)
        if worker is None:  # restarted scheduler, or a worker taken for dead: it must re-register
            ack = wire.HelloAck(
                schema_version=wire.SCHEMA_VERSION,
                accepted=False,
                error=wire.UNKNOWN_PEER,
                heartbeat_interval_s=0.0,
            )
            self._send(identity, ack)
            return self.take_outbox()
        worker.last_heartbeat = now
        worker.disconnected_at = None  # (beating, on whatever connection)
        worker.num_heartbeats += 1
        # Where the worker now listens: tandem's workers keep one routing id across reconnects
        # (shared.endpoints.routing_id), but a peer that sets none is a new ROUTER identity
        # after its connection dropped and came back: messages follow it, not the dead one.
        worker.identity = identity
        # The heartbeat's free-block count already reflects every reservation made so far.
        self.registry.report_free_blocks(worker, heartbeat.num_free_blocks, heartbeat=True)
        worker.num_running = heartbeat.num_running
        worker.num_waiting = heartbeat.num_waiting
        worker.num_swapped = heartbeat.num_swapped
        worker.recent_batch_sizes = heartbeat.recent_batch_sizes
        self.registry.report_prefill_rate(worker, routing_rate(heartbeat.prefill_tokens_per_s))
        worker.step_s = routing_step_s(heartbeat.step_s)  # (no index: routing asks one worker)
        worker.num_prefix_query_tokens = heartbeat.num_prefix_query_tokens
        worker.num_prefix_hit_tokens = heartbeat.num_prefix_hit_tokens
        in_order = self.prefix_index.apply(
            worker.peer_id,
            heartbeat.cache_events_seq,
            heartbeat.cache_full,
            heartbeat.cache_stored,
            heartbeat.cache_evicted,
        )
        self.cache_holders.applied(
            worker.peer_id,
            in_order,
            heartbeat.cache_full,
            heartbeat.cache_stored,
            heartbeat.cache_evicted,
        )
        worker.num_preemptions = {
            "swap": heartbeat.num_swap_preemptions,
            "recompute": heartbeat.num_recompute_preemptions,
        }
        busy = heartbeat.num_running + heartbeat.num_waiting + heartbeat.num_swapped > 0
        worker.record_progress(heartbeat.steps_completed, busy, now)
        unknown: list[str] = []  # neither tracked nor given up on: an earlier life's
        cancels_ahead = self.adopted.has_cancels_ahead()
        for request_id in heartbeat.request_ids:
            if request_id in self.requests:
                continue  # (first: an id given up on and submitted again names this one now)
            if request_id in self.abandoned:
                self._send(identity, wire.Cancel(request_id=request_id, reason="abandoned"))
            elif not (cancels_ahead and self._cancelled_ahead(identity, request_id, now)):
                unknown.append(request_id)
        full = len(heartbeat.request_ids) >= wire.MAX_HELD_IDS  # (a full list proves nothing)
        if worker.role == "decode":
            self._adopt(worker, unknown, full)
        if not full:
            self._ended_unheard(worker, heartbeat.request_ids)
        self._dispatch(now)
        return self.take_outbox()

    def _cancelled_ahead(self, identity: bytes, request_id: str, now: float) -> bool:
        """Whether the id a worker lists, unknown here, had its cancel before the listing
        (`on_cancel`): then the worker is told to let it go, and it is given up on (a later
        listing, a stale heartbeat's or another worker's, is told again, never adopted)."""
        reason = self.adopted.take_cancel_ahead(request_id, now)
        if reason is None:
            return False
        self._send(identity, wire.Cancel(request_id=request_id, reason=reason))
        self._abandon(request_id)
        return True

    def _adopt(self, worker: WorkerState, unknown: list[str], full: bool) -> None:
        """Adopts the requests a decode worker lists that the scheduler never placed (its
        earlier life did), and forgets those it no longer lists (`adopted.py`). Each takes a
        seat of the worker, as a request placed here does: the worker holds it."""
        listing = self.adopted.heard(worker.peer_id, unknown, worker.num_heartbeats, full)
        for request_id in listing.adopted:
            self.registry.assign(worker, request_id, 0)
        for request_id in listing.forgotten:
            self.registry.release(worker, request_id)

    def _ended_unheard(self, worker: WorkerState, held_ids: list[str]) -> None:
        """Requests decoding on this decode worker, or prefilling on this prefill worker, that
        its heartbeats no longer list: it ended them and its REQUEST_DONE was lost (a reset
        connection drops what it held), it lost them, or their job never reached it (a send
        dropped). Held here, they would take a seat or a window and count as in flight
        until a deadline (the prefill's: minutes). Each goes back to its gateway, which drops
        the word if the stream had ended and resumes the request from its tokens if not.
        (A worker's report goes out before the heartbeat that leaves its request out, on the
        same connection; one heartbeat sent before a job arrived is what UNLISTED_BEATS
        allows for.)"""
        phase = Phase.DECODING if worker.role == "decode" else Phase.PREFILLING
        for request_id in sorted(worker.request_ids.difference(held_ids)):  # (see _drop_worker)
            request = self.requests.get(request_id)
            if request is None or request.phase != phase:
                continue  # a reservation, or a job, the worker may not have seen yet
            if phase == Phase.PREFILLING and request.prefill_peer_id != worker.peer_id:
                continue
            in_a_row = request.last_unlisted_beat == worker.num_heartbeats - 1
            request.num_unlisted_beats = request.num_unlisted_beats + 1 if in_a_row else 1
            request.last_unlisted_beat = worker.num_heartbeats
            if request.num_unlisted_beats >= UNLISTED_BEATS:
                reason = f"{worker.peer_id} no longer holds it (its end went unheard)"
                self._lose(request, reason)

    def on_goodbye(self, identity: bytes, goodbye: wire.Goodbye, now: float) -> list[Outgoing]:
        """A worker stopping: out of rotation now, what it held re-routed (as `tick` does to a
        silent one). Only from the connection it registered on: a peer cannot stop another."""
        worker = self.registry.get(goodbye.peer_id)
        if worker is not None and worker.identity == identity:
            self.registry.remove(worker.peer_id)
            self._drop_worker(worker, now, "stopped")
            self._dispatch(now)
        return self.take_outbox()

    def on_gateway_gone(self, peer_id: str, now: float) -> list[Outgoing]:
        """A gateway the service has not reached for a heartbeat timeout (its process died: a
        ROUTER reaches a live peer within a reconnect). Its requests are called off where
        they run, queued or placed: their tokens had nowhere to go, and they were prefilled and
        decoded to `max_tokens` for nobody. It is forgotten: a SUBMIT of its needs a HELLO
        again, which its link, back after a long cut, says at once, and is then told the
        requests called off were lost (`_tell_lost_while_gone`). A scan of the requests: rare,
        as gateways' deaths are."""
        if self.gateways.pop(peer_id, None) is not None:
            called_off = [r for r in self.requests.values() if r.gateway_peer_id == peer_id]
            for request in called_off:
                self._forget(request, cancel_reason="its gateway is gone")
            if called_off:
                request_ids = [r.request_id for r in called_off]
                remember(self.gone_gateways, peer_id, request_ids, MAX_GONE_GATEWAYS)
            self._dispatch(now)
        return self.take_outbox()

    def _tell_lost_while_gone(self, identity: bytes, peer_id: str) -> None:
        """A gateway back under the peer id it was taken for gone with: its requests called off
        then are lost to it, and it resumes each from the tokens its clients have (a request it
        had queued waited out its first-token limit, a 504, knowing nothing of it)."""
        request_ids = self.gone_gateways.pop(peer_id, [])
        error = "the scheduler could not reach this gateway for its heartbeat timeout"
        for start in range(0, len(request_ids), LOST_DELTAS_PER_MESSAGE):
            page = request_ids[start : start + LOST_DELTAS_PER_MESSAGE]
            deltas = [ended_delta(request_id, "lost", error) for request_id in page]
            self._send(identity, wire.Tokens(deltas=deltas))

    def tick(self, now: float) -> list[Outgoing]:
        """Takes silent workers out of rotation and re-routes requests whose phase timed out."""
        for worker in self.registry.expired(now):
            self.registry.remove(worker.peer_id)
            self._drop_worker(worker, now)
        # (Every due one: their deadline entries are taken, so one left now is left for good.)
        each(self._due(now), lambda request: self._settle_due(request, now))
        self._admit_awaiting(now)  # (refused, those still held when the wait is over)
        self._dispatch(now)
        return self.take_outbox()

    def _settle_due(self, request: TrackedRequest, now: float) -> None:
        if request.phase == Phase.QUEUED and now - request.arrival > self.limits.max_queue_time_s:
            self._time_out(request, now)
        elif now <= request.phase_deadline:
            return
        elif request.phase == Phase.RESERVING and request.speculative:
            self._lose(request, "the decode worker's reservation timed out")
        elif request.phase == Phase.RESERVING:
            self._requeue(request, now, cancel_reason="timed out")
        elif request.phase == Phase.PREFILLING:
            self._lose(request, "the prefill and its KV transfer timed out")

    def _due(self, now: float) -> list[TrackedRequest]:
        """The requests a tick may act on, in the order they were admitted: those queued past
        the limit (the queue's oldest), and those whose phase deadline passed (a lazy heap of
        deadlines: an entry is stale once its request's deadline changed)."""
        limit = self.limits.max_queue_time_s
        due = {
            item.request_id: self.requests[item.request_id]
            for item in self.queue.waited_longer(now, limit)
        }
        heap = self._deadlines
        while heap and now > heap[0][0]:
            entry = heapq.heappop(heap)
            if self._deadline_is_live(entry):
                due[entry[1]] = self.requests[entry[1]]
        return sorted(due.values(), key=lambda r: r.index)

    def _set_deadline(self, request: TrackedRequest, deadline: float) -> None:
        request.phase_deadline = deadline
        # A finished request's entry is stale (prefill deadlines are minutes away while a
        # prefill takes seconds): rebuilt from the live ones when the stale dominate, the heap
        # stays near the requests in flight instead of growing to the arrival rate x 300 s.
        entry = (deadline, request.request_id)
        lazy_heap.push(self._deadlines, entry, len(self.requests), self._deadline_is_live)

    def _deadline_is_live(self, entry: tuple[float, str]) -> bool:
        request = self.requests.get(entry[1])
        return request is not None and request.phase_deadline == entry[0]

    # -- requests -----------------------------------------------------------------------------

    def on_submit(self, identity: bytes, submit: wire.Submit, now: float) -> list[Outgoing]:
        if self._waits_for_workers(submit, now):
            self.awaiting_workers.hold(identity, submit)
            return self.take_outbox()
        self._submit(identity, submit, now)
        return self.take_outbox()

    def _waits_for_workers(self, submit: wire.Submit, now: float) -> bool:
        """A scheduler just started, with no worker back yet, holds the SUBMIT (a duplicate's
        refusal is not held)."""
        awaiting = self.awaiting_workers
        if not awaiting.open(now) or self._workers_ready(now):
            return False
        return submit.request_id not in self.requests and not awaiting.holds(submit.request_id)

    def await_workers_until(self, until: float) -> None:
        """Until `until`, a SUBMIT that finds no prefill or no decode worker waits for them
        instead of a 503: the service's start, when its workers may be on their way back."""
        self.awaiting_workers.open_until(until)

    def _admit_awaiting(self, now: float) -> None:
        """The SUBMITs held for workers, admitted (or refused) once they are back or the wait
        is over (`awaiting_workers.py`)."""
        awaiting = self.awaiting_workers
        if not len(awaiting) or (awaiting.open(now) and not self._workers_ready(now)):
            return
        for identity, submit in awaiting.take_all():
            self._submit(identity, submit, now)

    def _workers_ready(self, now: float) -> bool:
        """A prefill and a decode worker are registered and making progress."""
        ready = self.registry.max_decode_capacity(now) is not None
        return ready and self.registry.any_healthy("prefill", now)

    def _submit(self, identity: bytes, submit: wire.Submit, now: float) -> None:
        refusal = self._admission_refusal(submit, now)
        if refusal is not None:
            status, message, retry_after = refusal
            reply = wire.SubmitReply(
                request_id=submit.request_id,
                accepted=False,
                status_code=status,
                message=message,
                retry_after_s=retry_after,
            )
            self._send(identity, reply)
            return
        party = self.queue.party_for(submit.tenant, num_prefill_tokens(submit), submit.bulk)
        request = TrackedRequest(
            submit, submit.gateway_peer_id, party, arrival=now, index=next(self._admissions)
        )
        self.requests[submit.request_id] = request
        self.largest_need = max(self.largest_need, request.num_needed_tokens)
        self.queue.track(party)
        self._enqueue(request, now)
        accepted = wire.SubmitReply(
            request_id=submit.request_id,
            accepted=True,
            status_code=200,
            message=None,
            retry_after_s=None,
        )
        self._send(identity, accepted)
        self._dispatch(now)

    def _admission_refusal(
        self, submit: wire.Submit, now: float
    ) -> tuple[int, str, float | None] | None:
        if submit.request_id in self.requests or self.adopted.holds(submit.request_id):
            return 400, f"request id {submit.request_id!r} is already in flight", None
        deadline = submit.first_token_deadline_s
        if deadline is not None and not deadline > 0:  # NaN too
            return 400, f"first_token_deadline_s must be positive, got {deadline}", None
        capacity = self.registry.max_decode_capacity(now)
        if capacity is None or not self.registry.any_healthy("prefill", now):
            message = "no prefill or no decode worker is registered and making progress"
            return 503, message, self.limits.retry_after_s
        needed = len(submit.prompt_token_ids) + submit.sampling.max_tokens
        if needed > capacity:
            return self._past_capacity(needed, capacity)
        num_prefill = num_prefill_tokens(submit) + 1  # (with its first token)
        if num_prefill > self.registry.largest_prefill_pool:  # refused by every one, for good
            message = (
                f"the prompt ({num_prefill} tokens with its first) can never fit the KV cache "
                f"of a prefill worker (the largest holds {self.registry.largest_prefill_pool})"
            )
            return 400, message, None
        if submit.gateway_peer_id not in self.gateways:  # its tokens would have nowhere to go
            return 400, f"gateway {submit.gateway_peer_id!r} has not said HELLO", None
        if not submit.prompt_token_ids:  # (a prefill computes its last token's logits)
            return 400, "the prompt is empty: a request needs at least one prompt token", None
        if not PRIORITY_MIN <= submit.priority <= PRIORITY_MAX:
            bounds = f"[{PRIORITY_MIN}, {PRIORITY_MAX}]"
            return 400, f"priority must be in {bounds} (as the API), got {submit.priority}", None
        if submit.resumed_from is not None:
            return None  # admitted before its worker was lost: load does not refuse it now
        num_tokens = num_prefill_tokens(submit)
        if num_tokens > self.limits.max_queued_tokens:  # no queue that drains would take it
            message = (
                f"the prompt ({num_tokens} tokens) is more than the queue holds "
                f"(max_queued_tokens {self.limits.max_queued_tokens})"
            )
            return 400, message, None
        if self._queue_full(submit.bulk, num_tokens):
            return 429, "the queue is full; retry later", self.limits.retry_after_s
        return self._deadline_refusal(submit, now)

    def _queue_full(self, bulk: bool, num_tokens: int) -> bool:
        """Interactive requests are bounded by the interactive ones queued: batch lines wait
        there by design, and would get chats refused. A batch line, taking only spare room, is
        bounded by everything queued."""
        limits = self.limits
        if bulk:
            num_queued, num_queued_tokens = len(self.queue), self.num_queued_tokens
        else:
            num_queued = self.queue.num_queued(bulk=False)
            num_queued_tokens = self.queue.num_interactive_queued_tokens()
        return (
            num_queued >= limits.max_queued_requests
            or num_queued_tokens + num_tokens > limits.max_queued_tokens
        )

    def _deadline_refusal(self, submit: wire.Submit, now: float) -> tuple[int, str, float] | None:
        """429 for an interactive request forecast to wait too close to its first-token
        deadline (`wait_forecast.py`). A prioritized one goes before its party's queue, which
        the forecast counts: never refused on it."""
        deadline = submit.first_token_deadline_s
        if deadline is None or submit.bulk or submit.priority > 0:
            return None
        if not self.limits.refuse_past_deadline:
            return None
        num_tokens = num_prefill_tokens(submit)
        queue = self.queue
        party = queue.party_for(submit.tenant, num_tokens)
        in_hand = self.awaiting_first_token
        fair = self.limits.fair_share.policy == "fair"
        # (Weighted fair share: a heavy tenant's turn brings the others less of theirs.)
        weights = (queue.backlogged_interactive_weight(), queue.config.weight(party))
        work = in_hand.num_tokens + queued_work(
            num_tokens,
            queue.num_queued_tokens_in(party),
            queue.num_interactive_queued_tokens(),
            queue.num_backlogged_interactive_parties(),
            fair=fair,
            weights=weights if fair else None,
        )
        pace = self._prompt_token_pace(now, num_tokens)
        refusal = refusal_for_deadline(deadline, num_tokens, work, pace, self.limits.deadline_share)
        if refusal is None:
            return None
        message, retry_after = refusal
        self.num_refused_past_deadline += 1
        return 429, message, retry_after

    def _prompt_token_pace(self, now: float, num_tokens: int = 0) -> float | None:
        """The forecast's pace, its one more first token the size of the mean prompt in hand
        (the next to come is one of them), or with none in hand `num_tokens`, and the prefill
        workers' measured rates as its prior."""
        next_num_tokens = self.awaiting_first_token.mean_tokens() or num_tokens
        return self.service_rate.tokens_per_second(
            now, round(next_num_tokens), self.registry.prefill_tokens_per_s
        )

    def _past_capacity(self, needed: int, capacity: int) -> tuple[int, str, float | None]:
        """A request past the KV cache of every decode worker making progress (`capacity`
        tokens): 400 when it is past every registered one's too, else 503, as when no worker is
        up: the one that could hold it is stalled and may move again (its request refused 400
        would fail for good, a resumed one too)."""
        largest = max(w.pool_tokens for w in self.registry.by_role("decode"))
        if needed <= largest:
            message = (
                f"prompt plus max_tokens ({needed} tokens) fits only the KV cache of a decode "
                f"worker not making progress ({largest} tokens); retry later"
            )
            return 503, message, self.limits.retry_after_s
        message = (
            f"prompt plus max_tokens ({needed} tokens) can never fit a decode worker's KV cache "
            f"({capacity} tokens)"
        )
        return 400, message, None

    def on_cancel(self, cancel: wire.Cancel, now: float) -> list[Outgoing]:
        if self.awaiting_workers.cancel(cancel.request_id):
            return self.take_outbox()  # held for the workers, never admitted: nothing else knew
        request = self.requests.get(cancel.request_id)
        if request is not None:
            self._forget(request, cancel_reason=cancel.reason)
        elif self.adopted.holds(cancel.request_id):  # (its client left after a restart)
            self._let_go_adopted(cancel.request_id, cancel.reason)
        elif cancel.request_id not in self.abandoned:
            # Perhaps an earlier life's, whose worker has not listed it yet (a restart just
            # now): the cancel waits for that listing, a heartbeat timeout at most.
            keep_s = self.limits.heartbeat_timeout_s
            self.adopted.cancel_ahead(cancel.request_id, cancel.reason, now, keep_s)
        return self.take_outbox()

    def on_reserve_reply(self, reply: wire.ReserveReply, now: float) -> list[Outgoing]:
        self._reserve_answered(reply, now)
        return self.take_outbox()

    def _reserve_answered(self, reply: wire.ReserveReply, now: float) -> None:
        request = self.requests.get(reply.request_id)
        decode_peer_id = request.decode_peer_id if request else None
        worker = self.registry.get(decode_peer_id) if decode_peer_id else None
        if request is None or request.phase != Phase.RESERVING or worker is None:
            return
        if reply.peer_id != decode_peer_id or reply.attempt not in (0, request.num_reserves):
            # A late answer to an attempt given up on (its reservation timed out, and the
            # worker was told to let it go): the request now waits on another reservation,
            # another worker's or the same worker's asked again.
            return
        if not reply.ok:
            self.registry.report_free_blocks(worker, reply.num_free_blocks, heartbeat=False)
            if request.speculative:
                self._lose(request, f"{worker.peer_id} had no room after all")
            else:
                self._requeue(request, now, cancel_reason=None)
            self._dispatch(now)
            return
        prefill = self.registry.get(request.prefill_peer_id) if request.prefill_peer_id else None
        if prefill is None or not prefill.making_progress(now, self.limits.progress_timeout_s):
            if request.speculative:
                self._lose(request, "its prefill worker stopped making progress")
            else:
                self._requeue(request, now, cancel_reason="no prefill worker")
            return
        request.phase = Phase.PREFILLING
        self._set_deadline(request, now + self.limits.prefill_timeout_s)
        if request.speculative:  # the job is running: let its KV go
            grant = wire.PrefillGrant(
                request_id=request.request_id, num_skip_blocks=reply.num_cached_blocks
            )
            self._send(prefill.identity, grant)
            return
        submit = request.submit
        held = self._held_ahead(prefill, request)
        if self.placement.prefills_locally(submit, reply.num_cached_blocks, worker, prefill, held):
            # The decode worker computes the short suffix itself: the prefill worker is out.
            self.registry.release(prefill, request.request_id)
            request.prefill_peer_id = worker.peer_id
            prefill = worker
        job = self._prefill_job(request, prefill, worker, reply.num_cached_blocks)
        self._send(prefill.identity, job)

    def _prefill_job(
        self,
        request: TrackedRequest,
        prefill: WorkerState,
        decode: WorkerState,
        num_skip_blocks: int,
        await_grant: bool = False,
    ) -> wire.PrefillJob:
        submit = request.submit
        request.num_predicted_cached_tokens = self.placement.cached_on(prefill.peer_id, submit)
        return wire.PrefillJob(
            request_id=submit.request_id,
            prompt_token_ids=submit.prompt_token_ids,
            sampling=submit.sampling,
            gateway_address=self.gateways[request.gateway_peer_id].address,  # type: ignore[arg-type]
            decode_peer_id=decode.peer_id,
            decode_address=decode.address,  # type: ignore[arg-type]
            output_token_ids=submit.output_token_ids,
            priority=submit.priority,
            cache_salt=submit.tenant,
            num_skip_blocks=num_skip_blocks,
            bulk=request.placed_as_bulk,  # an aged line competes as interactive there too
            await_grant=await_grant,
        )

    def on_request_done(self, done: wire.RequestDone, now: float) -> list[Outgoing]:
        self._request_done(done, now)
        return self.take_outbox()

    def _request_done(self, done: wire.RequestDone, now: float) -> None:
        request = self.requests.get(done.request_id)
        if request is None:
            self._adopted_done(done)
            return
        if done.num_output_tokens > 0:
            self.queue.charge(request.party, num_output_tokens=done.num_output_tokens)
        if done.phase == "prefill":
            # A speculative job may finish at its first token before its reservation is done.
            prefilling = request.phase == Phase.PREFILLING or (
                request.phase == Phase.RESERVING and request.speculative
            )
            if not prefilling or request.prefill_peer_id != done.peer_id:
                return  # a report from an attempt the scheduler already gave up on
            prefill = self.registry.get(done.peer_id)
            if prefill is not None and done.peer_id != request.decode_peer_id:
                self.registry.release(prefill, done.request_id)
            self.awaiting_first_token.discard(done.request_id)
            if done.finish_reason != "error":
                self.service_rate.served(now, request.num_prefill_tokens)
            if done.finish_reason in (None, "stop", "length"):
                self.num_predicted_cached_tokens += request.num_predicted_cached_tokens
                self.num_actual_cached_tokens += done.num_cached_tokens
            if done.finish_reason is None:  # KV handed to the decode worker, which now owns it
                request.phase = Phase.DECODING
                request.prefill_peer_id = None
                request.num_unlisted_beats = 0  # the prefill worker's count is not the decode's
                request.last_unlisted_beat = -2
            elif done.finish_reason == "error":  # the transfer failed: try again elsewhere
                self._lose(request, "the KV transfer failed")
            else:  # finished at its first token: the decode reservation is no longer needed
                self._forget(request, cancel_reason="finished in prefill")
                self._stream_ended(request, done)
        elif done.finish_reason == "preempted":  # handed back by the decode worker to recompute
            self._lose(request, f"preempted on {done.peer_id} for recompute", "preempted")
        else:
            self._forget(request, cancel_reason=None)
            self._stream_ended(request, done)
        self._dispatch(now)

    def _stream_ended(self, request: TrackedRequest, done: wire.RequestDone) -> None:
        """Tells the request's gateway where its worker ended the stream: the stream's last
        delta travels on another connection, and if that one lost it, nothing else would."""
        gateway = self.gateways.get(request.gateway_peer_id)
        if gateway is None or done.output_length is None or done.finish_reason is None:
            return
        ended = wire.StreamEnded(
            request_id=request.request_id,
            finish_reason=done.finish_reason,
            output_length=done.output_length,
        )
        self._send(gateway.identity, ended)

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(self, now: float) -> list[Outgoing]:
        """Hands the policy's next requests to prefill workers with room, decode reserved first."""
        self._dispatch(now)
        return self.take_outbox()

    def _dispatch(self, now: float) -> None:
        while len(self.queue) and self.registry.any_healthy("prefill", now):
            lengths = self._placeable_lengths(now)
            admission: Callable[[QueuedRequest], bool] = lengths
            promise = lengths
            if lengths.interactive and self._holds_aged_bulk(now):
                aged = AgedBulkAdmission(lengths, now, self._bulk_max_wait_s)
                admission, promise = aged, aged.promise
            if self.largest_need > self.registry.smallest_decode_pool and not lengths.empty:
                admission = DecodeFitAdmission(
                    admission, promise, self.requests, self.registry, now, self._bulk_max_wait_s
                )
            item = self.queue.pop_next(now, admission, promise)
            if item is None:
                break
            request = self.requests[item.request_id]
            request.num_charged_tokens = item.num_prompt_tokens - item.num_cached_tokens
            try:
                self._place(request, item, now)
            except Exception as error:
                # Out of the queue, it would wait for nobody: it fails instead. The pass stops
                # (a bug every request hits fails one a pass, and the service's failure window
                # ends the scheduler) and the rest wait for the next.
                self._placement_failed(request, error)
                break
        self.service_rate.pass_ended(now, backlogged=len(self.queue) > 0)

    @property
    def _bulk_max_wait_s(self) -> float:
        return self.limits.fair_share.bulk_max_wait_s

    def _holds_aged_bulk(self, now: float) -> bool:
        """Some batch line queued has waited `bulk_max_wait_s`: it competes as interactive."""
        if not self.queue.holds_bulk():
            return False
        oldest = self.queue.oldest_bulk_arrival()
        return oldest is not None and now - oldest >= self._bulk_max_wait_s

    def _place(self, request: TrackedRequest, item: QueuedRequest, now: float) -> None:
        # An aged batch line goes where an interactive request would (`AgedBulkAdmission`).
        bulk = item.bulk and now - item.arrival < self._bulk_max_wait_s
        request.placed_as_bulk = bulk
        candidates = prefill_candidates(
            self.registry,
            self.limits.routing,
            item.num_prompt_tokens,
            bulk,
            now,
            self._holders(request.submit)[1],
        )
        prefill = self.placement.choose_prefill(
            candidates,
            request.submit,
            self.registry.held_tokens,
            self.registry.small_room,
        )
        self._reserve(request, prefill, now)
        if not bulk:
            self.awaiting_first_token.add(item.request_id, item.num_prompt_tokens)

    def _placement_failed(self, request: TrackedRequest, error: Exception) -> None:
        """Placing it raised midway (a bug): what of it was done is undone as for a request
        given up on, its dispatch unsaid, and its gateway told (500). Not queued again, where it
        would raise again."""
        self.placement_failures.append((request.request_id, error))
        self.forget_dispatch(request.request_id)
        self._forget(request, cancel_reason="the scheduler failed to place it")
        message = f"the scheduler failed to place this request ({type(error).__name__}; "
        self._end_at_gateway(request, "error", message + "its log has the traceback)")

    def _holders(self, submit: wire.Submit) -> tuple[list[int], set[str]]:
        """The prompt's block hashes, and the workers holding its first block (those alone hold
        any of it). Nothing when no worker keeps a cache."""
        if not self.placement.active:
            return [], set()
        hashes = self.placement.prompt_hashes(submit)
        return hashes, (set(self.cache_holders.holders(hashes[0])) if hashes else set())

    def _placeable_lengths(self, now: float) -> LengthRanges:
        """The prompt lengths some prefill worker's window takes and some decode worker can
        hold (with the first decode step) right now: exactly the requests dispatch can place."""
        half = self.limits.prefill_window_tokens // 2  # longer is big (`PrefillWindow`)
        takes_small, takes_big, takes_bulk = self.registry.prefill_kinds_taken(now)
        if not (takes_small or takes_big or takes_bulk):
            return NOTHING_PLACEABLE  # every window is full: the usual answer under load
        # A prompt's room, on both workers: itself and its first token.
        max_tokens = self.registry.max_decode_tokens(now) - 1
        if max_tokens < 0:
            return NOTHING_PLACEABLE
        # A prefill worker of each kind's largest cache (they differ only in mixed clusters).
        small_pool, big_pool, bulk_pool = self.registry.prefill_pools_taking(now)
        interactive = []
        if takes_small:
            interactive.append((0, min(half, max_tokens, small_pool - 1)))
        max_big = min(max_tokens, big_pool - 1)
        if takes_big and max_big > half:
            interactive.append((half + 1, max_big))
        bulk = []
        if takes_bulk and self.queue.holds_bulk():  # (no batch job: no question of its seats)
            max_bulk_decode = self.registry.max_decode_tokens(now, bulk=True)
            max_bulk_tokens = min(max_bulk_decode, bulk_pool) - 1
            bulk = [(0, max_bulk_tokens)] if max_bulk_tokens >= 0 else []
        return LengthRanges(tuple(interactive), tuple(bulk))

    def _reserve(self, request: TrackedRequest, prefill: WorkerState, now: float) -> None:
        num_prompt_tokens = request.num_prefill_tokens
        self.max_queue_wait_s = max(self.max_queue_wait_s, now - request.queued_at)
        # Room for the prompt and the first decode step; later growth is the worker's affair.
        num_tokens = num_prompt_tokens + 1
        affinity = self.placement.decode_affinity(request.submit)
        holders = self._holders(request.submit)[1] if affinity is not None else None
        bulk = request.placed_as_bulk
        decode = self.registry.pick_decode(
            num_tokens, now, affinity, holders, bulk, request.num_needed_tokens
        )
        assert decode is not None, "the policy only picks placeable requests"
        # Its tokens leave the queue's count as it leaves the phase (`_forget` reads it).
        self.num_queued_tokens -= num_prompt_tokens
        request.phase = Phase.RESERVING
        request.decode_peer_id = decode.peer_id
        request.prefill_peer_id = prefill.peer_id
        request.num_blocks = decode.blocks_for(num_tokens)
        self._set_deadline(request, now + self.limits.reserve_timeout_s)
        self.registry.reserve(decode, request.request_id, request.num_blocks)
        self.registry.assign(prefill, request.request_id, num_prompt_tokens, bulk)
        submit = request.submit
        request.num_reserves += 1
        reserve = wire.Reserve(
            request_id=request.request_id,
            num_tokens=num_tokens,
            lease_s=self.limits.prefill_timeout_s,
            token_ids=prefill_tokens(submit),
            cache_salt=submit.tenant,
            attempt=request.num_reserves,
        )
        self._send(decode.identity, reserve)
        if self._speculates(request, prefill, decode):
            request.speculative = True
            job = self._prefill_job(request, prefill, decode, 0, await_grant=True)
            self._send(prefill.identity, job)
        self.dispatched.append(
            Dispatched(
                request.request_id,
                now - request.queued_at,
                prefill.peer_id,
                decode.peer_id,
                request.speculative,
            )  # fmt: skip
        )

    def _speculates(
        self, request: TrackedRequest, prefill: WorkerState, decode: WorkerState
    ) -> bool:
        """Whether the prefill goes out with the reservation: the decode worker is in the middle
        of a batch (its answer would wait for a step), has room for the request twice over (a
        refusal costs a resumed attempt), and would not prefill the prompt itself given what
        the index says it holds (the answer's cached blocks reach the prefill worker with the
        grant, so only that choice needs the answer first)."""
        if not (
            self.limits.speculative_prefill
            and decode.num_running > 0
            and decode.num_available_blocks >= request.num_blocks  # after this one's promise
        ):
            return False
        submit = request.submit
        num_cached_blocks = self.placement.cached_on(decode.peer_id, submit) // decode.block_size
        held = self._held_ahead(prefill, request)
        return not self.placement.prefills_locally(submit, num_cached_blocks, decode, prefill, held)

    def _held_ahead(self, prefill: WorkerState, request: TrackedRequest) -> int:
        """The prompt tokens the prefill worker holds that the request's would wait behind: an
        interactive prompt only the other interactive ones (batch lines yield to it in every
        step), a batch line all of them."""
        registry = self.registry
        bulk = request.placed_as_bulk
        ahead = registry.held_tokens(prefill) if bulk else registry.interactive_tokens(prefill)
        return ahead - request.num_prefill_tokens

    def _enqueue(self, request: TrackedRequest, now: float) -> None:
        submit = request.submit
        request.queued_at = now
        self.queue.push(
            QueuedRequest(
                request_id=submit.request_id,
                tenant=submit.tenant,
                num_prompt_tokens=request.num_prefill_tokens,
                priority=submit.priority,
                arrival=request.arrival,
                resumed=submit.resumed_from is not None,
                bulk=submit.bulk,
                num_cached_tokens=self._most_cached(submit),
            )
        )
        self.num_queued_tokens += request.num_prefill_tokens

    def _most_cached(self, submit: wire.Submit) -> int:
        """The most of the prompt any worker holds cached (only a holder of its first block
        holds any)."""
        if not self.placement.active:
            return 0  # (every SUBMIT asks: no lists made for nothing)
        hashes, holders = self._holders(submit)
        return max((self.prefix_index.num_cached_tokens(p, hashes) for p in holders), default=0)

    # -- helpers ------------------------------------------------------------------------------

    def _cancel_on_workers(self, request: TrackedRequest, reason: str) -> None:
        # A prefill worker chosen for a request still reserving has heard nothing of it yet.
        prefill_holds_state = request.prefill_began
        for peer_id, holds_state in (
            (request.prefill_peer_id, prefill_holds_state),
            (request.decode_peer_id, True),
        ):
            worker = self.registry.get(peer_id) if peer_id else None
            if worker is None:
                continue
            self.registry.release(worker, request.request_id)
            if holds_state:
                cancel = wire.Cancel(request_id=request.request_id, reason=reason)
                self._send(worker.identity, cancel)

    def _requeue(self, request: TrackedRequest, now: float, cancel_reason: str | None) -> None:
        """Back to the queue with its first arrival time (so it ages from then), releasing
        whatever workers hold for it. Its queue time counts from now."""
        self.awaiting_first_token.discard(request.request_id)
        if cancel_reason:
            self._cancel_on_workers(request, cancel_reason)
        if cancel_reason is None and request.decode_peer_id:
            worker = self.registry.get(request.decode_peer_id)
            if worker is not None:
                self.registry.release(worker, request.request_id)
        if cancel_reason is None and request.prefill_peer_id:
            worker = self.registry.get(request.prefill_peer_id)
            if worker is not None:
                self.registry.release(worker, request.request_id)
        request.phase = Phase.QUEUED
        request.decode_peer_id = request.prefill_peer_id = None
        request.phase_deadline = math.inf
        # Its uncached part was charged when dispatched; it will be again when dispatched anew.
        self.queue.charge(request.party, num_prompt_tokens=-request.num_charged_tokens)
        self._enqueue(request, now)

    def _forget(self, request: TrackedRequest, cancel_reason: str | None) -> None:
        forgotten = self.requests.pop(request.request_id, None)
        if forgotten is not None:
            self.queue.untrack(forgotten.party)
        self.placement.forget(request.request_id)
        self.awaiting_first_token.discard(request.request_id)
        if cancel_reason is not None or request.phase != Phase.QUEUED:
            self._abandon(request.request_id)
        if request.phase == Phase.QUEUED:
            self.queue.remove(request.request_id)
            self.num_queued_tokens -= request.num_prefill_tokens
            return
        if cancel_reason is not None:
            self._cancel_on_workers(request, cancel_reason)
            return
        for peer_id in (request.prefill_peer_id, request.decode_peer_id):
            worker = self.registry.get(peer_id) if peer_id else None
            if worker is not None:
                self.registry.release(worker, request.request_id)

    def _drop_worker(
        self, worker: WorkerState, now: float, why: str = "stopped responding"
    ) -> None:
        """A worker left: re-route what can be, fail what cannot."""
        self.prefix_index.remove(worker.peer_id)
        self.cache_holders.forget(worker.peer_id)
        self._lose_adopted(worker, why)
        # (Every one: the worker is out of the registry, so one left now is stranded. In the
        # ids' order, not the set's, which follows the process's string hashing: a simulation
        # would re-route them in another order each run.)
        each(
            sorted(worker.request_ids),
            lambda request_id: self._reroute(worker, request_id, now, why),
        )

    def _reroute(self, worker: WorkerState, request_id: str, now: float, why: str) -> None:
        request = self.requests.get(request_id)
        if request is None:
            return
        if request.prefill_began:
            # If it is alive after all (a long stall), it must stop working for nobody.
            self._lose(request, f"worker {worker.peer_id} {why}")
            self._send(worker.identity, wire.Cancel(request_id=request_id, reason="lost"))
        else:
            if request.decode_peer_id == worker.peer_id:
                request.decode_peer_id = None
                # Alive after all (a stall), it would hold the reservation for its lease, and
                # refuse the request as a duplicate when it rejoined and was asked again.
                self._send(worker.identity, wire.Cancel(request_id=request_id, reason="lost"))
                remember(
                    self.dropped_reservations, worker.peer_id, [request_id], MAX_DROPPED_WORKERS
                )
            if request.prefill_peer_id == worker.peer_id:
                request.prefill_peer_id = None
            self._requeue(request, now, cancel_reason=f"worker {worker.peer_id} left")

    # -- requests of an earlier life (`adopted.py`) ---------------------------------------------

    def _lose_adopted(self, worker: WorkerState, why: str) -> None:
        """The requests adopted from a worker that left go back to their gateway, as a placed
        request's would (`_reroute`). Which gateway is unknown: every one is told, and those
        not running the attempt drop the word."""
        request_ids = self.adopted.forget_worker(worker.peer_id)
        if not request_ids:
            return
        error = f"worker {worker.peer_id} {why} (it held the request across a scheduler restart)"
        lost: list[wire.TokenDelta] = []
        for request_id in request_ids:
            # If it is alive after all (a long stall), it must stop working for nobody.
            self._send(worker.identity, wire.Cancel(request_id=request_id, reason="lost"))
            self._let_go_adopted(request_id, "lost")
            lost.append(ended_delta(request_id, "lost", error))
        self._tell_every_gateway(lost)

    def _adopted_done(self, done: wire.RequestDone) -> None:
        """A report on an adopted request, read as a placed one's (`_request_done`): a
        sequence handed back for recompute, or a prefill that failed, goes back to be resumed;
        an end goes to the gateways (where the stream ended: its last delta may have been
        lost). From a worker holding it, or from an earlier life's prefill worker whose job
        ended (or failed) at its first token: the decode workers that list it hold only its
        reservation, or KV that decodes for nobody (the prefill worker told its gateway)."""
        if done.phase == "prefill" and done.finish_reason is None:
            return  # its KV handed to its decode worker (or prefilled there): decoding on there
        if self.adopted.held_by(done.peer_id, done.request_id):
            self.adopted.forget(done.peer_id, done.request_id)
            worker = self.registry.get(done.peer_id)
            if worker is not None:
                self.registry.release(worker, done.request_id)
        elif done.phase != "prefill" or not self.adopted.holds(done.request_id):
            return  # (a stale report)
        resumed = done.phase == "decode" and done.finish_reason == "preempted"
        failed = done.phase == "prefill" and done.finish_reason == "error"
        # (Any other worker holding it holds a reservation the old scheduler gave up on.)
        self._let_go_adopted(done.request_id, "lost" if resumed or failed else "finished")
        if resumed or failed:
            why = "preempted for recompute" if resumed else "its prefill failed"
            error = f"{why} on {done.peer_id} (held across a scheduler restart)"
            finish_reason = "preempted" if resumed else "lost"
            self._tell_every_gateway([ended_delta(done.request_id, finish_reason, error)])
        elif done.output_length is not None and done.finish_reason is not None:
            ended = wire.StreamEnded(
                request_id=done.request_id,
                finish_reason=done.finish_reason,
                output_length=done.output_length,
            )
            for gateway in self.gateways.values():
                self._send(gateway.identity, ended)

    def _let_go_adopted(self, request_id: str, reason: str) -> None:
        """Gives up on an adopted request: every worker still holding it is told to let it go
        (its seat freed), and it is remembered as abandoned (never adopted again)."""
        for peer_id in self.adopted.holders(request_id):
            self.adopted.forget(peer_id, request_id)
            worker = self.registry.get(peer_id)
            if worker is not None:
                self.registry.release(worker, request_id)
                self._send(worker.identity, wire.Cancel(request_id=request_id, reason=reason))
        self._abandon(request_id)

    def _tell_every_gateway(self, deltas: list[wire.TokenDelta]) -> None:
        """Sends the deltas to every gateway, in messages of as many as the wire takes."""
        for gateway in self.gateways.values():
            for start in range(0, len(deltas), wire.MAX_LIST_LEN):
                tokens = wire.Tokens(deltas=deltas[start : start + wire.MAX_LIST_LEN])
                self._send(gateway.identity, tokens)

    def _time_out(self, request: TrackedRequest, now: float) -> None:
        """A request that waited in the queue past the limit: its client gets a 504. It is
        remembered as given up on: one placed before (back in the queue after its reservation
        timed out) may be listed still by a worker that missed the cancel, which is told again
        instead of the id being adopted as an earlier life's."""
        self._forget(request, cancel_reason=None)
        self._abandon(request.request_id)
        message = (
            f"queued {now - request.arrival:.0f} s without a worker free for it "
            f"(max_queue_time_s {self.limits.max_queue_time_s:g})"
        )
        self._end_at_gateway(request, "timeout", message)

    def _abandon(self, request_id: str) -> None:
        """Remembers a request given up on (a bounded memory: the oldest go first). A request
        finished normally is remembered too: a worker that still lists it lost track."""
        self.abandoned[request_id] = None
        while len(self.abandoned) > MAX_ABANDONED:
            self.abandoned.popitem(last=False)

    def _lose(self, request: TrackedRequest, reason: str, finish_reason: str = "lost") -> None:
        """Gives a request whose tokens may have reached its client back to its gateway, which
        alone knows which did: it resumes the request from them (or fails it). Re-running it
        here could repeat a token the client has or skip one it lacks."""
        self._forget(request, cancel_reason="lost")
        self._end_at_gateway(request, finish_reason, reason)

    def _end_at_gateway(self, request: TrackedRequest, finish_reason: str, error: str) -> None:
        """Tells the request's gateway (if it is still here) that the request ended so: a
        delta with no tokens, its finish reason and the error."""
        gateway = self.gateways.get(request.gateway_peer_id)
        if gateway is not None:
            delta = ended_delta(request.request_id, finish_reason, error)
            self._send(gateway.identity, wire.Tokens(deltas=[delta]))

    def take_dispatched(self) -> list[Dispatched]:
        taken, self.dispatched = self.dispatched, []
        return taken

    def take_placement_failures(self) -> list[tuple[str, Exception]]:
        """The requests a dispatch pass failed since the last take because placing them raised,
        with the errors: for the service to log with their tracebacks and count."""
        taken, self.placement_failures = self.placement_failures, []
        return taken

    def forget_dispatch(self, request_id: str) -> None:
        """Drops a request's dispatch not yet taken (its handling failed: it was never one)."""
        self.dispatched = [d for d in self.dispatched if d.request_id != request_id]

    def _send(self, identity: bytes, message: wire.Message) -> None:
        self.outbox.append(Outgoing(identity, message))

    def take_outbox(self) -> list[Outgoing]:
        """The messages built since the last take, in the order their decisions were taken."""
        taken, self.outbox = self.outbox, []
        return taken

    def cluster_status(self, now: float) -> wire.ClusterStatus:
        """Counts the workers that are making progress: what /ready reports."""
        decode = self.registry.healthy("decode", now)
        return wire.ClusterStatus(
            num_prefill=len(self.registry.healthy("prefill", now)),
            num_decode=len(decode),
            num_decode_free_blocks=sum(w.num_free_blocks for w in decode),
            num_decode_total_blocks=sum(w.num_total_blocks for w in decode),
            max_decode_pool_tokens=max((w.pool_tokens for w in decode), default=0),
            num_queued=len(self.queue),
            # (An adopted request is in flight too: its worker holds it, its client waits.)
            num_in_flight=len(self.requests) + len(self.adopted),
            num_swap_preemptions=sum(w.num_preemptions["swap"] for w in decode),
            num_recompute_preemptions=sum(w.num_preemptions["recompute"] for w in decode),
            policy=self.queue.config.policy,  # type: ignore[arg-type]  # checked in its config
            max_queue_wait_s=self.max_queue_wait_s,
            service=self._service(),
            workers=[self._worker_status(w, now) for w in self.registry.workers.values()],
            num_predicted_cached_tokens=self.num_predicted_cached_tokens,
            num_actual_cached_tokens=self.num_actual_cached_tokens,
            first_tokens_per_s=self.service_rate.per_second(now) or 0.0,
            prompt_tokens_per_s=self._prompt_token_pace(now) or 0.0,
            num_refused_past_deadline=self.num_refused_past_deadline,
        )

    def _service(self) -> list[wire.PartyService]:
        """Each party's service, by name. Past `MAX_PARTIES_SHOWN`, those with requests queued
        are shown first, then the most served (ties: by name): a cut by name alone would hide
        a tenant late in the alphabet however long its queue."""
        queued = self.queue.num_queued_by_party()
        served = self.queue.served_tokens
        parties = sorted(served.keys() | queued.keys())
        if len(parties) > MAX_PARTIES_SHOWN:
            ranked = sorted(parties, key=lambda p: (not queued.get(p), -served.get(p, 0), p))
            parties = sorted(ranked[:MAX_PARTIES_SHOWN])
        return [
            wire.PartyService(
                tenant=party.tenant,
                class_name=party.class_name,
                served_tokens=self.queue.served_tokens.get(party, 0),
                virtual_tokens=self.queue.counters.get(party, 0.0),
                num_queued=queued.get(party, 0),
            )
            for party in parties
        ]

    def _worker_status(self, worker: WorkerState, now: float) -> wire.WorkerStatus:
        return wire.WorkerStatus(
            peer_id=worker.peer_id,
            role=worker.role,  # type: ignore[arg-type]  # a HELLO's, checked by the codec
            healthy=worker.making_progress(now, self.limits.progress_timeout_s),
            heartbeat_age_s=max(0.0, now - worker.last_heartbeat),
            num_running=worker.num_running,
            num_waiting=worker.num_waiting,
            num_swapped=worker.num_swapped,
            num_free_blocks=worker.num_free_blocks,
            num_total_blocks=worker.num_total_blocks,
            steps_completed=worker.steps_completed,
            recent_batch_sizes=list(worker.recent_batch_sizes),
            metrics_address=worker.metrics_address,
            dtype=worker.dtype,
            num_prefix_query_tokens=worker.num_prefix_query_tokens,
            num_prefix_hit_tokens=worker.num_prefix_hit_tokens,
        )
