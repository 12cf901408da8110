"""The loop both worker roles run: read what arrived, step the engine, run timers, heartbeat.

A role subclass sets up its engine, link and sockets, then implements `_handle` (one decoded
message, with the sender's identity when it came through one of its ROUTER sockets), `_step` (one
engine step and what follows from it), `_on_timers` and `_close`. While the engine has work the
loop never blocks on its sockets; idle, it waits for a message or the next heartbeat.
"""

from __future__ import annotations

import abc
import dataclasses
import signal
import time

import torch
import zmq

from services.worker.cache_events import CacheEventStream
from services.worker.config import WorkerConfig
from services.worker.link import SchedulerLink
from services.worker.streams import GatewayStreams
from shared import wire
from shared.binding import check_address, check_tcp_port, describe
from shared.curve import Security
from shared.engine.engine import LLMEngine
from shared.engine.loader import dtype_name, load_model
from shared.engine.pace import smoothed
from shared.engine.prefix_cache import worker_cache_key
from shared.failures import FailureWindow
from shared.gc_policy import CollectionTimer
from shared.lifecycle import WorkerEvents
from shared.logs import get_logger
from shared.metrics import serve_metrics

LOOP_STALL_S = 60.0  # /health fails when the loop has not turned this long (one step is less)


class WorkerLoop(abc.ABC):
    role: str  # "prefill" or "decode"
    events_class: type[WorkerEvents] = WorkerEvents  # the role's lifecycle events
    # What the role takes from other workers' sockets; every other message only from the
    # scheduler's link (a peer's HelloAck or Reserve is not the scheduler's).
    peer_messages: tuple[type[wire.Message], ...] = ()
    binds_address = False  # the role listens on `config.address` (a decode worker's KV socket)

    def __init__(
        self,
        config: WorkerConfig,
        context: zmq.Context | None,
        address: str | None = None,
        **engine_overrides,
    ):
        self.config = config
        if config.threads:
            torch.set_num_threads(config.threads)
        self.peer_id = config.resolved_peer_id(self.role)
        # Registrations with the scheduler since the first: what a request came under tells
        # whether the scheduler that placed it is still the one this worker answers to.
        self._registration = 0
        self.log = get_logger(peer_id=self.peer_id)
        self.events = self.events_class(self.log)
        self._check_before_loading(engine_overrides)
        self.loaded = load_model(
            config.model,
            dtype=config.torch_dtype,
            device=config.torch_device,
            linear_backend=config.linear_backend,
            decode_attention=config.decode_attention,
        )
        self.events.model_loaded(
            self.loaded.name,
            dtype_name(self.loaded.model.dtype),
            config.dtype,
            config.device,
            config.quantization,
            "reference" if self.loaded.model.decode_kernel is None else "native",
        )
        self.engine = LLMEngine(
            self.loaded.model,
            config.engine_config(**engine_overrides),
            tokenizer=self.loaded.tokenizer,
        )
        grammar_error = self.engine.grammar.warm()  # before registering: no request waits
        if grammar_error is not None:
            self.log.warning("structured outputs unavailable", error=grammar_error)
        self.context = context or zmq.Context.instance()
        self.security = Security(config.curve_keys(), self.log)
        self.security.start(self.context)
        self.registered = False
        self._last_turn = time.monotonic()
        self.metrics_address = None
        if config.metrics_port is not None:
            self.metrics_address = serve_metrics(
                self.events.registry, config.metrics_host, config.metrics_port, self.health
            )
        self.link = SchedulerLink(
            self.context,
            config.scheduler_address,
            wire.Hello(
                schema_version=wire.SCHEMA_VERSION,
                role=self.role,
                peer_id=self.peer_id,
                model=config.model,
                address=address,
                num_kv_blocks=self.engine.block_manager.num_blocks,
                block_size=config.block_size,
                max_num_seqs=config.max_num_seqs,
                metrics_address=self.metrics_address,
                dtype=dtype_name(self.loaded.model.dtype),
                cache_key=self._cache_key(),
            ),
            self.security,
        )
        self.streams = GatewayStreams(self.context, self.security, config.peer_socket_idle_s)
        cache = self.engine.prefix_cache
        self.cache_events = (
            CacheEventStream(cache, host_tier=self.engine.host_tier) if cache is not None else None
        )
        self.poller = zmq.Poller()
        self.poller.register(self.link.socket, zmq.POLLIN)
        self._router_sockets: set[zmq.Socket] = set()
        self.failures = FailureWindow()  # of messages: see `_handle_guarded`
        self.steps_completed = 0
        self.step_s = 0.0  # recent step duration, moving average (the scheduler's routing reads it)
        self._recent_batch_sizes: list[int] = []  # since the last heartbeat
        self._stopping = False

    def _check_before_loading(self, engine_overrides: dict) -> None:
        """ConfigError now for what would stop the worker once its model is loaded (a minute
        and more for a big one): a KV budget that holds no block of the model's (read from its
        config file alone), a port or address to listen on that another program holds."""
        config = self.config
        if "num_blocks" not in engine_overrides:  # else LLMEngine sizes the pool by the budget
            config.check_kv_budget()
        if config.metrics_port is not None:  # (0, any free port: the host is still checked)
            what = describe("metrics_host", "metrics_port")
            check_tcp_port(config.metrics_host, config.metrics_port, what)
        if self.binds_address and config.address is not None:  # (bound after the model loads)
            check_address(config.address, "address")

    def _cache_key(self) -> str | None:
        if self.engine.prefix_cache is None:
            return None
        return worker_cache_key(self.engine.cache_key, self.config.share_prefix_cache)

    def add_socket(self, sock: zmq.Socket, router: bool = False) -> None:
        self.poller.register(sock, zmq.POLLIN)
        if router:
            self._router_sockets.add(sock)

    def stop(self, *_: object) -> None:
        self._stopping = True

    def serve_forever(self) -> None:
        signal.signal(signal.SIGTERM, self.stop)
        signal.signal(signal.SIGINT, self.stop)
        try:
            if not self.link.handshake(stopping=lambda: self._stopping):
                return  # stopped while the scheduler was not there yet
            self.registered = True
            self.log.info(
                f"{self.role} worker ready",
                blocks=self.engine.block_manager.num_blocks,
                metrics=self.metrics_address,
            )
            gc_timer = CollectionTimer(self.events.gc_paused)
            try:
                while not self._stopping:
                    self.run_once()
            finally:
                gc_timer.close()
        finally:
            self.close()

    def health(self) -> str | None:
        """What /health says: None when registered and turning, else why not."""
        if not self.registered:
            return "not registered with the scheduler yet"
        stalled = time.monotonic() - self._last_turn
        if stalled > LOOP_STALL_S:
            return f"the worker loop has not turned for {stalled:.0f} s"
        return None

    def run_once(self) -> None:
        now = self._last_turn = time.monotonic()
        busy = self.engine.has_unfinished
        timeout_ms = 0 if busy else min(self.link.seconds_to_heartbeat(now), 0.1) * 1000
        for sock, _ in self.poller.poll(timeout_ms):
            self._drain(sock)
        if self.engine.has_unfinished:
            started = time.monotonic()
            self._step()
            # A step that only waited on a grammar compile (nothing else could run) counts as
            # progress (the scheduler's liveness check reads it) but is neither busy time, nor
            # a batch, nor a sample of the pace routing reads.
            self.steps_completed += 1
            if not self.engine.last_step_idle:
                self._record_step(time.monotonic() - started)
        now = time.monotonic()
        self._on_timers(now)
        if self.link.heartbeat_due(now):
            heartbeat = self._heartbeat()
            self.events.refresh(heartbeat)
            self.events.refresh_host_tier(self.engine.prefix_cache, self.engine.host_tier)
            self.events.engine_failed_so_far(
                self.engine.num_sampler_failures, self.engine.num_model_failures
            )
            self.link.send_heartbeat(heartbeat, now)
            self._recent_batch_sizes = []
            self._close_idle()  # (as often as a heartbeat: the walk is over every peer socket)

    def _record_step(self, step_s: float) -> None:
        """A step's time and batch size, for the metrics and the heartbeat's pace."""
        self.events.step(
            step_s, self.engine.last_step_num_seqs, self.engine.last_step_context_tokens
        )
        self.step_s = smoothed(self.step_s, step_s)
        self._recent_batch_sizes.append(self.engine.last_step_num_seqs)
        del self._recent_batch_sizes[: -wire.MAX_RECENT_STEPS]

    def _drain(self, sock: zmq.Socket) -> None:
        is_router = sock in self._router_sockets
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes if is_router else None
            try:
                message = wire.decode(frames[1:] if is_router else frames)
            except wire.WireError as error:
                self.log.warning("dropped malformed message", error=str(error))
                answer = self._answer_undecodable(frames[1:], str(error)) if is_router else None
                if answer is not None:
                    wire.send_to(sock, identity, answer)
                continue
            from_link = sock is self.link.socket
            if from_link == isinstance(message, self.peer_messages):
                self.log.warning("dropped a message on the wrong socket",
                                 type=type(message).__name__,
                                 socket="scheduler" if from_link else "peer")  # fmt: skip
                continue
            if isinstance(message, wire.HelloAck):
                if self.link.on_hello_ack(message, self.log):
                    self._on_registered_again()
            else:
                self._handle_guarded(message, identity)

    def _handle_guarded(self, message: wire.Message, identity: bytes | None) -> None:
        """`_handle`, where an exception it did not mean (every refusal it means is answered,
        not raised: one raised is a bug) costs the request the message names, not the worker
        and every request it holds: the exception is logged with its traceback and counted,
        and the role drops what it holds of the request and ends it (`_abandon`). A message
        that ended the worker would end the next worker the request was resumed on too (one
        HTTP request once ended four prefill workers in turn). The engine's step is not
        guarded here (its sampler isolates a failing row itself, `LLMEngine._sample`): a step
        that raised leaves the whole batch in doubt, and the worker exits; so does one whose
        messages keep failing (`shared.failures`)."""
        try:
            self._handle(message, identity)
        except Exception as error:
            kind = type(message).__name__
            request_id = getattr(message, "request_id", None)
            self.events.message_failed(kind, request_id, error)
            self.failures.record()  # raises, and the worker exits, when failures persist
            if isinstance(request_id, str):
                reason = f"the {self.role} worker failed on this request's {kind} "
                reason += f"({type(error).__name__}; its log has the traceback)"
                self._abandon(message, identity, reason)

    def num_available_blocks(self) -> int:
        """Free blocks not claimed by preempted sequences waiting to resume."""
        free = self.engine.block_manager.num_free_blocks
        return max(0, free - self.engine.scheduler.blocks_to_resume())

    def _heartbeat(self) -> wire.Heartbeat:
        blocks = self.engine.block_manager
        heartbeat = wire.Heartbeat(
            peer_id=self.peer_id,
            num_waiting=len(self.engine.scheduler.waiting),
            num_running=len(self.engine.scheduler.running),
            num_free_blocks=self.num_available_blocks(),
            num_total_blocks=blocks.num_blocks,
            steps_completed=self.steps_completed,
            sent_at=time.time(),
            num_swapped=len(self.engine.scheduler.swapped),
            num_swap_preemptions=self.engine.scheduler.num_preemptions_by_mode["swap"],
            num_recompute_preemptions=self.engine.scheduler.num_preemptions_by_mode["recompute"],
            recent_batch_sizes=list(self._recent_batch_sizes),
            request_ids=self.held_request_ids()[: wire.MAX_HELD_IDS],
            prefill_tokens_per_s=self.engine.preemption.prefill_tokens_per_s,
            step_s=self.step_s,
        )
        return self._with_cache_events(heartbeat)

    def _with_cache_events(self, heartbeat: wire.Heartbeat) -> wire.Heartbeat:
        cache = self.engine.prefix_cache
        if self.cache_events is None or cache is None:
            return heartbeat
        batch = self.cache_events.next_batch()
        return dataclasses.replace(
            heartbeat,
            cache_events_seq=batch.seq,
            cache_full=batch.full,
            cache_stored=batch.stored,
            cache_evicted=batch.evicted,
            num_prefix_query_tokens=cache.num_query_tokens,
            num_prefix_hit_tokens=cache.num_hit_tokens,
        )

    def _close_idle(self) -> None:
        """Closes the sockets to peers no request has used for `peer_socket_idle_s`."""
        for address in self.streams.close_idle():
            self.log.info("closed an idle gateway stream", gateway=address)

    def close(self) -> None:
        self._close()
        self.streams.close()
        self.link.close(self.peer_id if self.registered else None)
        self.security.stop()
        self.log.info(f"{self.role} worker stopped")

    # -- the role's part ------------------------------------------------------------------------

    def _answer_undecodable(self, frames: list, error: str) -> wire.Message | None:
        """The answer to a message from a peer (through a ROUTER socket) that failed to decode,
        where the role can tell what it was about (having let go of what it held for it); None:
        none, the sender's timeout deals with it."""
        return None

    def _on_registered_again(self) -> None:
        """The scheduler forgot this worker (it restarted, or dropped the worker), and its
        cache set with it: the next heartbeat carries the whole set. A role also lets go of
        what it awaited from the old registration's requests, which will not come (a decode
        worker's reservations await KV from prefill workers, which may still come; their
        leases end the rest). `_registration` counts it before the role's part runs."""
        self._registration += 1
        if self.cache_events is not None:
            self.cache_events.resync()

    @abc.abstractmethod
    def _handle(self, message: wire.Message, identity: bytes | None) -> None:
        """One decoded message; `identity` is set when it came through a ROUTER socket."""

    @abc.abstractmethod
    def _abandon(self, message: wire.Message, identity: bytes | None, reason: str) -> None:
        """Drops what the worker holds of the request `message` names, whose handling raised,
        and answers for it with `reason` as the role's refusals do."""

    @abc.abstractmethod
    def held_request_ids(self) -> list[str]:
        """Every request this worker holds state for (its heartbeat lists them)."""

    @abc.abstractmethod
    def _step(self) -> None:
        """One engine step and its consequences (streams, transfers, reports)."""

    @abc.abstractmethod
    def _on_timers(self, now: float) -> None:
        """Leases and deadlines."""

    @abc.abstractmethod
    def _close(self) -> None:
        """The role's own sockets."""
