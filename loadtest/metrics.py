"""Per-request timings and the summary every benchmark here reports, computed in one place.

A request records its lifecycle as times in seconds since the run started: scheduled (when the
workload said to send it), sent (when its request headers started onto the wire, its connection
open and its body built), first token, each streamed chunk that carries output, finished. Every
figure derives from those:
- send lateness = sent - scheduled: the client's own delay (a late wake-up, building the body,
  opening the connection, other requests' work in the same event loop). It is not charged to
  TTFT, which measures the server; it is reported, and a client that fell behind its schedule
  (p99 over 10 ms) is warned about, since the server then saw less load than was offered;
- TTFT = first token - sent;
- end-to-end latency (e2e) = finished - sent;
- TPOT = (e2e - TTFT) / (tokens - 1), the mean gap between output tokens after the first
  (undefined for a one-token output);
- inter-token latency (ITL): the gaps between streamed chunks (a chunk may carry several
  tokens; tandem sends one token a chunk);
- output tokens/s = successful output tokens / wall, the whole run's rate; the wall runs from the
  first send to the last request's end, a failure's included (a request that timed out took the
  run that long: ending the wall at the last success made a server that lets its slowest
  requests time out look faster than one that serves them);
- goodput = requests/s that succeeded and met every objective given (TTFT, TPOT, e2e), each
  per request: its own TTFT within the TTFT target, and so on.

A non-streamed request has only sent and finished: it counts in e2e and throughput, not in TTFT,
TPOT or ITL.

Percentiles interpolate linearly between the closest ranks (numpy's default), so p50 of an even
count is the mean of the middle two; each comes with its number of samples (`ttft_n`, ...): p99 of
fewer than about 100 lies between the two largest. Failed requests count in `num_errors` (and
`error_share`) and in no latency, so a percentile over the successes alone flatters a server that
fails its slowest requests or sheds load. Counting each failed request as slower than every
success (a timeout is; a refused request never got served), the q-th percentile of all requests
is unknown when its rank falls on a failure, roughly when more than 100 - q % failed: such
percentiles are listed in `unknown_percentiles` and shown as "n/a" (the figure over the successes
is still in the summary, as a lower bound). TTFT, TPOT and ITL count the failed streamed requests,
e2e every failed request.

When the server reports `usage.prompt_tokens_details.cached_tokens`, each record keeps it and the
summary gives the share of prompt tokens the server took from its prefix cache.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import Any


class Clock:
    """Seconds since the run started: the time base of every record."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.origin


@dataclass
class RequestRecord:
    index: int  # position in the workload
    max_tokens: int
    num_prompt_tokens: int | None = None  # as the server reported it (usage), else as sent
    send_time: float | None = None  # its headers started onto the wire; None: never sent
    first_token_time: float | None = None
    finish_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # each streamed chunk with output
    completion_tokens: int | None = None  # as the server reported it (usage)
    error: str | None = None
    label: str = ""  # the request's class
    scheduled_time: float | None = None  # when the workload said to send it
    cached_tokens: int | None = None  # prompt tokens served from the server's cache (usage)
    stream: bool = True  # streamed (TTFT, TPOT, ITL) or one response (e2e only)
    failure_time: float | None = None  # when its failure was recorded; None: it did not fail

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_time is not None

    @property
    def lateness(self) -> float | None:
        """How long after its scheduled time the request went on the wire."""
        if self.send_time is None or self.scheduled_time is None:
            return None
        return self.send_time - self.scheduled_time

    @property
    def ttft(self) -> float | None:
        if self.send_time is None or self.first_token_time is None:
            return None
        return self.first_token_time - self.send_time

    @property
    def e2e(self) -> float | None:
        if self.send_time is None or self.finish_time is None:
            return None
        return self.finish_time - self.send_time

    @property
    def tpot(self) -> float | None:
        ttft, e2e, tokens = self.ttft, self.e2e, self.completion_tokens
        if ttft is None or e2e is None or tokens is None or tokens < 2:
            return None
        return (e2e - ttft) / (tokens - 1)

    @property
    def chunk_gaps(self) -> list[float]:
        return [b - a for a, b in itertools.pairwise(self.chunk_times)]

    def to_dict(self) -> dict[str, Any]:
        latencies = {"ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}
        return {**asdict(self), **latencies, "lateness": self.lateness}


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100), linear between closest ranks; None for no values."""
    if not values:
        return None
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in [0, 100], got {q}")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low, high = math.floor(rank), math.ceil(rank)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def beyond_successes(num_samples: int, num_failed: int, q: float) -> bool:
    """Whether the q-th percentile of successes and failures together, each failure counted as
    slower than every success, needs a failure's value (its rank, or the next one up for the
    interpolation, falls among the failures): the figure over the successes alone then
    understates it, by an amount the failures do not tell."""
    total = num_samples + num_failed
    return num_failed > 0 and math.ceil((total - 1) * q / 100) >= num_samples


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    output_tokens: int  # over successful requests
    wall_s: float  # first send to the last request's end, a failure's included
    output_tokens_per_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    tpot_p50: float | None
    tpot_p99: float | None
    e2e_p50: float | None
    e2e_p99: float | None
    itl_p50: float | None  # inter-chunk latency
    itl_p99: float | None
    goodput_rps: float | None  # requests/s meeting the objectives, when any is given
    requests_per_s: float = 0.0  # successful requests / wall
    ttft_p90: float | None = None
    tpot_p90: float | None = None
    e2e_p90: float | None = None
    itl_p90: float | None = None
    error_share: float = 0.0  # num_errors / num_requests
    # Samples behind each metric's percentiles (successful requests that have it; ITL: chunk
    # gaps). None in results written before they were counted.
    ttft_n: int | None = None
    tpot_n: int | None = None
    e2e_n: int | None = None
    itl_n: int | None = None
    # Percentiles ("ttft_p99", ...) that would be a failed request's (see the module's doc):
    # their figure here is over the successes only, a lower bound.
    unknown_percentiles: tuple[str, ...] = ()
    # Send lateness (sent - scheduled) over the requests sent: the client's own delay.
    lateness_p50: float | None = None
    lateness_p99: float | None = None
    lateness_max: float | None = None
    lateness_n: int = 0
    # Over the requests whose usage reported cached_tokens; None when none did.
    cached_prompt_tokens: int | None = None
    cache_hit_share: float | None = None  # cached / prompt tokens of those requests

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Summary:
        """From `to_dict`'s JSON, also one written before some fields existed."""
        known = {f.name for f in fields(cls)}
        values = {k: v for k, v in data.items() if k in known}
        values["unknown_percentiles"] = tuple(values.get("unknown_percentiles", ()))
        return cls(**values)

    def unknown(self, key: str) -> bool:
        """Whether percentile `key` ("ttft_p99") would be a failed request's. For a result
        written before the per-metric counts existed, every success counts as a sample."""
        if key in self.unknown_percentiles:
            return True
        metric, _, q = key.rpartition("_p")
        if metric not in LATENCY_METRICS:
            return False
        if getattr(self, f"{metric}_n") is None:
            return beyond_successes(self.num_ok, self.num_errors, float(q))
        return False


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def meets_slo(
    record: RequestRecord,
    ttft_s: float | None,
    tpot_s: float | None,
    e2e_s: float | None = None,
) -> bool:
    """Succeeded and met each objective given. A one-token output has no TPOT and meets the
    TPOT objective trivially; a request not streamed gets its first token with the response, so
    its end-to-end latency stands for its TTFT."""
    if not record.ok:
        return False
    ttft = record.ttft if record.ttft is not None else record.e2e
    tpot, e2e = record.tpot, record.e2e
    ttft_met = ttft_s is None or (ttft is not None and ttft <= ttft_s)
    tpot_met = tpot_s is None or tpot is None or tpot <= tpot_s
    e2e_met = e2e_s is None or (e2e is not None and e2e <= e2e_s)
    return ttft_met and tpot_met and e2e_met


QUANTILES = (50, 90, 99)
LATENCY_METRICS = ("ttft", "tpot", "e2e", "itl")


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2e_s: float | None = None,
    wall_s: float | None = None,
) -> Summary:
    """`wall_s`: the span the rates are over; the records' own (first send to last end) if
    None."""
    ok = [r for r in records if r.ok]
    wall = span_of(records) if wall_s is None else wall_s
    tokens = sum(r.completion_tokens or 0 for r in ok)
    samples = {
        "ttft": _present([r.ttft for r in ok]),
        "tpot": _present([r.tpot for r in ok]),
        "e2e": _present([r.e2e for r in ok]),
        "itl": [gap for r in ok for gap in r.chunk_gaps],
    }
    num_failed = len(records) - len(ok)
    num_failed_streams = sum(1 for r in records if not r.ok and r.stream)
    failed = {"ttft": num_failed_streams, "tpot": num_failed_streams, "itl": num_failed_streams,
              "e2e": num_failed}  # fmt: skip
    percentiles = {
        f"{metric}_p{q}": percentile(values, q)
        for metric, values in samples.items()
        for q in QUANTILES
    }
    unknown = tuple(
        f"{metric}_p{q}"
        for metric, values in samples.items()
        for q in QUANTILES
        if beyond_successes(len(values), failed[metric], q)
    )
    goodput = None
    objectives = (slo_ttft_s, slo_tpot_s, slo_e2e_s)
    if any(o is not None for o in objectives):  # (no wall: nothing succeeded, so none met them)
        goodput = sum(meets_slo(r, *objectives) for r in ok) / wall if wall > 0 else 0.0
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=num_failed,
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall > 0 else 0.0,
        goodput_rps=goodput,
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        **percentiles,
        error_share=num_failed / len(records) if records else 0.0,
        **{f"{metric}_n": len(values) for metric, values in samples.items()},
        unknown_percentiles=unknown,
        **_lateness(records),
        **_prompt_cache(records),
    )


def span_of(records: Sequence[RequestRecord]) -> float:
    """From the first send to the last end (an answer or a failure); 0 if none."""
    sends = _present([r.send_time for r in records])
    ends = _present([r.finish_time if r.ok else r.failure_time for r in records])
    return max(ends) - min(sends) if sends and ends else 0.0


def _lateness(records: Sequence[RequestRecord]) -> dict[str, Any]:
    late = _present([r.lateness for r in records])
    return {
        "lateness_p50": percentile(late, 50),
        "lateness_p99": percentile(late, 99),
        "lateness_max": max(late, default=None),
        "lateness_n": len(late),
    }


def _prompt_cache(records: Sequence[RequestRecord]) -> dict[str, Any]:
    reported = [
        r for r in records if r.cached_tokens is not None and r.num_prompt_tokens is not None
    ]
    if not reported:
        return {"cached_prompt_tokens": None, "cache_hit_share": None}
    cached = sum(r.cached_tokens or 0 for r in reported)
    prompt = sum(r.num_prompt_tokens or 0 for r in reported)
    return {"cached_prompt_tokens": cached, "cache_hit_share": cached / prompt if prompt else None}


def summarize_by_label(
    records: Sequence[RequestRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict[str, Summary]:
    """One summary per request class (its label), in order of first appearance. Each class's
    rates are over the whole run's span, so they add up to the run's: over the class's own,
    a rare class's one request of 0.5 s read 2 requests/s."""
    labels = list(dict.fromkeys(r.label for r in records))
    wall = span_of(records)
    return {
        label: summarize(
            [r for r in records if r.label == label], slo_ttft_s, slo_tpot_s, wall_s=wall
        )
        for label in labels
    }


def token_timeline(records: Sequence[RequestRecord], bin_s: float = 1.0) -> list[list[float]]:
    """[bin start, output tokens/s] over the run. A streamed request's tokens are spread evenly
    over its chunks; a non-streamed one's land when it finished."""
    if bin_s <= 0:
        raise ValueError(f"bin_s must be > 0, got {bin_s}")
    bins: dict[int, float] = {}
    for record in records:
        if not record.ok or not record.completion_tokens:
            continue
        times = record.chunk_times or [record.finish_time]
        per_time = record.completion_tokens / len(times)
        for t in times:
            index = math.floor(t / bin_s)
            bins[index] = bins.get(index, 0.0) + per_time
    if not bins:
        return []
    return [[i * bin_s, bins.get(i, 0.0) / bin_s] for i in range(min(bins), max(bins) + 1)]


@dataclass
class Result:
    """One benchmark run: its summary and the per-request records it came from."""

    name: str
    summary: Summary
    records: list[RequestRecord]
    extra: dict[str, Any] = field(default_factory=dict)  # settings and notes of the run

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "summary": self.summary.to_dict(),
            **self.extra,
            "records": [r.to_dict() for r in self.records],
        }
