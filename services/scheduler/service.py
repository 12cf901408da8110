"""`tandem scheduler`: the scheduler process, a ROUTER socket around the pure `ClusterScheduler`.

Gateways and workers connect DEALER sockets to the scheduler's ROUTER. The loop reads whatever
arrived, hands each message to the core with the current time, sends what the core answers, and
ticks the core (heartbeat expiry, timeouts, dispatch) and the gateways' cluster status on a timer.
A malformed message is logged and dropped; it never stops the loop.

A brief cut of a peer's connection (a network blip, neither process restarted) loses no message
of the scheduler's. Each peer's DEALER names itself with a routing id of its own, the same on
every connection (`shared.endpoints.routing_id`), and the ROUTER hands that name over to the new
connection (ROUTER_HANDOVER): what the core sends to the identity it registered reaches the
peer as soon as it is back. Without it the ROUTER named the new connection anew, and what went to
the old name was dropped until the peer said who it was again: a worker at its next heartbeat,
a gateway after seconds of the status' silence, and the "lost" word of a request, or its
stream's end, dropped meanwhile left it waiting out its time limit. What is sent while the
peer's connection is down is held for it (the ROUTER is ROUTER_MANDATORY: an unreachable peer
is an error, not silence) and sent, in order, once it is back (`Undelivered`): looked at every
tick, and at once when the peer's next message arrives; dropped, logged, if it stays away
longer than a heartbeat timeout (a worker is out of rotation by then, what it held re-routed).
The status is not held: the next tick's replaces it. What the dying connection had taken in
before the cut was seen (half-open, its bytes in flight) is lost as before: that is the
gateway's watch for silence to catch (`services/gateway/cluster.py`).
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import math
import signal
import time
import uuid
from collections import deque
from dataclasses import dataclass

import zmq

from services import compiled
from services.scheduler import core as core_module
from services.scheduler.cache_routing import RoutingWeights
from services.scheduler.connections import ConnectionWatch
from services.scheduler.core import SHARES, ClusterScheduler, Outgoing, SchedulerLimits
from services.scheduler.fair_share import FairShareConfig
from services.scheduler.wait_forecast import DEADLINE_SHARE
from services.scheduler.worker_index import BULK_SEAT_SHARE, BULK_WINDOW_SHARE
from shared import wire
from shared.binding import bind
from shared.config import (
    ConfigError,
    CurveSettings,
    add_config_arguments,
    config_from_args,
    env_name,
    flag_name,
    require_address,
    require_port,
    require_positive,
    setting,
)
from shared.curve import Security
from shared.failures import FailureWindow
from shared.gc_policy import DEFAULT_THAW_EVERY_S, CollectionTimer, SurvivorFreezer
from shared.lifecycle import SchedulerEvents
from shared.logs import configure_logging, get_logger
from shared.metrics import serve_metrics


@dataclass(frozen=True)
class SchedulerConfig(CurveSettings):
    address: str = setting("ipc:///tmp/tandem/scheduler.sock", "ROUTER address to bind")
    heartbeat_interval_s: float = setting(0.5, "how often workers send heartbeats")
    heartbeat_timeout_s: float = setting(10.0, "silence after which a worker is out of rotation")
    max_queued_requests: int = setting(1024, "queued requests beyond which 429 is answered")
    max_queued_tokens: int = setting(1 << 20, "queued prompt tokens beyond which 429 is answered")
    reserve_timeout_s: float = setting(5.0, "time a decode worker has to confirm a reservation")
    prefill_timeout_s: float = setting(300.0, "time a prefill and its KV transfer may take")
    max_queue_time_s: float = setting(
        600.0, "a request queued this long is failed (504) instead of waiting on"
    )
    progress_timeout_s: float = setting(
        60.0, "a worker busy this long without completing a step is stuck: no new work, not ready"
    )
    model: str = setting("smollm2", "the model every peer must serve")
    policy: str = setting("fair", "queue order: fair (token-cost fair share) or fcfs")
    class_thresholds: tuple[int, ...] = setting(
        (1024,), "prompt tokens at which each next class starts (one threshold: short and long)"
    )
    class_weights: tuple[float, ...] = setting((1.0, 1.0), "fair-share weight of each class")
    tenant_weights: tuple[str, ...] = setting((), "tenant=weight pairs (others weigh 1)")
    max_queue_wait_s: float = setting(
        30.0, "aging bound: a request queued this long goes first, whatever the shares"
    )
    prefill_window_tokens: int = setting(
        2048, "prompt tokens handed to a prefill worker ahead of its progress"
    )
    bulk_window_share: float = setting(
        BULK_WINDOW_SHARE,
        "batch lines go to a prefill worker holding less than this share of its window (0-1: "
        "higher keeps it busier between steps, lower leaves interactive prompts more room)",
    )
    bulk_seat_share: float = setting(
        BULK_SEAT_SHARE,
        "batch lines take at most this share of a decode worker's seats (--max-num-seqs), the "
        "rest kept for interactive requests (0-1: higher batches more lines per step, lower "
        "leaves more seats for a burst of chats)",
    )
    local_prefill_max_tokens: int = setting(
        256,
        "a decode worker holding all of a prompt but at most this many tokens prefills them "
        "itself (no KV handoff); 0: never",
    )
    speculative_prefill: bool = setting(
        True,
        "send the prefill job with a busy decode worker's reservation, not after its answer "
        "(the first token does not wait for the decode worker's step)",
    )
    refuse_past_deadline: bool = setting(
        True,
        "refuse (429) an interactive request forecast to wait past --deadline-share of its "
        "gateway's first-token timeout (the prompt tokens ahead of it at the pace served while "
        "backlogged), instead of queueing it to time out",
    )
    deadline_share: float = setting(
        DEADLINE_SHARE,
        "the share of the first-token timeout a forecast wait may reach before a request is "
        "refused (0-1: lower refuses earlier, with more margin for a forecast too hopeful)",
    )
    route_queued_weight: float = setting(
        1.0, "prefill choice: weight of the prompt work a worker already holds"
    )
    route_uncached_weight: float = setting(
        1.0, "prefill choice: weight of the prompt tokens its prefix cache does not hold"
    )
    metrics_port: int | None = setting(
        None, "HTTP port of the Prometheus /metrics (0: any free port; unset: not served)"
    )
    metrics_host: str = setting("127.0.0.1", "host the /metrics server binds")
    indexes: str = setting(
        "auto",
        "the fair queue's and the decode room's indexes: auto (in C, compiled here on first use "
        "with $CC or cc, if it builds; else Python, with a warning), native (C or fail) or "
        "python (the same decisions either way)",
    )
    gc_thaw_every_s: float = setting(
        DEFAULT_THAW_EVERY_S,
        "garbage collection: what survives a full collection is frozen (never walked again), "
        "and once per this many seconds the whole heap is walked; 0: Python's default, every "
        "full collection walks every queued request (shared/gc_policy.py)",
    )

    def __post_init__(self) -> None:
        self.curve_keys()
        if not self.gc_thaw_every_s >= 0:
            raise ConfigError(
                f"gc_thaw_every_s (--gc-thaw-every-s / TANDEM_GC_THAW_EVERY_S) must be >= 0, "
                f"got {self.gc_thaw_every_s}"
            )
        if self.local_prefill_max_tokens < 0:
            raise ConfigError(
                "local_prefill_max_tokens (--local-prefill-max-tokens / "
                "TANDEM_LOCAL_PREFILL_MAX_TOKENS) must be >= 0"
            )
        try:
            self.routing()
        except ValueError as error:
            raise ConfigError(
                f"{error} (--route-queued-weight, --route-uncached-weight / "
                "TANDEM_ROUTE_QUEUED_WEIGHT, TANDEM_ROUTE_UNCACHED_WEIGHT)"
            ) from None
        for name in (*SHARES, "indexes"):
            try:  # the limits hold the rule
                SchedulerLimits(**{name: getattr(self, name)})
            except ValueError as error:
                flag = name.replace("_", "-")
                raise ConfigError(f"{error} (--{flag} / TANDEM_{name.upper()})") from None
        require_address(self, "address")
        require_port(self, "metrics_port")
        require_positive(
            self,
            "heartbeat_interval_s",
            "heartbeat_timeout_s",
            "max_queued_requests",
            "max_queued_tokens",
            "reserve_timeout_s",
            "prefill_timeout_s",
            "progress_timeout_s",
            "max_queue_time_s",
            "max_queue_wait_s",
            "prefill_window_tokens",
        )
        for name in ("heartbeat_timeout_s", "progress_timeout_s"):
            if getattr(self, name) <= self.heartbeat_interval_s:
                raise ConfigError(
                    f"{name} ({flag_name(name)} / {env_name(name)}) must exceed "
                    f"heartbeat_interval_s ({self.heartbeat_interval_s:g}): workers beat once "
                    f"an interval, and each would look gone (or stuck) between two beats"
                )
        try:
            self.fair_share()
        except ValueError as error:
            raise ConfigError(f"fair share settings: {error}") from None

    def fair_share(self) -> FairShareConfig:
        weights = {}
        for pair in self.tenant_weights:
            tenant, _, weight = pair.partition("=")
            try:
                weights[tenant] = float(weight)
            except ValueError:
                raise ValueError(f"tenant_weights entry {pair!r} is not tenant=weight") from None
        num_classes = len(self.class_thresholds) + 1
        names = (
            ("short", "long")
            if num_classes == 2
            else tuple(f"class{i}" for i in range(num_classes))
        )
        return FairShareConfig(
            policy=self.policy,
            class_thresholds=self.class_thresholds,
            class_names=names,
            class_weights=self.class_weights,
            tenant_weights=weights,
            max_wait_s=self.max_queue_wait_s,
        )

    def routing(self) -> RoutingWeights:
        return RoutingWeights(self.route_queued_weight, self.route_uncached_weight)

    def queue_time_warning(self) -> str | None:
        """What a `max_queue_time_s` at or below the fair share's `bulk_max_wait_s` does: a batch
        line competes as interactive once it has waited that long (so that a job is never
        starved), and the 504 came first: under steady interactive load every line of a job
        failed, nothing said why. Warned of, not refused: a cluster that runs no batch jobs may
        want the short limit. None for a limit past it."""
        if self.max_queue_time_s > self.fair_share().bulk_max_wait_s:
            return None
        return (
            "max_queue_time_s (--max-queue-time-s / TANDEM_MAX_QUEUE_TIME_S) is at most the "
            "fair share's bulk_max_wait_s: a batch line is failed (504) before it would compete "
            "as interactive, so under steady interactive load a batch job's lines can all fail"
        )

    def limits(self) -> SchedulerLimits:
        return SchedulerLimits(
            max_queued_requests=self.max_queued_requests,
            max_queued_tokens=self.max_queued_tokens,
            heartbeat_timeout_s=self.heartbeat_timeout_s,
            # Three beats: a live worker whose connection blipped is back and beating by then.
            disconnect_grace_s=min(self.heartbeat_timeout_s, 3 * self.heartbeat_interval_s),
            reserve_timeout_s=self.reserve_timeout_s,
            prefill_timeout_s=self.prefill_timeout_s,
            progress_timeout_s=self.progress_timeout_s,
            max_queue_time_s=self.max_queue_time_s,
            prefill_window_tokens=self.prefill_window_tokens,
            bulk_window_share=self.bulk_window_share,
            bulk_seat_share=self.bulk_seat_share,
            fair_share=self.fair_share(),
            routing=self.routing(),
            local_prefill_max_tokens=self.local_prefill_max_tokens,
            speculative_prefill=self.speculative_prefill,
            refuse_past_deadline=self.refuse_past_deadline,
            deadline_share=self.deadline_share,
            indexes=self.indexes,
        )


# Beyond any real worker's, and small enough that the registry's C rooms count in 64 bits
# (blocks times block size, seats summed over a thousand workers): the wire takes any int.
MAX_BLOCK_SIZE = 1 << 16
MAX_NUM_SEQS = 1 << 20
MAX_KV_BLOCKS = 1 << 40


def worker_shape_refusal(hello: wire.Hello) -> str | None:
    """Why a worker's KV cache, as its HELLO describes it, cannot be counted in (the registry
    divides by its block size and seats); None when it can, and for a gateway."""
    if hello.role == "gateway":
        return None
    if (
        1 <= hello.block_size <= MAX_BLOCK_SIZE
        and 1 <= hello.max_num_seqs <= MAX_NUM_SEQS
        and 0 <= hello.num_kv_blocks <= MAX_KV_BLOCKS
    ):
        return None
    return (
        f"a {hello.role} worker needs block_size in [1, {MAX_BLOCK_SIZE}], max_num_seqs in "
        f"[1, {MAX_NUM_SEQS}] and num_kv_blocks in [0, {MAX_KV_BLOCKS}], got "
        f"{hello.block_size}, {hello.max_num_seqs} and {hello.num_kv_blocks}"
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_arguments(parser, SchedulerConfig)


def drain_deadline(next_tick: float, now: float) -> float:
    """Until when a turn reads messages before the tick: when the tick is due (under a flood the
    socket never empties, and the tick must not wait for it to). A turn that comes late by some
    seconds (the process was stopped, or starved of the CPU) finds those seconds' heartbeats
    unread, and a tick before reading them takes every worker for silent: after a 20 s SIGSTOP
    the scheduler dropped its healthy workers and resumed their requests for nothing. Reading is
    faster than the messages came, so the lateness bounds the reading."""
    late_s = now - next_tick
    return next_tick if late_s <= 0 else now + late_s


class CatchUp:
    """Whether a due tick may judge silence now. A turn that comes late by more than a
    heartbeat interval (the process was stopped, or starved of the CPU) reads what arrived
    meanwhile first (`drain_deadline`), but not what the sockets still hold: ZeroMQ's own
    thread, stopped too, is still moving those seconds' messages from the kernel, and a tick
    then took a worker whose heartbeats were on their way for silent (1 in 8 runs of
    `test_scheduler_stall.py` under load). Such a tick waits one interval, once: a scheduler
    late at every turn (overloaded) still ticks every other one."""

    def __init__(self, heartbeat_interval_s: float) -> None:
        self.heartbeat_interval_s = heartbeat_interval_s
        self.waited = False

    def caught_up(self, now: float, due: float) -> bool:
        if now - due <= self.heartbeat_interval_s or self.waited:
            self.waited = False
            return True
        self.waited = True
        return False


def run(args: argparse.Namespace) -> int:
    configure_logging("scheduler")
    SchedulerService(config_from_args(SchedulerConfig, args)).serve_forever()
    return 0


class SchedulerService:
    def __init__(self, config: SchedulerConfig, context: zmq.Context | None = None):
        self.config = config
        self.core = ClusterScheduler(config.limits())
        self.context = context or zmq.Context.instance()
        self.log = get_logger()
        self.security = Security(config.curve_keys(), self.log)
        self.security.start(self.context)
        self.socket = self.security.server(self.context.socket(zmq.ROUTER))
        self.socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        # A peer unreachable is an error (its message held, `Undelivered`), not a silent drop;
        # a peer reconnecting under its routing id takes it over from its dead connection.
        self.socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.socket.setsockopt(zmq.ROUTER_HANDOVER, 1)
        bind(self.socket, config.address, "address")
        self.connections = ConnectionWatch(self.socket)  # a killed worker's, closed at once
        # Restarted under a running cluster, it waits the rejoin grace for its workers' HELLOs
        # before it refuses a SUBMIT for want of one (`awaiting_workers.py`).
        self.core.await_workers_until(time.monotonic() + self.core.limits.disconnect_grace_s)
        if (warning := config.queue_time_warning()) is not None:
            self.log.warning(
                warning,
                max_queue_time_s=config.max_queue_time_s,
                bulk_max_wait_s=config.fair_share().bulk_max_wait_s,
            )
        self.undelivered = Undelivered(keep_s=config.heartbeat_timeout_s)
        # Peers a send found unreachable, since when (the first such send since one got
        # through): a gateway unreachable past the heartbeat timeout is gone
        # (`_forget_gone_gateways`).
        self.unreachable_since: dict[bytes, float] = {}
        self.num_dropped_full = 0  # messages dropped on a peer's full queue (`_deliver`)
        self.events = SchedulerEvents(self.log)
        self.metrics_address: str | None = None
        self.epoch = uuid.uuid4().hex  # tells gateways this is a new scheduler, after a restart
        self._last_turn = time.monotonic()
        self.failures = FailureWindow()  # of messages: see `_handle_guarded`
        self._stopping = False

    def stop(self, *_: object) -> None:
        self._stopping = True

    def health(self) -> str | None:
        """What /health says: None while the loop turns, else why not."""
        stalled = time.monotonic() - self._last_turn
        if stalled > max(10.0, 4 * self.config.heartbeat_interval_s):
            return f"the scheduler loop has not turned for {stalled:.0f} s"
        return None

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        if self.config.metrics_port is not None:
            self.metrics_address = serve_metrics(
                self.events.registry,
                self.config.metrics_host,
                self.config.metrics_port,
                self.health,
            )
        self.log.info(
            "scheduler listening",
            address=self.config.address,
            metrics=self.metrics_address,
            core=compiled.kind(core_module),
            queue_index=self.core.queue.index_kind,
            decode_room=self.core.registry.decode_room_kind,
            prefill_room=self.core.registry.prefill_room_kind,
        )
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        monitor = self.connections.start()
        poller.register(monitor, zmq.POLLIN)
        gc_timer = CollectionTimer(self.events.gc_paused)
        thaw_every_s = self.config.gc_thaw_every_s
        freezer = SurvivorFreezer(thaw_every_s) if thaw_every_s > 0 else None
        next_tick = time.monotonic()  # (the first turn ticks at once)
        hearing = CatchUp(self.config.heartbeat_interval_s)
        try:
            while not self._stopping:
                # Whole milliseconds, rounded up: pyzmq truncates, which spins the last one.
                timeout_ms = math.ceil(max(0.0, next_tick - time.monotonic()) * 1000)
                ready = dict(poller.poll(timeout_ms))
                if self.socket in ready:
                    self._drain(until=drain_deadline(next_tick, time.monotonic()))
                if monitor in ready:
                    self._connections_closed(next_tick)
                now = self._last_turn = time.monotonic()
                if now >= next_tick and hearing.caught_up(now, next_tick):
                    self._tick_guarded(now)
                    if freezer is not None:
                        freezer.after_collections()
                    next_tick = now + self.config.heartbeat_interval_s / 2
                elif now >= next_tick:  # a stalled turn: the tick waits for what was sent
                    next_tick = now + self.config.heartbeat_interval_s
        finally:
            gc_timer.close()
            if freezer is not None:
                freezer.close()
            self.connections.close()
            self.socket.close(linger=0)
            self.security.stop()
            self.log.info("scheduler stopped")

    def _drain(self, until: float = math.inf) -> None:
        """Handles the messages that arrived, until none is left or the clock reaches `until`
        (the next tick's time): under a flood the socket never empties, and the tick (silent
        workers out of rotation, timeouts, the gateways' status) must not wait for it to end."""
        while True:
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            self._receive(frames)
            if time.monotonic() >= until:
                return

    def _connections_closed(self, next_tick: float) -> None:
        """Marks the workers whose connections closed (`connections.py`), after reading what
        arrived before: a closed connection's last heartbeat must not clear its own mark."""
        closed = self.connections.closed()
        if not closed:
            return
        self._drain(until=drain_deadline(next_tick, time.monotonic()))
        now = time.monotonic()
        for identity in closed:
            worker = self.core.on_connection_closed(identity, now)
            if worker is not None:
                self.log.info("worker connection closed", peer_id=worker.peer_id)

    def _receive(self, frames: list[zmq.Frame]) -> None:
        """One message off the socket: decoded and handled, or logged and dropped."""
        identity, body = frames[0].bytes, frames[1:]
        if self.undelivered.holds(identity):  # it is back: what waited for it goes first
            self._flush(identity)
        try:
            message = wire.decode(body)
        except wire.WireError as error:
            self.log.warning("dropped malformed message", error=str(error), peer=identity.hex())
            return
        if isinstance(message, (wire.Heartbeat, wire.Hello)):
            self.connections.saw(frames[0], identity)
        self._send(self._handle_guarded(identity, message, time.monotonic()))

    def _tick_guarded(self, now: float) -> None:
        """The periodic turn: workers gone silent dropped, deadlines settled, the status sent.
        An exception costs this turn, as one in a message's handling costs that message (see
        `_handle_guarded`): what the core built before it still goes out, and the next turn
        settles the rest; it ended the scheduler, and the queue with it."""
        try:
            for worker in self.core.registry.expired(now):
                self.log.warning(
                    "worker left rotation",
                    peer_id=worker.peer_id,
                    silent_s=round(now - worker.last_heartbeat, 1),
                    connection_closed=worker.disconnected_at is not None,
                )
            self._retry_undelivered(now)
            self._send(self.core.tick(now))
            self._broadcast_status(now)
            self._forget_gone_gateways(now)
        except Exception as error:
            self._send(self.core.take_outbox())
            self.events.message_failed("tick", None, error)
            self.failures.record()  # raises, and the scheduler exits, when failures persist

    def _handle_guarded(self, identity: bytes, message: wire.Message, now: float) -> list[Outgoing]:
        """`_handle`, where an exception the core did not mean (its refusals are answers, not
        raised: one raised is a bug) costs that message, not the scheduler: an exit would take
        the queue with it, and the gateways would resume every request it held, the one that
        broke it among them. The exception is logged with its traceback and counted; the
        messages the core had built before it (for other requests too: a dispatch pass places
        many) still go out; a SUBMIT is refused (500) and forgotten, anything else dropped, and
        the core's ticks settle what it left half done (deadlines, the workers' heartbeat
        lists). (A request whose placement raises in a dispatch pass is the core's to fail and
        `_send`'s to log: the message that began the pass is handled.) Failures that persist
        mean the core's state is wrong: the scheduler exits (`shared.failures`)."""
        try:
            return self._handle(identity, message, now)
        except Exception as error:
            built = self.core.take_outbox()
            request_id = getattr(message, "request_id", None)
            self.events.message_failed(type(message).__name__, request_id, error)
            self.failures.record()  # raises, and the scheduler exits, when failures persist
            if isinstance(message, wire.Submit):
                # Its acceptance may be built already (the pass after it raised): the refusal
                # is its one answer.
                built = [o for o in built if not _answers(o.message, message.request_id)]
                return built + self._submit_failed(identity, message, error, now)
            return built

    def _submit_failed(
        self, identity: bytes, submit: wire.Submit, error: Exception, now: float
    ) -> list[Outgoing]:
        """Refuses a SUBMIT whose handling raised, and forgets what of it the core took in."""
        message = f"the scheduler failed on this request ({type(error).__name__}; its log has "
        message += "the traceback)"
        refusal = wire.SubmitReply(
            request_id=submit.request_id,
            accepted=False,
            status_code=500,
            message=message,
            retry_after_s=None,
        )
        # (Counted and logged as it goes out: `_record_answer`.) The core may have dispatched
        # it before the handler raised: not logged nor timed as dispatched (the others it
        # dispatched are, and their reservations go out).
        self.core.forget_dispatch(submit.request_id)
        cancel = wire.Cancel(request_id=submit.request_id, reason="the scheduler failed on it")
        return [Outgoing(identity, refusal)] + self._handle_guarded(identity, cancel, now)

    def _handle(self, identity: bytes, message: wire.Message, now: float) -> list[Outgoing]:
        core = self.core
        match message:
            case wire.Hello():
                return self._hello(identity, message, now)
            case wire.Heartbeat():
                return core.on_heartbeat(identity, message, now)
            case wire.Submit():
                return self._submit(identity, message, now)
            case wire.Cancel():
                self.events.cancelled(message.request_id, message.reason)
                return core.on_cancel(message, now)
            case wire.ReserveReply():
                return core.on_reserve_reply(message, now)
            case wire.RequestDone():
                self.events.phase_done(message.request_id, message.phase, message.finish_reason)
                return core.on_request_done(message, now)
            case wire.Goodbye():
                self.log.info("worker left rotation", peer_id=message.peer_id, said="goodbye")
                return core.on_goodbye(identity, message, now)
        self.log.warning("dropped unexpected message", type=type(message).__name__)
        return []

    def _submit(self, identity: bytes, submit: wire.Submit, now: float) -> list[Outgoing]:
        out = self.core.on_submit(identity, submit, now)
        if self.core.awaiting_workers.holds(submit.request_id):  # answered when workers are back
            self.log.info("request awaits workers", request_id=submit.request_id)
        return out

    def _record_answer(self, reply: wire.SubmitReply) -> None:
        """A SUBMIT's answer, logged and counted as it goes out: now, or once the workers a
        scheduler just started waits for are back (`awaiting_workers.py`)."""
        if not reply.accepted:
            self.events.refused(reply.request_id, reply.status_code, reply.message or "")
        elif (request := self.core.requests.get(reply.request_id)) is not None:
            submit = request.submit
            self.events.queued(submit.request_id, len(submit.prompt_token_ids), submit.tenant)

    def _address_refusal(self, hello: wire.Hello) -> str | None:
        """Why others could not connect to the address a gateway or decode worker gives (the
        workers stream tokens to a gateway's and ship KV to a decode worker's), or None. Tried
        on a scratch socket: only ZeroMQ knows what it refuses."""
        if hello.role == "prefill":
            return None
        if hello.address is None:
            return f"a {hello.role} must give the address others connect to"
        probe = self.context.socket(zmq.PUSH)
        refusal = wire.connect_refusal(probe, hello.address)
        probe.close(linger=0)
        return refusal

    def _kv_layout_refusal(self, hello: wire.Hello) -> str | None:
        """Why a worker's KV could never pass to or from the workers already registered (a
        decode worker refuses KV of another block size or dtype), or None. Checked whether or
        not prefix caching is on: its cache key, which also covers these, is absent when off."""
        if hello.role == "gateway":
            return None
        for worker in self.core.registry.workers.values():
            if worker.peer_id == hello.peer_id:
                continue  # (registering again: it replaces itself)
            if (worker.block_size, worker.dtype) != (hello.block_size, hello.dtype):
                return (
                    f"KV block size {hello.block_size} and dtype {hello.dtype} differ from "
                    f"worker {worker.peer_id}'s ({worker.block_size}, {worker.dtype}): KV "
                    "could never pass between them"
                )
            return None  # (every registered worker passed this same check)
        return None

    def _hello(self, identity: bytes, hello: wire.Hello, now: float) -> list[Outgoing]:
        error = None
        if hello.schema_version != wire.SCHEMA_VERSION:
            error = f"schema version {hello.schema_version} != scheduler's {wire.SCHEMA_VERSION}"
        elif hello.model != self.config.model:
            error = f"model {hello.model!r} != cluster model {self.config.model!r}"
        else:
            error = (
                worker_shape_refusal(hello)
                or self._address_refusal(hello)
                or self._kv_layout_refusal(hello)
                or self.core.prefix_index.refusal(hello.cache_key, hello.peer_id)
            )
        ack = wire.HelloAck(
            schema_version=wire.SCHEMA_VERSION,
            accepted=error is None,
            error=error,
            heartbeat_interval_s=self.config.heartbeat_interval_s,
        )
        if error is not None:
            self.log.warning("peer refused", peer_id=hello.peer_id, error=error)
            return [Outgoing(identity, ack)]
        self.log.info("peer joined", peer_id=hello.peer_id, role=hello.role, address=hello.address)
        joined = [Outgoing(identity, ack), *self.core.on_hello(identity, hello, now)]
        if hello.role == "gateway":
            # The status (this scheduler's epoch) before any answer to its SUBMITs: coming at
            # the next tick, it made the gateway take the requests this scheduler had accepted
            # meanwhile for ones the scheduler before had lost, and resume each (a new attempt,
            # at the back of the queue, one of its resumptions spent).
            joined.append(Outgoing(identity, self._status(now)))
        return joined

    def _status(self, now: float) -> wire.ClusterStatus:
        return dataclasses.replace(
            self.core.cluster_status(now),
            scheduler_metrics_address=self.metrics_address,
            scheduler_epoch=self.epoch,
        )

    def _broadcast_status(self, now: float) -> None:
        status = self._status(now)
        self.events.refresh(status)
        self._send([Outgoing(g.identity, status) for g in self.core.gateways.values()])

    def _send(self, outgoing: list[Outgoing]) -> None:
        for d in self.core.take_dispatched():
            self.events.dispatched(
                d.request_id, d.queue_s, d.prefill_peer_id, d.decode_peer_id, d.speculative
            )
        now = time.monotonic()
        for item in outgoing:
            if type(item.message) is wire.SubmitReply:
                self._record_answer(item.message)
            if self.undelivered.holds(item.identity):
                self.undelivered.hold(item.identity, item.message, now)  # (behind, in order)
            elif not self._deliver(item.identity, item.message):
                self.undelivered.hold(item.identity, item.message, now)
        # Requests whose placement raised (a bug), failed to their gateways by the core in the
        # messages just sent; the handler that ran the pass went on. Last: `record` may end the
        # scheduler, which must not take those messages with it.
        for request_id, error in self.core.take_placement_failures():
            self.events.message_failed("dispatch", request_id, error)
            self.failures.record()

    def _deliver(self, identity: bytes, message: wire.Message) -> bool:
        """Sends without waiting; False when the peer has no connection now (the message is
        for the caller to hold). A peer whose queue is full (SNDHWM: it has not read for a
        long while) has the message dropped, as before, and the drop logged. The status is
        never held: taken as delivered either way."""
        try:
            self.socket.send_multipart([identity, *wire.encode(message)], zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self._dropped_full(identity, message)
        except zmq.ZMQError as error:
            if error.errno == errno.EHOSTUNREACH:
                self.unreachable_since.setdefault(identity, time.monotonic())
                return isinstance(message, wire.ClusterStatus)
            self.log.warning("send failed", error=str(error), peer=identity.hex())
        self.unreachable_since.pop(identity, None)  # (a full queue is a connection too)
        return True

    def _forget_gone_gateways(self, now: float) -> None:
        """Each tick (after the status went to every gateway): a gateway unreachable for a
        heartbeat timeout is gone, its requests called off (`ClusterScheduler.on_gateway_gone`:
        until 2026-12-07 a dead gateway's requests ran to `max_tokens` for nobody). What else
        was found unreachable (workers: their heartbeats tell) is not kept."""
        gateways = {gateway.identity: gateway for gateway in self.core.gateways.values()}
        for identity in [i for i in self.unreachable_since if i not in gateways]:
            del self.unreachable_since[identity]
        for identity, since in list(self.unreachable_since.items()):
            if now - since > self.config.heartbeat_timeout_s:
                del self.unreachable_since[identity]
                gateway = gateways[identity]
                outgoing = self.core.on_gateway_gone(gateway.peer_id, now)
                cancels = [o for o in outgoing if isinstance(o.message, wire.Cancel)]
                self.log.warning("gateway unreachable; its requests called off",
                                 peer_id=gateway.peer_id, silent_s=round(now - since, 1),
                                 num_cancels=len(cancels))  # fmt: skip
                self._send(outgoing)

    def _dropped_full(self, identity: bytes, message: wire.Message) -> None:
        if isinstance(message, wire.ClusterStatus):
            return  # (the next tick's replaces it)
        self.num_dropped_full += 1
        if self.num_dropped_full % DROPPED_LOG_EVERY == 1:
            self.log.warning("peer's queue full; messages dropped", peer=identity.hex(),
                             type=type(message).__name__,
                             num_dropped=self.num_dropped_full)  # fmt: skip

    def _flush(self, identity: bytes) -> None:
        """Sends what was held for the peer, in order, while it takes them."""
        while (message := self.undelivered.first(identity)) is not None:
            if not self._deliver(identity, message):
                return
            self.undelivered.pop(identity)

    def _retry_undelivered(self, now: float) -> None:
        """Each tick: what is held goes to the peers back since, and what waited too long for a
        peer still away is dropped."""
        for identity, num_dropped in self.undelivered.expire(now):
            self.log.warning("peer unreachable; messages for it dropped", peer=identity.hex(),
                             num_dropped=num_dropped)  # fmt: skip
        for identity in self.undelivered.peers():
            self._flush(identity)


DROPPED_LOG_EVERY = 100  # a peer's full queue logs its first dropped message, then every this many
# The most messages held for one unreachable peer: far above what a brief cut gathers (a
# worker's jobs and cancels, a gateway's deltas, for a few seconds); past it the oldest go.
MAX_HELD_PER_PEER = 10_000


class Undelivered:
    """Messages for peers the ROUTER has no connection to just now, in the order they were
    sent, each peer's kept at most `keep_s` (its first message's age) and `MAX_HELD_PER_PEER`
    of them."""

    def __init__(self, keep_s: float, max_per_peer: int = MAX_HELD_PER_PEER):
        self.keep_s = keep_s
        self.max_per_peer = max_per_peer
        self._held: dict[bytes, deque[tuple[float, wire.Message]]] = {}
        self.num_dropped = 0  # past the bound or the age, since the start

    def holds(self, identity: bytes) -> bool:
        return identity in self._held

    def hold(self, identity: bytes, message: wire.Message, now: float) -> None:
        held = self._held.setdefault(identity, deque())
        if len(held) >= self.max_per_peer:
            held.popleft()
            self.num_dropped += 1
        held.append((now, message))

    def first(self, identity: bytes) -> wire.Message | None:
        held = self._held.get(identity)
        return held[0][1] if held else None

    def pop(self, identity: bytes) -> None:
        held = self._held[identity]
        held.popleft()
        if not held:
            del self._held[identity]

    def peers(self) -> list[bytes]:
        return list(self._held)

    def expire(self, now: float) -> list[tuple[bytes, int]]:
        """Forgets the peers whose oldest held message waited past `keep_s`: each, with the
        number of its messages dropped."""
        gone = [i for i, held in self._held.items() if now - held[0][0] > self.keep_s]
        dropped = [(identity, len(self._held.pop(identity))) for identity in gone]
        self.num_dropped += sum(n for _, n in dropped)
        return dropped


def _answers(message: wire.Message, request_id: str) -> bool:
    return isinstance(message, wire.SubmitReply) and message.request_id == request_id
