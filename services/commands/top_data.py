"""`tandem top`'s data: snapshots of the gateway's /ready and /metrics, and the figures that
need more than one of them.

Two figures need more than one snapshot. Tokens per second is the increase of the token counters
between the last two refreshes over the time between them, counted per labelled series so that a
restarted peer (its counter back to zero) cannot make the rate negative. The running batch of a
decode worker is a history built across refreshes: a heartbeat carries the batch size of each step
since the previous heartbeat together with the worker's step count, so the steps new since the last
refresh are the last (count difference) of those sizes. When two heartbeats came between two
refreshes, the earlier one's steps are no longer in /ready and are missed, so the history is a
sample; at an interval under the heartbeat period (0.5 s) it is complete.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

GENERATED = "tandem:generation_tokens_total"  # tokens the gateway streamed to clients
PREFILLED = "tandem:prefill_tokens_total"  # prompt tokens the prefill workers ran
RATE_METRICS = (GENERATED, PREFILLED)
HISTORY_STEPS = 40  # decode steps kept, drawn and averaged per worker (fits 80 columns)


# ---- fetching ----------------------------------------------------------------------------------

Counters = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, labels) -> value


@dataclass
class Snapshot:
    """One refresh's data; `error` set (and the rest empty) when the gateway could not be read."""

    at: float  # time.monotonic() when fetched
    ready: dict[str, Any] = field(default_factory=dict)
    counters: Counters | None = None  # None when /metrics failed: rates unknown, the rest drawn
    error: str | None = None
    jobs: list[dict[str, Any]] | None = None  # the key's batch jobs, newest first; None: unknown
    jobs_note: str | None = None  # why `jobs` is None (no batch service, a key needed, ...)


def parse_counters(text: str, names: Iterable[str] = RATE_METRICS) -> Counters:
    wanted = set(names)
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in wanted
    }


JOBS_SHOWN = 8  # the newest batch jobs listed


def fetch(client: httpx.Client, url: str, api_key: str | None = None) -> Snapshot:
    at = time.monotonic()
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:  # (with the key: /ready shows only the tenants a key may see)
        response = client.get(url + "/ready", headers=headers)
        if response.status_code not in (200, 503):  # 503: not ready, same body
            return Snapshot(
                at, error=f"/ready answered {response.status_code}; not a tandem gateway?"
            )
        ready = response.json()
        if not isinstance(ready, dict):
            return Snapshot(at, error="/ready answered JSON that is not an object")
        problem = ready_shape_problem(ready)
        if problem is not None:
            return Snapshot(at, error=f"/ready answered {problem}; not a tandem gateway?")
    except (httpx.HTTPError, ValueError) as error:
        return Snapshot(at, error=_describe(error))
    try:
        metrics = client.get(url + "/metrics")
        metrics.raise_for_status()
        counters = parse_counters(metrics.text)
    except (httpx.HTTPError, ValueError):
        counters = None
    jobs, note = fetch_jobs(client, url, api_key)
    return Snapshot(at, ready=ready, counters=counters, jobs=jobs, jobs_note=note)


# The fields of /ready's workers and parties that the view computes with, not only prints.
WORKER_NUMBERS = ("heartbeat_age_s", "steps_completed", "prefix_query_tokens", "prefix_hit_tokens")


def ready_shape_problem(ready: Mapping[str, Any]) -> str | None:
    """What in a /ready object the view could not draw (another server's /ready: each raised
    from the drawing, a traceback in place of the view), or None. Absent fields are drawn as
    dashes; only a field of another type is a problem."""
    workers = ready.get("workers") or []
    scheduler = ready.get("scheduler") or {}
    if not _objects(workers):
        return "`workers` that is not a list of objects"
    if not isinstance(scheduler, dict) or not _objects(scheduler.get("service") or []):
        return "a `scheduler` without a list of objects in `service`"
    if not isinstance(ready.get("preemptions") or {}, dict):
        return "`preemptions` that is not an object"
    for worker in workers:
        if not isinstance(worker.get("peer_id"), str | None):
            return "a worker whose `peer_id` is not a string"
        for name in WORKER_NUMBERS:
            if not _number_or_none(worker.get(name)):
                return f"a worker whose `{name}` is not a number"
        sizes = worker.get("recent_batch_sizes")
        if sizes is not None and not (isinstance(sizes, list) and all(map(_number, sizes))):
            return "a worker whose `recent_batch_sizes` is not a list of numbers"
    if not all(
        _number_or_none(party.get("virtual_tokens")) for party in scheduler.get("service") or []
    ):
        return "a party whose `virtual_tokens` is not a number"
    return None


def _objects(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(item, dict) for item in value)


def _number(value: Any) -> bool:
    return isinstance(value, int | float)


def _number_or_none(value: Any) -> bool:
    return value is None or _number(value)


def fetch_jobs(
    client: httpx.Client, url: str, api_key: str | None
) -> tuple[list[dict[str, Any]] | None, str | None]:
    """(the newest batch jobs of the key's tenant, None) or (None, why not)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = client.get(url + "/v1/batches", params={"limit": JOBS_SHOWN}, headers=headers)
    except httpx.HTTPError as error:
        return None, _describe(error)
    if response.status_code == 401:
        return None, "the gateway wants an API key: --api-key or OPENAI_API_KEY"
    if response.status_code != 200:
        return None, f"/v1/batches answered {response.status_code} (no batch service?)"
    try:
        data = response.json()["data"]
    except (ValueError, KeyError, TypeError):
        return None, "/v1/batches answered a body without `data`"
    if not isinstance(data, list):  # (another server's: null raised, a string was its letters)
        return None, "/v1/batches answered a body without a list in `data`"
    return [job for job in data if isinstance(job, dict)], None


def _describe(error: Exception) -> str:
    detail = str(error)
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


# ---- figures across refreshes ------------------------------------------------------------------


def increase(before: Counters, after: Counters, name: str) -> float | None:
    """The increase of one counter summed over its series; a series that went down restarted.
    None when no series of it is in both: not read twice, the increase is unknown (no peer
    exporting it answered, say), which is not zero."""
    common = [key for key in after if key[0] == name and key in before]
    if not common:
        return None
    return sum(
        after[key] - before[key] if after[key] >= before[key] else after[key] for key in common
    )


def token_rates(before: Snapshot | None, after: Snapshot) -> dict[str, float | None]:
    """Tokens per second, generated and prefilled; None without two readable snapshots, or for a
    counter neither of them holds."""
    seconds = after.at - before.at if before is not None else 0.0
    if before is None or before.counters is None or after.counters is None or seconds <= 0:
        return {name: None for name in RATE_METRICS}
    rates: dict[str, float | None] = {}
    for name in RATE_METRICS:
        tokens = increase(before.counters, after.counters, name)
        rates[name] = None if tokens is None else tokens / seconds
    return rates


class BatchHistory:
    """Each decode worker's running batch size per step, over its recent steps."""

    def __init__(self, max_steps: int = HISTORY_STEPS) -> None:
        self.sizes: dict[str, deque[int]] = {}
        self._steps: dict[str, int] = {}
        self._max_steps = max_steps

    def observe(self, workers: Iterable[Mapping[str, Any]]) -> None:
        for worker in workers:
            if worker.get("role") == "decode" and "peer_id" in worker:
                self._observe_one(worker)

    def _observe_one(self, worker: Mapping[str, Any]) -> None:
        peer = worker["peer_id"]
        steps = int(worker.get("steps_completed") or 0)
        recent = list(worker.get("recent_batch_sizes") or [])
        history = self.sizes.setdefault(peer, deque(maxlen=self._max_steps))
        last = self._steps.get(peer)
        if last is None or steps < last:  # first seen, or restarted: its last heartbeat's steps
            history.clear()
            new = recent
        else:
            new = recent[len(recent) - min(steps - last, len(recent)) :]
        history.extend(new)
        self._steps[peer] = steps
