"""The scheduler's decisions, as a pure state machine: events in, messages out, the clock passed in.

A request moves through phases:

    QUEUED ──RESERVE sent──▶ RESERVING ──blocks reserved──▶ PREFILLING ──KV acknowledged──▶ DECODING
       ▲                         │                              │
       └──── refused, timed out, or a worker left ◀─────────────┘

Admission bounds the queue by requests and by prompt tokens (past either, 429 with Retry-After) and
refuses a prompt no decode worker could ever hold (400). The queue is ordered by the fair-share
policy (`fair_share.py`; FCFS as a switch). Requests stay in the scheduler's queue until a prefill
worker has room in its window (`PrefillWindow`: one big prompt and a few steps' worth of small
ones in hand): the policy decides, not the order in which workers happen to receive work.
Dispatch takes the policy's next request that a prefill window and a decode worker can take, asks
that decode worker to reserve blocks for the prompt, and once it confirms, hands the prompt to the
chosen prefill worker, naming the decode target. A request whose reservation is refused, or
whose worker stops sending heartbeats before its KV reached the decode worker, goes back to the
queue with its original arrival time (its prompt's charge refunded); one whose decode worker dies
mid-stream is failed with an error to its gateway. Cancels are forwarded to every worker holding
state for the request.
"""

from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field

from services.scheduler.cache_placement import CachePlacement
from services.scheduler.cache_routing import RoutingWeights, routing_rate, routing_step_s
from shared import wire
from tests.reference_scheduler.fair_share import FairQueue, FairShareConfig, Party, QueuedRequest
from tests.reference_scheduler.registry import WorkerRegistry, WorkerState

MAX_ABANDONED = 65536  # request ids remembered as given up on, for the heartbeats' lease check
MAX_PARTIES_SHOWN = 256  # the status lists at most this many tenant/class accounts


class Phase(enum.IntEnum):
    QUEUED = 0
    RESERVING = 1
    PREFILLING = 2
    DECODING = 3


@dataclass(frozen=True)
class SchedulerLimits:
    max_queued_requests: int = 1024
    max_queued_tokens: int = 1 << 20
    heartbeat_timeout_s: float = 10.0
    progress_timeout_s: float = 60.0  # busy without completing a step: stuck (see registry)
    reserve_timeout_s: float = 5.0
    prefill_timeout_s: float = 300.0  # prompt compute plus KV transfer, on a CPU
    max_queue_time_s: float = 600.0  # longer in the queue: failed with a timeout, not kept
    retry_after_s: float = 1.0
    prefill_window_tokens: int = 2048  # prompt tokens in hand per prefill worker (see above)
    fair_share: FairShareConfig = field(default_factory=FairShareConfig)
    routing: RoutingWeights = field(default_factory=RoutingWeights)  # prefill choice by cache
    # Conditional disaggregation: a decode worker holding all but at most this many of a
    # prompt's tokens prefills them itself, and no KV crosses the wire (0: never).
    local_prefill_max_tokens: int = 256
    bulk_window_share: float = 0.5  # batch lines fill a window up to this share
    bulk_seat_share: float = 0.875  # and take up to this share of a decode worker's seats


@dataclass
class PrefillWindow:
    """What a prefill worker holds ahead of its progress, and whether it may take more.

    A worker holds at most one *big* prompt (more than half the window) and up to a window of
    prompt tokens in smaller ones (the last may overshoot). One big prompt already fills every
    step's budget for many steps, so a second adds nothing but a claim on the worker's future;
    kept in the scheduler's queue instead, it stays under the policy, and short prompts always
    find room beside the big one in hand.
    """

    tokens: int  # the window, in prompt tokens
    bulk_share: float = 0.5
    holds_big: bool = False
    holds_interactive_big: bool = False  # (a batch line's big prompt yields to one in the engine)
    small_tokens: int = 0

    def is_big(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens > self.tokens // 2

    def hold(self, num_prompt_tokens: int, bulk: bool = False) -> None:
        if self.is_big(num_prompt_tokens):
            self.holds_big = True
            self.holds_interactive_big |= not bulk
        else:
            self.small_tokens += num_prompt_tokens

    @property
    def small_room(self) -> int:
        return self.tokens - self.small_tokens

    def takes(self, num_prompt_tokens: int, bulk: bool = False) -> bool:
        if bulk:
            # A batch line goes only to a worker with little in hand (`bulk_share` of the
            # window, no big prompt).
            return not self.holds_big and self.small_tokens < int(self.tokens * self.bulk_share)
        if self.is_big(num_prompt_tokens):
            return not self.holds_interactive_big
        return self.small_room > 0


def num_needed_tokens(submit: wire.Submit) -> int:
    """The most its sequence may hold on a decode worker, whose whole pool must hold it."""
    return len(submit.prompt_token_ids) + submit.sampling.max_tokens


@dataclass
class TrackedRequest:
    submit: wire.Submit
    gateway_peer_id: str
    party: Party  # the fair-share account it is charged to
    phase: Phase = Phase.QUEUED
    decode_peer_id: str | None = None
    prefill_peer_id: str | None = None
    phase_deadline: float = float("inf")
    num_blocks: int = 0  # blocks reserved on the decode worker
    arrival: float = 0.0  # the scheduler's clock when it was first queued (it ages from)
    queued_at: float = 0.0  # when it last entered the queue: its queue time counts from here
    placed_as_bulk: bool = False  # dispatched as a batch line (not one aged past bulk_max_wait_s)
    num_predicted_cached_tokens: int = 0  # where its prefill went, as the prefix index knew
    num_charged_tokens: int = 0  # what its last dispatch charged its party: a requeue's refund

    @property
    def request_id(self) -> str:
        return self.submit.request_id

    @property
    def num_prefill_tokens(self) -> int:
        return num_prefill_tokens(self.submit)


def num_prefill_tokens(submit: wire.Submit) -> int:
    """What a prefill worker computes: the prompt, and the tokens a resumed request has."""
    return len(submit.prompt_token_ids) + len(submit.output_token_ids)


def within_pool(worker: WorkerState, num_free_blocks: int) -> int:
    """A reported free-block count, read within the worker's pool (as the registry reads it)."""
    return min(max(0, num_free_blocks), worker.num_total_blocks)


@dataclass
class GatewayState:
    peer_id: str
    identity: bytes
    address: str | None


@dataclass(frozen=True)
class Dispatched:
    """A request handed on: for the service's log line and queue-time metric."""

    request_id: str
    queue_s: float
    prefill_peer_id: str
    decode_peer_id: str


@dataclass
class Outgoing:
    identity: bytes
    message: object


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
    # holding one after its cancel went astray is told again (see `on_heartbeat`).
    abandoned: dict[str, None] = field(default_factory=dict)
    # Dispatches since the service last took them (`take_dispatched`).
    dispatched: list[Dispatched] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.registry = WorkerRegistry(
            self.limits.heartbeat_timeout_s, self.limits.progress_timeout_s
        )
        self.queue = FairQueue(self.limits.fair_share)
        self.placement = CachePlacement(self.limits.routing, self.limits.local_prefill_max_tokens)
        self.prefix_index = self.placement.index
        # Prompt tokens predicted cached at dispatch against those the workers found.
        self.num_predicted_cached_tokens = 0
        self.num_actual_cached_tokens = 0

    # -- peers --------------------------------------------------------------------------------

    def on_hello(self, identity: bytes, hello: wire.Hello, now: float) -> list[Outgoing]:
        if hello.role == "gateway":
            self.gateways[hello.peer_id] = GatewayState(hello.peer_id, identity, hello.address)
        else:
            old = self.registry.remove(hello.peer_id)
            out = self._drop_worker(old, now) if old is not None else []
            self.prefix_index.register(hello.peer_id, hello.cache_key, hello.block_size)
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
            return out + self.dispatch(now)
        return []

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
            return [Outgoing(identity, ack)]
        worker.last_heartbeat = now
        worker.num_free_blocks = within_pool(worker, heartbeat.num_free_blocks)
        worker.num_running = heartbeat.num_running
        worker.num_waiting = heartbeat.num_waiting
        worker.num_swapped = heartbeat.num_swapped
        worker.recent_batch_sizes = heartbeat.recent_batch_sizes
        worker.prefill_tokens_per_s = routing_rate(heartbeat.prefill_tokens_per_s)
        worker.step_s = routing_step_s(heartbeat.step_s)
        worker.num_prefix_query_tokens = heartbeat.num_prefix_query_tokens
        worker.num_prefix_hit_tokens = heartbeat.num_prefix_hit_tokens
        self.prefix_index.apply(
            worker.peer_id,
            heartbeat.cache_events_seq,
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
        # The heartbeat's free-block count already reflects every reservation made so far.
        worker.num_promised_blocks = 0
        stale = [
            Outgoing(identity, wire.Cancel(request_id=request_id, reason="abandoned"))
            for request_id in heartbeat.request_ids
            if request_id in self.abandoned
        ]
        return stale + self.dispatch(now)

    def tick(self, now: float) -> list[Outgoing]:
        """Takes silent workers out of rotation and re-routes requests whose phase timed out."""
        out: list[Outgoing] = []
        for worker in self.registry.expired(now):
            self.registry.remove(worker.peer_id)
            out += self._drop_worker(worker, now)
        for request in list(self.requests.values()):
            if (
                request.phase == Phase.QUEUED
                and now - request.arrival > self.limits.max_queue_time_s
            ):
                out += self._time_out(request, now)
                continue
            if now <= request.phase_deadline:
                continue
            if request.phase == Phase.RESERVING:
                out += self._requeue(request, now, cancel_reason="timed out")
            elif request.phase == Phase.PREFILLING:
                out += self._lose(request, "the prefill and its KV transfer timed out")
        return out + self.dispatch(now)

    # -- requests -----------------------------------------------------------------------------

    def on_submit(self, identity: bytes, submit: wire.Submit, now: float) -> list[Outgoing]:
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
            return [Outgoing(identity, reply)]
        party = self.queue.party_for(submit.tenant, num_prefill_tokens(submit), submit.bulk)
        request = TrackedRequest(submit, submit.gateway_peer_id, party, arrival=now)
        self.requests[submit.request_id] = request
        self._enqueue(request, now)
        accepted = wire.SubmitReply(
            request_id=submit.request_id,
            accepted=True,
            status_code=200,
            message=None,
            retry_after_s=None,
        )
        return [Outgoing(identity, accepted)] + self.dispatch(now)

    def _admission_refusal(
        self, submit: wire.Submit, now: float
    ) -> tuple[int, str, float | None] | None:
        if submit.request_id in self.requests:
            return 400, f"request id {submit.request_id!r} is already in flight", None
        prefill, decode = (
            self.registry.healthy("prefill", now),
            self.registry.healthy("decode", now),
        )
        if not prefill or not decode:
            message = "no prefill or no decode worker is registered and making progress"
            return 503, message, self.limits.retry_after_s
        needed = len(submit.prompt_token_ids) + submit.sampling.max_tokens
        capacity = max(w.num_total_blocks * w.block_size for w in decode)
        if needed > capacity:
            return self._past_capacity(needed, capacity)
        # A prompt past every prefill worker's cache, registered ones (a prefill worker refuses
        # it for good; before December 2026 it was admitted and failed as a 500).
        num_prefill = num_prefill_tokens(submit) + 1
        largest = max(w.num_total_blocks * w.block_size for w in self.registry.by_role("prefill"))
        if num_prefill > largest:
            message = (
                f"the prompt ({num_prefill} tokens with its first) can never fit the KV cache "
                f"of a prefill worker (the largest holds {largest})"
            )
            return 400, message, None
        if submit.resumed_from is not None:
            return None  # admitted before its worker was lost: load does not refuse it now
        # Interactive requests are bounded by the interactive ones queued (queued batch lines
        # never get a chat refused), a batch line by everything queued: a scan. (The reference
        # bounded both by everything queued, so a run whose batch lines filled the queue met
        # the indexed core's acceptance with a 429.)
        queued = [item for item in self.queue if submit.bulk or not item.bulk]
        too_many = len(queued) >= self.limits.max_queued_requests
        num_queued_tokens = sum(item.num_prompt_tokens for item in queued)
        too_long = num_queued_tokens + num_prefill_tokens(submit) > self.limits.max_queued_tokens
        if too_many or too_long:
            return 429, "the queue is full; retry later", self.limits.retry_after_s
        return None

    def _past_capacity(self, needed: int, capacity: int) -> tuple[int, str, float | None]:
        """A request past the KV cache of every decode worker making progress (`capacity`
        tokens): 400 when it is past every registered one's too, else 503, as when no worker is
        up: the one that could hold it is stalled and may move again (its request refused 400
        would fail for good, a resumed one too)."""
        largest = max(w.num_total_blocks * w.block_size for w in self.registry.by_role("decode"))
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
        request = self.requests.get(cancel.request_id)
        if request is None:
            return []
        return self._forget(request, cancel_reason=cancel.reason)

    def on_reserve_reply(self, reply: wire.ReserveReply, now: float) -> list[Outgoing]:
        request = self.requests.get(reply.request_id)
        worker = self.registry.get(request.decode_peer_id) if request else None
        if request is None or request.phase != Phase.RESERVING or worker is None:
            return []
        if reply.peer_id != request.decode_peer_id:  # a late answer to an attempt given up on
            return []
        if not reply.ok:
            worker.num_free_blocks = within_pool(worker, reply.num_free_blocks)
            return self._requeue(request, now, cancel_reason=None) + self.dispatch(now)
        prefill = self.registry.get(request.prefill_peer_id) if request.prefill_peer_id else None
        if prefill is None or not prefill.making_progress(now, self.limits.progress_timeout_s):
            return self._requeue(request, now, cancel_reason="no prefill worker")
        request.phase = Phase.PREFILLING
        request.phase_deadline = now + self.limits.prefill_timeout_s
        submit = request.submit
        held = self._num_held_tokens(prefill, request.placed_as_bulk) - request.num_prefill_tokens
        if self.placement.prefills_locally(submit, reply.num_cached_blocks, worker, prefill, held):
            # The decode worker computes the short suffix itself: the prefill worker is out.
            prefill.request_ids.discard(request.request_id)
            request.prefill_peer_id = worker.peer_id
            prefill = worker
        request.num_predicted_cached_tokens = self.placement.cached_on(prefill.peer_id, submit)
        job = wire.PrefillJob(
            request_id=submit.request_id,
            prompt_token_ids=submit.prompt_token_ids,
            sampling=submit.sampling,
            gateway_address=self.gateways[request.gateway_peer_id].address,
            decode_peer_id=worker.peer_id,
            decode_address=worker.address,
            output_token_ids=submit.output_token_ids,
            priority=submit.priority,
            cache_salt=submit.tenant,
            num_skip_blocks=reply.num_cached_blocks,
            bulk=request.placed_as_bulk,
        )
        return [Outgoing(prefill.identity, job)]

    def on_request_done(self, done: wire.RequestDone, now: float) -> list[Outgoing]:
        request = self.requests.get(done.request_id)
        if request is None:
            return []
        if done.num_output_tokens > 0:
            self.queue.charge(request.party, num_output_tokens=done.num_output_tokens)
        if done.phase == "prefill":
            if request.phase != Phase.PREFILLING or request.prefill_peer_id != done.peer_id:
                return []  # a report from an attempt the scheduler already gave up on
            prefill = self.registry.get(done.peer_id)
            if prefill is not None and done.peer_id != request.decode_peer_id:
                prefill.request_ids.discard(done.request_id)
            if done.finish_reason in (None, "stop", "length"):
                self.num_predicted_cached_tokens += request.num_predicted_cached_tokens
                self.num_actual_cached_tokens += done.num_cached_tokens
            if done.finish_reason is None:  # KV handed to the decode worker, which now owns it
                request.phase = Phase.DECODING
                request.prefill_peer_id = None
                return self.dispatch(now)
            if done.finish_reason == "error":  # the transfer failed: try again elsewhere
                return self._lose(request, "the KV transfer failed") + self.dispatch(now)
            # Finished at its first token: the decode reservation is no longer needed.
            return self._forget(request, cancel_reason="finished in prefill") + self.dispatch(now)
        if done.finish_reason == "preempted":  # handed back by the decode worker for recompute
            reason = f"preempted on {done.peer_id} for recompute"
            return self._lose(request, reason, "preempted") + self.dispatch(now)
        self._forget(request, cancel_reason=None)
        return self.dispatch(now)

    # -- dispatch -----------------------------------------------------------------------------

    def dispatch(self, now: float) -> list[Outgoing]:
        """Hands the policy's next requests to prefill workers with room, decode reserved first."""
        out: list[Outgoing] = []
        while len(self.queue):
            prefills = self.registry.healthy("prefill", now)
            if not prefills:
                break
            windows = {w.peer_id: self._window(w) for w in prefills}
            item = self.queue.pop_next(now, functools.partial(self._placeable, windows, now))
            if item is None:
                break
            charged = item.num_prompt_tokens - item.num_cached_tokens
            self.requests[item.request_id].num_charged_tokens = charged
            bulk = self._as_bulk(item, now)
            self.requests[item.request_id].placed_as_bulk = bulk
            num_tokens = item.num_prompt_tokens
            prefill = self.placement.choose_prefill(
                [w for w in prefills if _takes(windows[w.peer_id], w, num_tokens, bulk)],
                self.requests[item.request_id].submit,
                self._num_held_tokens,
                lambda w, windows=windows: windows[w.peer_id].small_room,
            )
            out.append(self._reserve(self.requests[item.request_id], prefill, now))
        return out

    def _num_held_tokens(self, worker: WorkerState, bulk: bool = True) -> int:
        """Prompt tokens assigned to a prefill worker and not yet done (`bulk` false: only
        interactive requests', what an interactive prompt waits behind)."""
        return sum(
            self.requests[r].num_prefill_tokens
            for r in worker.request_ids
            if r in self.requests and (bulk or not self.requests[r].placed_as_bulk)
        )

    def _placeable(
        self, windows: dict[str, PrefillWindow], now: float, item: QueuedRequest
    ) -> bool:
        """Some prefill worker's window takes it, and some decode worker can hold it."""
        bulk = self._as_bulk(item, now)
        prefills = self.registry.healthy("prefill", now)
        if not any(_takes(windows[w.peer_id], w, item.num_prompt_tokens, bulk) for w in prefills):
            return False
        num_tokens, seat_share = item.num_prompt_tokens + 1, self._seat_share(bulk)
        needed = num_needed_tokens(self.requests[item.request_id].submit)
        return self.registry.pick_decode(num_tokens, now, None, seat_share, needed) is not None

    def _as_bulk(self, item: QueuedRequest, now: float) -> bool:
        """Placed as a batch line: a bulk request that has waited `bulk_max_wait_s` competes
        as interactive, for an interactive request's window room and seat."""
        return item.bulk and now - item.arrival < self.limits.fair_share.bulk_max_wait_s

    def _seat_share(self, bulk: bool) -> float:
        return self.limits.bulk_seat_share if bulk else 1.0

    def _reserve(self, request: TrackedRequest, prefill: WorkerState, now: float) -> Outgoing:
        num_prompt_tokens = request.num_prefill_tokens
        self.num_queued_tokens -= num_prompt_tokens
        self.max_queue_wait_s = max(self.max_queue_wait_s, now - request.queued_at)
        # Room for the prompt and the first decode step; later growth is the worker's affair.
        num_tokens = num_prompt_tokens + 1
        decode = self.registry.pick_decode(
            num_tokens,
            now,
            self.placement.decode_affinity(request.submit),
            self._seat_share(request.placed_as_bulk),
            num_needed_tokens(request.submit),
        )
        assert decode is not None, "the policy only picks placeable requests"
        request.phase = Phase.RESERVING
        request.decode_peer_id = decode.peer_id
        request.prefill_peer_id = prefill.peer_id
        request.num_blocks = decode.blocks_for(num_tokens)
        request.phase_deadline = now + self.limits.reserve_timeout_s
        decode.num_promised_blocks += request.num_blocks
        self.dispatched.append(
            Dispatched(request.request_id, now - request.queued_at, prefill.peer_id, decode.peer_id)
        )
        decode.request_ids.add(request.request_id)
        prefill.request_ids.add(request.request_id)
        submit = request.submit
        reserve = wire.Reserve(
            request_id=request.request_id,
            num_tokens=num_tokens,
            lease_s=self.limits.prefill_timeout_s,
            token_ids=list(submit.prompt_token_ids) + list(submit.output_token_ids),
            cache_salt=submit.tenant,
        )
        return Outgoing(decode.identity, reserve)

    def _window(self, worker: WorkerState) -> PrefillWindow:
        window = PrefillWindow(self.limits.prefill_window_tokens, self.limits.bulk_window_share)
        for request_id in worker.request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                window.hold(request.num_prefill_tokens, request.placed_as_bulk)
        return window

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
                num_cached_tokens=self.placement.most_cached(submit, list(self.registry.workers)),
            )
        )
        self.num_queued_tokens += request.num_prefill_tokens

    # -- helpers ------------------------------------------------------------------------------

    def _cancel_on_workers(self, request: TrackedRequest, reason: str) -> list[Outgoing]:
        out = []
        # A prefill worker chosen for a request still reserving has heard nothing of it yet.
        prefill_holds_state = request.phase >= Phase.PREFILLING
        for peer_id, holds_state in (
            (request.prefill_peer_id, prefill_holds_state),
            (request.decode_peer_id, True),
        ):
            worker = self.registry.get(peer_id) if peer_id else None
            if worker is None:
                continue
            worker.request_ids.discard(request.request_id)
            if holds_state:
                cancel = wire.Cancel(request_id=request.request_id, reason=reason)
                out.append(Outgoing(worker.identity, cancel))
        return out

    def _requeue(
        self, request: TrackedRequest, now: float, cancel_reason: str | None
    ) -> list[Outgoing]:
        """Back to the queue with its first arrival time (so it ages from then), releasing
        whatever workers hold for it."""
        out = self._cancel_on_workers(request, cancel_reason) if cancel_reason else []
        if cancel_reason is None and request.decode_peer_id:
            worker = self.registry.get(request.decode_peer_id)
            if worker is not None:
                worker.request_ids.discard(request.request_id)
        if cancel_reason is None and request.prefill_peer_id:
            worker = self.registry.get(request.prefill_peer_id)
            if worker is not None:
                worker.request_ids.discard(request.request_id)
        request.phase = Phase.QUEUED
        request.decode_peer_id = request.prefill_peer_id = None
        request.phase_deadline = float("inf")
        # Its uncached part was charged when dispatched; it will be again when dispatched anew.
        self.queue.charge(request.party, num_prompt_tokens=-request.num_charged_tokens)
        self._enqueue(request, now)
        return out

    def _forget(self, request: TrackedRequest, cancel_reason: str | None) -> list[Outgoing]:
        self.requests.pop(request.request_id, None)
        self.placement.forget(request.request_id)
        if cancel_reason is not None or request.phase != Phase.QUEUED:
            self._abandon(request.request_id)
        if request.phase == Phase.QUEUED:
            self.queue.remove(request.request_id)
            self.num_queued_tokens -= request.num_prefill_tokens
            return []
        if cancel_reason is not None:
            return self._cancel_on_workers(request, cancel_reason)
        for peer_id in (request.prefill_peer_id, request.decode_peer_id):
            worker = self.registry.get(peer_id) if peer_id else None
            if worker is not None:
                worker.request_ids.discard(request.request_id)
        return []

    def _drop_worker(self, worker: WorkerState, now: float) -> list[Outgoing]:
        """A worker left: re-route what can be, fail what cannot."""
        self.prefix_index.remove(worker.peer_id)
        out: list[Outgoing] = []
        for request_id in sorted(worker.request_ids):  # (as the core: not the set's order)
            request = self.requests.get(request_id)
            if request is None:
                continue
            if request.phase >= Phase.PREFILLING:
                # If it is alive after all (a long stall), it must stop working for nobody.
                out += self._lose(request, f"worker {worker.peer_id} stopped responding")
                out.append(
                    Outgoing(worker.identity, wire.Cancel(request_id=request_id, reason="lost"))
                )
            else:
                if request.decode_peer_id == worker.peer_id:
                    request.decode_peer_id = None
                    cancel = wire.Cancel(request_id=request_id, reason="lost")
                    out.append(Outgoing(worker.identity, cancel))
                if request.prefill_peer_id == worker.peer_id:
                    request.prefill_peer_id = None
                out += self._requeue(request, now, cancel_reason=f"worker {worker.peer_id} left")
        return out

    def _time_out(self, request: TrackedRequest, now: float) -> list[Outgoing]:
        """A request that waited in the queue past the limit: its client gets a 504."""
        self._forget(request, cancel_reason=None)
        self._abandon(request.request_id)
        gateway = self.gateways.get(request.gateway_peer_id)
        if gateway is None:
            return []
        message = (
            f"queued {now - request.arrival:.0f} s without a worker free for it "
            f"(max_queue_time_s {self.limits.max_queue_time_s:g})"
        )
        delta = wire.TokenDelta(
            request_id=request.request_id, token_ids=[], finish_reason="timeout", error=message
        )
        return [Outgoing(gateway.identity, wire.Tokens(deltas=[delta]))]

    def _abandon(self, request_id: str) -> None:
        """Remembers a request given up on (a bounded memory: the oldest go first). A request
        finished normally is remembered too: a worker that still lists it lost track."""
        self.abandoned[request_id] = None
        while len(self.abandoned) > MAX_ABANDONED:
            del self.abandoned[next(iter(self.abandoned))]

    def _lose(
        self, request: TrackedRequest, reason: str, finish_reason: str = "lost"
    ) -> list[Outgoing]:
        """Gives a request whose tokens may have reached its client back to its gateway, which
        alone knows which did: it resumes the request from them (or fails it). Re-running it
        here could repeat a token the client has or skip one it lacks."""
        out = self._forget(request, cancel_reason="lost")
        gateway = self.gateways.get(request.gateway_peer_id)
        if gateway is not None:
            delta = wire.TokenDelta(
                request_id=request.request_id,
                token_ids=[],
                finish_reason=finish_reason,
                error=reason,
            )
            out.append(Outgoing(gateway.identity, wire.Tokens(deltas=[delta])))
        return out

    def take_dispatched(self) -> list[Dispatched]:
        taken, self.dispatched = self.dispatched, []
        return taken

    def cluster_status(self, now: float) -> wire.ClusterStatus:
        """Counts the workers that are making progress: what /ready reports."""
        decode = self.registry.healthy("decode", now)
        return wire.ClusterStatus(
            num_prefill=len(self.registry.healthy("prefill", now)),
            num_decode=len(decode),
            num_decode_free_blocks=sum(w.num_free_blocks for w in decode),
            num_decode_total_blocks=sum(w.num_total_blocks for w in decode),
            num_queued=len(self.queue),
            num_in_flight=len(self.requests),
            num_swap_preemptions=sum(w.num_preemptions["swap"] for w in decode),
            num_recompute_preemptions=sum(w.num_preemptions["recompute"] for w in decode),
            policy=self.queue.config.policy,
            max_queue_wait_s=self.max_queue_wait_s,
            service=self._service(),
            workers=[self._worker_status(w, now) for w in self.registry.workers.values()],
            num_predicted_cached_tokens=self.num_predicted_cached_tokens,
            num_actual_cached_tokens=self.num_actual_cached_tokens,
        )

    def _service(self) -> list[wire.PartyService]:
        queued = self.queue.num_queued_by_party()
        served = self.queue.served_tokens
        # Past the cut, those with requests queued first, then the most served; by name.
        ranked = sorted(
            served.keys() | queued.keys(), key=lambda p: (not queued.get(p), -served.get(p, 0), p)
        )
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
            role=worker.role,
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


def _takes(window: PrefillWindow, worker: WorkerState, num_prompt_tokens: int, bulk: bool) -> bool:
    """The worker's window takes the prompt, and its KV cache holds it with its first token."""
    pool = worker.num_total_blocks * worker.block_size
    return window.takes(num_prompt_tokens, bulk) and pool >= num_prompt_tokens + 1
