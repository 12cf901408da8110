"""Each worker's engine counters, read from the gateway's /metrics (which federates every peer's
metrics under a `peer` label): its role, steps, time inside steps, its steps by duration, and for
decode workers the sequences its steps carried. Benchmarks take them before and after a run."""

from __future__ import annotations

from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from shared.metrics import STEP_BUCKETS

STEPS = "tandem:engine_steps_total"
BUSY_SECONDS = "tandem:engine_busy_seconds_total"
BATCH_SEQUENCES = "tandem:decode_batch_size_sum"  # sequences over all decode steps
BATCH_STEPS = "tandem:decode_batch_size_count"  # decode steps that carried sequences
STEP_SECONDS = "tandem:engine_step_seconds_bucket"  # steps at most `le` seconds long
# Decode steps by batch size range (labelled `batch`): steps, seconds, sequences, and the
# tokens of context those sequences attended.
BY_BATCH = {
    "tandem:decode_steps_by_batch_total": 0,
    "tandem:decode_step_seconds_by_batch_total": 1,
    "tandem:decode_step_sequences_by_batch_total": 2,
    "tandem:decode_step_context_tokens_by_batch_total": 3,
}
BatchRange = tuple[float, float, float, float]  # steps, seconds, sequences, context tokens
# A peer's role, told by a counter only that role exports.
ROLE_MARKERS = {
    "prefill": "tandem:prefill_tokens_total",
    "decode": "tandem:decode_generated_tokens_total",
}


@dataclass(frozen=True)
class WorkerCounters:
    role: str  # "prefill", "decode", or "unknown"
    steps: float = 0.0
    busy_s: float = 0.0
    batch_sequences: float = 0.0  # decode: sequences summed over its steps
    batch_steps: float = 0.0
    # Steps by duration, cumulated as Prometheus buckets are: [i] took at most STEP_BUCKETS[i]
    # seconds, the last entry counts them all.
    step_buckets: tuple[float, ...] = field(default=(0.0,) * (len(STEP_BUCKETS) + 1))
    # Decode: per batch size range, (steps, seconds, sequences, context tokens).
    by_batch: dict[str, BatchRange] = field(default_factory=dict)


def worker_counters(metrics_text: str) -> dict[str, WorkerCounters]:
    """The counters of every peer that reports engine steps, by peer."""
    values: dict[str, dict[str, float]] = {}
    buckets: dict[str, dict[float, float]] = {}
    roles: dict[str, str] = {}
    by_batch: dict[str, dict[str, list[float]]] = {}
    fields = {STEPS: "steps", BUSY_SECONDS: "busy_s", BATCH_SEQUENCES: "batch_sequences",
              BATCH_STEPS: "batch_steps"}  # fmt: skip
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            peer = sample.labels.get("peer", "")
            if sample.name in fields:
                values.setdefault(peer, {})[fields[sample.name]] = sample.value
            elif sample.name == STEP_SECONDS:
                buckets.setdefault(peer, {})[float(sample.labels["le"])] = sample.value
            elif sample.name in BY_BATCH:
                ranges = by_batch.setdefault(peer, {})
                counts = ranges.setdefault(sample.labels["batch"], [0.0] * len(BY_BATCH))
                counts[BY_BATCH[sample.name]] = sample.value
            for role, marker in ROLE_MARKERS.items():
                if sample.name == marker:
                    roles[peer] = role
    bounds = (*STEP_BUCKETS, float("inf"))
    return {
        peer: WorkerCounters(
            roles.get(peer, "unknown"),
            **found,
            step_buckets=tuple(buckets.get(peer, {}).get(b, 0.0) for b in bounds),
            by_batch={label: tuple(t) for label, t in by_batch.get(peer, {}).items()},
        )
        for peer, found in values.items()
        if "busy_s" in found
    }
