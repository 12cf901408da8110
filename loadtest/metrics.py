"""Per-request timings and the summary every benchmark here reports, computed in one place.

A request records its lifecycle as times in seconds since the run started: sent, first token,
each streamed chunk, finished. Every figure derives from those:
- TTFT = first token - sent;
- end-to-end latency (e2e) = finished - sent;
- TPOT = (e2e - TTFT) / (tokens - 1), the mean gap between output tokens after the first
  (undefined for a one-token output);
- inter-token latency (ITL): the gaps between streamed chunks (a chunk may carry several
  tokens; tandem sends one token a chunk);
- output tokens/s = successful output tokens / (last finish - first send), the whole run's rate;
- goodput = requests/s that succeeded and met every objective given (TTFT, TPOT, e2e), each
  per request: its own TTFT within the TTFT target, and so on.

A non-streamed request has only sent and finished: it counts in e2e and throughput, not in TTFT,
TPOT or ITL.

Percentiles interpolate linearly between the closest ranks (numpy's default), so p50 of an even
count is the mean of the middle two. Failed requests count in `num_errors` and in no latency.
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
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
    num_prompt_tokens: int | None = None
    send_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    chunk_times: list[float] = field(default_factory=list)  # arrival of each streamed chunk
    completion_tokens: int | None = None  # as the server reported it (usage)
    error: str | None = None
    label: str = ""  # the request's class

    @property
    def ok(self) -> bool:
        return self.error is None and self.finish_time is not None

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
        return {**asdict(self), "ttft": self.ttft, "tpot": self.tpot, "e2e": self.e2e}


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


@dataclass(frozen=True)
class Summary:
    num_requests: int
    num_ok: int
    num_errors: int
    output_tokens: int  # over successful requests
    wall_s: float  # first send to last finish
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    slo_e2e_s: float | None = None,
) -> Summary:
    ok = [r for r in records if r.ok]
    sends = _present([r.send_time for r in records])
    finishes = _present([r.finish_time for r in ok])
    wall = max(finishes) - min(sends) if sends and finishes else 0.0
    tokens = sum(r.completion_tokens or 0 for r in ok)
    ttfts = _present([r.ttft for r in ok])
    tpots = _present([r.tpot for r in ok])
    e2es = _present([r.e2e for r in ok])
    gaps = [gap for r in ok for gap in r.chunk_gaps]
    goodput = None
    objectives = (slo_ttft_s, slo_tpot_s, slo_e2e_s)
    if any(o is not None for o in objectives) and wall > 0:
        goodput = sum(meets_slo(r, *objectives) for r in ok) / wall
    return Summary(
        num_requests=len(records),
        num_ok=len(ok),
        num_errors=len(records) - len(ok),
        output_tokens=tokens,
        wall_s=wall,
        output_tokens_per_s=tokens / wall if wall > 0 else 0.0,
        ttft_p50=percentile(ttfts, 50),
        ttft_p99=percentile(ttfts, 99),
        tpot_p50=percentile(tpots, 50),
        tpot_p99=percentile(tpots, 99),
        e2e_p50=percentile(e2es, 50),
        e2e_p99=percentile(e2es, 99),
        itl_p50=percentile(gaps, 50),
        itl_p99=percentile(gaps, 99),
        goodput_rps=goodput,
        requests_per_s=len(ok) / wall if wall > 0 else 0.0,
        ttft_p90=percentile(ttfts, 90),
        tpot_p90=percentile(tpots, 90),
        e2e_p90=percentile(e2es, 90),
        itl_p90=percentile(gaps, 90),
    )


def summarize_by_label(
    records: Sequence[RequestRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
) -> dict[str, Summary]:
    """One summary per request class (its label), in order of first appearance."""
    labels = list(dict.fromkeys(r.label for r in records))
    return {
        label: summarize([r for r in records if r.label == label], slo_ttft_s, slo_tpot_s)
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


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def format_summary(summary: Summary) -> str:
    s = summary
    lines = [
        f"requests {s.num_ok}/{s.num_requests} ok ({s.num_errors} errors); "
        f"{s.output_tokens} output tokens in {s.wall_s:.2f} s = {s.output_tokens_per_s:.1f} tok/s",
        f"TTFT ms p50 {_ms(s.ttft_p50)} p90 {_ms(s.ttft_p90)} p99 {_ms(s.ttft_p99)}   "
        f"TPOT ms p50 {_ms(s.tpot_p50)} p90 {_ms(s.tpot_p90)} p99 {_ms(s.tpot_p99)}",
        f"e2e ms p50 {_ms(s.e2e_p50)} p90 {_ms(s.e2e_p90)} p99 {_ms(s.e2e_p99)}   "
        f"ITL ms p50 {_ms(s.itl_p50)} p90 {_ms(s.itl_p90)} p99 {_ms(s.itl_p99)}",
    ]
    if s.goodput_rps is not None:
        lines.append(f"goodput {s.goodput_rps:.2f} req/s")
    return "\n".join(lines)
