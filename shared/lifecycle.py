"""A request's lifecycle events, where each writes its log line and moves its metrics.

    gateway    arrived -> (per choice) first token -> tokens ... -> finished | failed
    scheduler  queued | refused -> dispatched (queue time) -> phase done | cancelled
    prefill    prefill started -> prefill finished -> kv sent -> kv acknowledged
    decode     kv received -> ... -> decode finished; and per step: the batch size

Services report these and nothing else for per-request telemetry, so a log line and a metric
can never disagree about what happened, and every line carries `request_id`: one grep follows a
request through the cluster. Each service gets one `*Events` object with its own Prometheus
registry (what its /metrics serves). Load gauges that are sampled, not evented (queue depth, KV
usage, heartbeat ages), are set by `refresh` from the state the service already computes.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared import wire
from shared.metrics import (
    BATCH_SIZE_BUCKETS,
    GC_PAUSE_BUCKETS,
    ITL_BUCKETS,
    KV_BYTES_BUCKETS,
    REQUEST_LATENCY_BUCKETS,
    STEP_BUCKETS,
    TENANT_LABEL,
    TRANSFER_BUCKETS,
    TTFT_BUCKETS,
    batch_range,
    name,
)

if TYPE_CHECKING:  # the engine needs torch; the gateway and scheduler do not load it
    from shared.engine.host_tier import HostTier
    from shared.engine.prefix_cache import PrefixCache


class _Events:
    def __init__(self, log):
        self.log = log
        self.registry = CollectorRegistry()

    def counter(self, suffix: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
        return Counter(name(suffix), doc, labels, registry=self.registry)

    def gauge(self, suffix: str, doc: str, labels: tuple[str, ...] = ()) -> Gauge:
        return Gauge(name(suffix), doc, labels, registry=self.registry)

    def histogram(
        self, suffix: str, doc: str, buckets: tuple[float, ...], labels: tuple[str, ...] = ()
    ) -> Histogram:
        return Histogram(name(suffix), doc, labels, buckets=buckets, registry=self.registry)

    def time_collections(self, service: str, what_stands_still: str) -> None:
        """`<service>_gc_pause_seconds`: each cyclic collection by generation, fed by
        `gc_paused` (a `shared.gc_policy.CollectionTimer` the service runs)."""
        self.gc_pauses = self.histogram(
            f"{service}_gc_pause_seconds",
            f"The cyclic garbage collector's collections, by generation: {what_stands_still} "
            "stands still through each (shared/gc_policy.py)",
            GC_PAUSE_BUCKETS,
            ("generation",),
        )

    def gc_paused(self, generation: int, seconds: float) -> None:
        self.gc_pauses.labels(str(generation)).observe(seconds)

    def count_message_failures(self, what_goes_on: str) -> None:
        """`message_failures_total`: messages whose handling raised, fed by `message_failed`."""
        self.message_failures = self.counter(
            "message_failures",
            f"Messages whose handling raised an unexpected exception, by type (each logged with "
            f"its traceback): the request it names was abandoned, {what_goes_on} went on",
            ("type",),
        )

    def message_failed(self, kind: str, request_id: str | None, error: Exception) -> None:
        self.message_failures.labels(kind).inc()
        self.log.error(
            "message handling failed",
            type=kind,
            request_id=request_id,
            error=repr(error),
            exc_info=error,
        )


# -- gateway --------------------------------------------------------------------------------------


@dataclass
class ChoiceTrace:
    """One cluster request (one choice) as the gateway's client sees it."""

    request_id: str
    arrived_at: float  # monotonic, when the HTTP or RPC call arrived
    num_prompt_tokens: int
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    ended: bool = field(default=False)


class GatewayEvents(_Events):
    """What clients see: latencies from the call's arrival, tokens in and out, how calls end."""

    def __init__(self, log):
        super().__init__(log)
        self.in_flight = self.gauge(
            "gateway_requests_in_flight", "Cluster requests this gateway waits on"
        )
        self.time_collections("gateway", "the event loop (every stream, every call)")
        self.ttft = self.histogram(
            "time_to_first_token_seconds", "Arrival to first token, per choice", TTFT_BUCKETS
        )
        self.itl = self.histogram(
            "inter_token_latency_seconds", "Time between a choice's token deliveries", ITL_BUCKETS
        )
        self.e2e = self.histogram(
            "e2e_request_latency_seconds", "Arrival to last token", REQUEST_LATENCY_BUCKETS
        )
        self.prompt_tokens = self.counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = self.counter("generation_tokens", "Tokens streamed to clients")
        self.success = self.counter(
            "request_success", "Requests finished, by finish reason", ("finished_reason",)
        )
        self.errors = self.counter(
            "request_errors", "Requests refused or failed, by HTTP status", ("status",)
        )
        self.resumptions = self.counter(
            "requests_resumed", "Requests resumed on other workers after theirs was lost"
        )
        # Apart: the federated /metrics reads `registry` as it asks the peers, and this gauge
        # once they answered (`services.gateway.federation`).
        self.scrape_registry = CollectorRegistry()
        self.peer_scrape_up = Gauge(
            name("peer_scrape_up"),
            "Whether the last /metrics scrape of a peer answered",
            ("target",),
            registry=self.scrape_registry,
        )

    def arrived(self, request_id: str, num_prompt_tokens: int, tenant: str, n: int) -> None:
        self.log.info(
            "request arrived",
            request_id=request_id,
            prompt_tokens=num_prompt_tokens,
            tenant=tenant,
            n=n,
        )

    def submitted(self, request_id: str, arrived_at: float, num_prompt_tokens: int) -> ChoiceTrace:
        self.in_flight.inc()
        return ChoiceTrace(request_id, arrived_at, num_prompt_tokens)

    def tokens(self, trace: ChoiceTrace, num_tokens: int) -> None:
        if num_tokens == 0:
            return
        now = time.monotonic()
        if trace.first_token_at is None:
            trace.first_token_at = now
            ttft = now - trace.arrived_at
            self.ttft.observe(ttft)
            self.log.info("first token", request_id=trace.request_id, ttft_s=round(ttft, 4))
        else:
            self.itl.observe(now - trace.last_token_at)
        trace.last_token_at = now
        trace.num_output_tokens += num_tokens
        self.generation_tokens.inc(num_tokens)

    def finished(self, trace: ChoiceTrace, finish_reason: str) -> None:
        """The choice ended normally (stop, length) or its client left ("abort")."""
        if not self._end(trace):
            return
        latency = time.monotonic() - trace.arrived_at
        self.e2e.observe(latency)
        self.prompt_tokens.inc(trace.num_prompt_tokens)
        self.success.labels(finish_reason).inc()
        self.log.info(
            "request finished",
            request_id=trace.request_id,
            finish_reason=finish_reason,
            output_tokens=trace.num_output_tokens,
            latency_s=round(latency, 4),
        )

    def resumed(self, request_id: str, attempt_id: str, num_tokens: int, reason: str) -> None:
        self.resumptions.inc()
        self.log.warning(
            "request resumed",
            request_id=request_id,
            attempt=attempt_id,
            tokens_kept=num_tokens,
            reason=reason,
        )

    def failed(self, trace: ChoiceTrace | None, request_id: str, status: int, error: str) -> None:
        """Refused at the door (no trace yet) or failed in the cluster."""
        if trace is not None and not self._end(trace):
            return
        self.errors.labels(str(status)).inc()
        self.log.warning("request failed", request_id=request_id, status=status, error=error)

    def _end(self, trace: ChoiceTrace) -> bool:
        if trace.ended:
            return False
        trace.ended = True
        self.in_flight.dec()
        return True


# -- scheduler ------------------------------------------------------------------------------------


class SchedulerEvents(_Events):
    """Admission, queueing and dispatch; the cluster's load as the scheduler sees it."""

    def __init__(self, log):
        super().__init__(log)
        self.waiting = self.gauge("num_requests_waiting", "Requests in the scheduler's queue")
        self.in_flight = self.gauge(
            "scheduler_requests_in_flight", "Requests admitted and not finished"
        )
        self.queue_time = self.histogram(
            "request_queue_time_seconds", "Time in the scheduler's queue", REQUEST_LATENCY_BUCKETS
        )
        self.refusals = self.counter(
            "requests_refused", "Submissions refused at admission, by status", ("status",)
        )
        self.speculative = self.counter(
            "speculative_prefills",
            "Prefill jobs sent with their decode reservation, before its answer",
        )
        self.party_served = self.gauge(
            "party_served_tokens",
            "Tokens served per fair-share account (prompt plus generated; refunds lower it)",
            (TENANT_LABEL, "class"),
        )
        self.party_queued = self.gauge(
            "party_queued_requests",
            "Queued requests per fair-share account",
            (TENANT_LABEL, "class"),
        )
        self.heartbeat_age = self.gauge(
            "worker_heartbeat_age_seconds", "Since each worker's last heartbeat", ("worker", "role")
        )
        self.workers = self.gauge("workers", "Registered workers", ("role", "state"))
        self.cached_predicted = self.gauge(
            "prefix_index_predicted_cached_tokens",
            "Prompt tokens the prefix index predicted cached where prompts went (since start)",
        )
        self.cached_actual = self.gauge(
            "prefix_index_actual_cached_tokens",
            "Prompt tokens the workers then found cached (the gap is the index's drift)",
        )
        self.first_token_rate = self.gauge(
            "scheduler_first_tokens_per_second",
            "First tokens a second while the queue is backlogged (0: not known yet)",
        )
        self.prompt_token_rate = self.gauge(
            "scheduler_prompt_tokens_per_second",
            "The wait forecast's pace: prompt tokens brought to their first token a second while "
            "the queue is backlogged (0: not known yet)",
        )
        self.refused_past_deadline = self.gauge(
            "requests_refused_past_deadline",
            "Requests refused (429) because their forecast wait came too close to their "
            "first-token deadline (since the scheduler started)",
        )
        self.time_collections("scheduler", "the scheduler loop")
        self.count_message_failures("the scheduler")
        self._shown: dict[Gauge, set[tuple[str, ...]]] = {}

    def queued(self, request_id: str, num_prompt_tokens: int, tenant: str) -> None:
        self.log.info(
            "request queued", request_id=request_id, prompt_tokens=num_prompt_tokens, tenant=tenant
        )

    def refused(self, request_id: str, status: int, message: str) -> None:
        self.refusals.labels(str(status)).inc()
        self.log.warning("request refused", request_id=request_id, status=status, error=message)

    def dispatched(
        self, request_id: str, queue_s: float, prefill: str, decode: str, speculative: bool
    ) -> None:
        self.queue_time.observe(queue_s)
        self.speculative.inc(speculative)
        self.log.info(
            "request dispatched",
            request_id=request_id,
            queue_s=round(queue_s, 4),
            prefill=prefill,
            decode=decode,
            speculative=speculative,
        )

    def phase_done(self, request_id: str, phase: str, finish_reason: str | None) -> None:
        self.log.info(
            "request phase done", request_id=request_id, phase=phase, finish_reason=finish_reason
        )

    def cancelled(self, request_id: str, reason: str) -> None:
        self.log.info("request cancelled", request_id=request_id, reason=reason)

    def refresh(self, status: wire.ClusterStatus) -> None:
        """Sets the sampled gauges from the status the scheduler sends its gateways."""
        self.waiting.set(status.num_queued)
        self.in_flight.set(status.num_in_flight)
        self.cached_predicted.set(status.num_predicted_cached_tokens)
        self.cached_actual.set(status.num_actual_cached_tokens)
        self.first_token_rate.set(status.first_tokens_per_s)
        self.prompt_token_rate.set(status.prompt_tokens_per_s)
        self.refused_past_deadline.set(status.num_refused_past_deadline)
        self._set_all(
            self.party_served,
            {(p.tenant, p.class_name): p.served_tokens for p in status.service},
        )
        self._set_all(
            self.party_queued, {(p.tenant, p.class_name): p.num_queued for p in status.service}
        )
        self._set_all(
            self.heartbeat_age, {(w.peer_id, w.role): w.heartbeat_age_s for w in status.workers}
        )
        counts: dict[tuple[str, ...], float] = {
            (role, state): 0 for role in ("prefill", "decode") for state in ("healthy", "stuck")
        }
        for worker in status.workers:
            counts[(worker.role, "healthy" if worker.healthy else "stuck")] += 1
        self._set_all(self.workers, counts)

    def _set_all(self, gauge: Gauge, values: dict[tuple[str, ...], float]) -> None:
        """Sets each labelled child and removes those no longer present (a worker that left)."""
        for labels, value in values.items():
            gauge.labels(*labels).set(value)
        for labels in self._shown.get(gauge, set()) - values.keys():
            gauge.remove(*labels)
        self._shown[gauge] = set(values)


# -- workers --------------------------------------------------------------------------------------


class WorkerEvents(_Events):
    """What both worker roles report: engine load, KV usage, steps."""

    def __init__(self, log):
        super().__init__(log)
        self.running = self.gauge("num_requests_running", "Sequences in the running batch")
        self.waiting = self.gauge("num_requests_waiting", "Sequences queued in the engine")
        self.swapped = self.gauge("num_requests_swapped", "Preempted sequences in host memory")
        self.kv_usage = self.gauge("kv_cache_usage_perc", "Fraction of KV blocks in use (0..1)")
        self.steps = self.counter("engine_steps", "Engine steps completed")
        # Its rate is the worker's busy fraction (1.0: never idle between steps).
        self.busy = self.counter("engine_busy_seconds", "Wall time spent inside engine steps")
        self.step_seconds = self.histogram(
            "engine_step_seconds", "Wall time of each engine step", STEP_BUCKETS
        )
        self.time_collections("worker", "the worker loop (its steps, its socket)")
        self.count_message_failures("the worker and the rest of its batch")
        self.sampler_failures = self.counter(
            "sampler_failures",
            "Requests the sampler raised on (a bug, each logged with its traceback): the request "
            "ended with the error, the rest of its batch went on",
        )
        self.model_failures = self.counter(
            "model_failures",
            "Requests the model's forward raised on when run alone (each logged with its "
            "traceback): the request ended with the error, the rest of its batch went on",
        )
        self._failures_seen = {"sampler": 0, "model": 0}
        self.preemptions = self.counter(
            "num_preemptions", "Sequences preempted, by kind", ("kind",)
        )
        self._preemptions_seen = {"swap": 0, "recompute": 0}
        self.model_info = self.gauge(
            "model_info",
            "The model this worker serves, and how (1)",
            ("model", "dtype", "device", "quantization"),
        )
        # vLLM's prefix cache pair, in prompt tokens: hits / queries is the hit rate.
        self.prefix_queries = self.counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache"
        )
        self.prefix_hits = self.counter(
            "prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed)"
        )
        self._prefix_seen = [0, 0]
        self.host_hits = self.counter(
            "prefix_cache_host_hits",
            "Prompt tokens found in the prefix cache's host tier (copied back, not computed)",
        )
        self.host_bytes = self.gauge(
            "prefix_cache_host_bytes", "Bytes of evicted cached blocks held in host memory"
        )
        self.retained_blocks = self.gauge(
            "prefix_cache_retained_blocks",
            "Unreferenced cached blocks in their think-time retention (evicted last)",
        )
        self._host_hits_seen = 0
        self.host_blocks = self.counter(
            "prefix_cache_host_blocks",
            "Cached blocks through the host tier: copied in on eviction (demoted), copied back "
            "(promoted), or lost to it (dropped: no room, or the copy failed)",
            ("event",),
        )
        self._host_blocks_seen = {"demoted": 0, "promoted": 0, "dropped": 0}

    def refresh_host_tier(self, cache: PrefixCache | None, tier: HostTier | None) -> None:
        """The host tier's counters, read from the engine as the heartbeat goes out."""
        if cache is None:
            return
        self.host_hits.inc(cache.num_host_hit_tokens - self._host_hits_seen)
        self._host_hits_seen = cache.num_host_hit_tokens
        self.host_bytes.set(tier.num_bytes if tier is not None else 0)
        self.retained_blocks.set(cache.num_retained)
        if tier is not None:
            self._count_host_blocks(tier)

    def _count_host_blocks(self, tier: HostTier) -> None:
        counts = {
            "demoted": tier.num_demoted_blocks,
            "promoted": tier.num_promoted_blocks,
            "dropped": tier.num_dropped_blocks,
        }
        for event, count in counts.items():
            seen = self._host_blocks_seen[event]
            # (a count below the last seen is a tier made anew: all of it is new)
            self.host_blocks.labels(event).inc(count - seen if count >= seen else count)
            self._host_blocks_seen[event] = count

    def model_loaded(
        self,
        model: str,
        dtype: str,
        dtype_setting: str,
        device: str,
        quantization: str = "none",
        decode_attention: str = "reference",
    ) -> None:
        self.model_info.labels(model, dtype, device, quantization).set(1)
        self.log.info(
            "model loaded",
            model=model,
            dtype=dtype,
            dtype_setting=dtype_setting,
            device=device,
            quantization=quantization,
            decode_attention=decode_attention,
        )

    def engine_failed_so_far(self, num_sampler: int, num_model: int) -> None:
        """The engine's counts of requests ended by a failure since it started
        (`num_sampler_failures`, `num_model_failures`)."""
        for kind, counter, count in (
            ("sampler", self.sampler_failures, num_sampler),
            ("model", self.model_failures, num_model),
        ):
            counter.inc(count - self._failures_seen[kind])
            self._failures_seen[kind] = count

    def step(self, duration_s: float, num_sequences: int = 0, num_context_tokens: int = 0) -> None:
        """One engine step, the sequences it carried and the tokens they attended (0: not
        told)."""
        self.steps.inc()
        self.busy.inc(duration_s)
        self.step_seconds.observe(duration_s)

    def refresh(self, heartbeat: wire.Heartbeat) -> None:
        """Sets the load gauges from the heartbeat the worker is about to send."""
        self.running.set(heartbeat.num_running)
        self.waiting.set(heartbeat.num_waiting)
        self.swapped.set(heartbeat.num_swapped)
        total = heartbeat.num_total_blocks
        self.kv_usage.set((total - heartbeat.num_free_blocks) / total if total else 0.0)
        for kind, count in (
            ("swap", heartbeat.num_swap_preemptions),
            ("recompute", heartbeat.num_recompute_preemptions),
        ):
            self.preemptions.labels(kind).inc(count - self._preemptions_seen[kind])
            self._preemptions_seen[kind] = count
        queries, hits = heartbeat.num_prefix_query_tokens, heartbeat.num_prefix_hit_tokens
        self.prefix_queries.inc(queries - self._prefix_seen[0])
        self.prefix_hits.inc(hits - self._prefix_seen[1])
        self._prefix_seen = [queries, hits]


class PrefillEvents(WorkerEvents):
    def __init__(self, log):
        super().__init__(log)
        self.prefill_time = self.histogram(
            "request_prefill_time_seconds",
            "Prefill job received to first token sampled",
            REQUEST_LATENCY_BUCKETS,
        )
        self.prefill_tokens = self.counter("prefill_tokens", "Prompt tokens prefilled")
        self.kv_bytes = self.counter("kv_transfer_bytes", "KV bytes sent to decode workers")
        self.kv_bytes_per_handoff = self.histogram(
            "kv_transfer_bytes_per_handoff",
            "KV bytes of one handoff (only the blocks the decode worker lacks)",
            KV_BYTES_BUCKETS,
        )
        self.kv_seconds = self.histogram(
            "kv_transfer_seconds", "KV sent to acknowledged by the decode worker", TRANSFER_BUCKETS
        )
        self.kv_failures = self.counter(
            "kv_transfer_failures", "KV transfers refused or timed out", ("reason",)
        )

    def prefill_started(self, request_id: str, num_prompt_tokens: int) -> float:
        self.log.info("prefill started", request_id=request_id, prompt_tokens=num_prompt_tokens)
        return time.monotonic()

    def prefill_finished(self, request_id: str, started_at: float, num_tokens: int) -> None:
        seconds = time.monotonic() - started_at
        self.prefill_time.observe(seconds)
        self.prefill_tokens.inc(num_tokens)
        self.log.info(
            "prefill finished", request_id=request_id, tokens=num_tokens, seconds=round(seconds, 4)
        )

    def kv_sent(self, request_id: str, decode: str, num_bytes: int) -> float:
        self.kv_bytes.inc(num_bytes)
        self.kv_bytes_per_handoff.observe(num_bytes)
        self.log.info("kv sent", request_id=request_id, decode=decode, bytes=num_bytes)
        return time.monotonic()

    def kv_acknowledged(self, request_id: str, sent_at: float) -> None:
        seconds = time.monotonic() - sent_at
        self.kv_seconds.observe(seconds)
        self.log.info("kv acknowledged", request_id=request_id, seconds=round(seconds, 4))

    def kv_failed(self, request_id: str, reason: str, error: str | None) -> None:
        self.kv_failures.labels(reason).inc()
        self.log.warning("kv transfer failed", request_id=request_id, reason=reason, error=error)


class DecodeEvents(WorkerEvents):
    def __init__(self, log):
        super().__init__(log)
        self.batch_size = self.histogram(
            "decode_batch_size", "Sequences in each decode step", BATCH_SIZE_BUCKETS
        )
        self.generated_tokens = self.counter("decode_generated_tokens", "Tokens generated here")
        self.kv_bytes = self.counter("kv_received_bytes", "KV bytes received from prefill")
        self.local_prefills = self.counter(
            "local_prefills", "Requests prefilled here from a cached prefix: no KV handoff"
        )
        # Step time by batch size, so that a run can be profiled as it ran (`plan_validate`):
        # per range of batch sizes (labelled by the range's upper bound, BATCH_SIZE_BUCKETS),
        # the steps, their seconds and their sequences.
        self.steps_by_batch = self.counter(
            "decode_steps_by_batch", "Decode steps, by batch size range", ("batch",)
        )
        self.seconds_by_batch = self.counter(
            "decode_step_seconds_by_batch", "Time in decode steps, by batch size range", ("batch",)
        )
        self.sequences_by_batch = self.counter(
            "decode_step_sequences_by_batch",
            "Sequences over decode steps, by batch size range",
            ("batch",),
        )
        self.context_tokens_by_batch = self.counter(
            "decode_step_context_tokens_by_batch",
            "Tokens of context the sequences of decode steps attended, by batch size range",
            ("batch",),
        )

    def local_prefill(self, request_id: str, num_prompt_tokens: int) -> None:
        self.local_prefills.inc()
        self.log.info("local prefill", request_id=request_id, prompt_tokens=num_prompt_tokens)

    def step(self, duration_s: float, num_sequences: int = 0, num_context_tokens: int = 0) -> None:
        super().step(duration_s, num_sequences, num_context_tokens)
        if num_sequences > 0:
            label = batch_range(num_sequences)
            self.steps_by_batch.labels(label).inc()
            self.seconds_by_batch.labels(label).inc(duration_s)
            self.sequences_by_batch.labels(label).inc(num_sequences)
            self.context_tokens_by_batch.labels(label).inc(num_context_tokens)

    def decode_step(self, num_sequences: int, num_tokens: int) -> None:
        if num_sequences == 0:  # a step that only moved swapped KV
            return
        self.batch_size.observe(num_sequences)
        self.generated_tokens.inc(num_tokens)

    def kv_received(self, request_id: str, num_tokens: int, num_bytes: int) -> None:
        self.kv_bytes.inc(num_bytes)
        self.log.info("kv received", request_id=request_id, tokens=num_tokens, bytes=num_bytes)

    def decode_finished(self, request_id: str, finish_reason: str, num_output_tokens: int) -> None:
        self.log.info(
            "decode finished",
            request_id=request_id,
            finish_reason=finish_reason,
            output_tokens=num_output_tokens,
        )
