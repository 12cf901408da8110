"""Per-request timings and the summary every benchmark here reports, computed in one place.

A request records its lifecycle as times in seconds since the run started: sent, first token,
each streamed chunk, finished. Every figure derives from those:
- TTFT = first token - sent;
- end-to-end latency (e2e) = finished - sent;
- TPOT = (e2e - TTFT) / (tokens - 1), the mean gap between output tokens after the first
  (undefined for a one-token output);
- inter-chunk latency: the gaps between streamed chunks (a chunk may carry several tokens);
- output tokens/s = successful output tokens / (last finish - first send), the whole run's rate.

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
    goodput_rps: float | None  # requests/s meeting both objectives, when objectives are given

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _present(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def meets_slo(record: RequestRecord, ttft_s: float, tpot_s: float) -> bool:
    # A one-token output has no TPOT; it meets the TPOT objective trivially.
    tpot = record.tpot
    return (
        record.ok
        and record.ttft is not None
        and record.ttft <= ttft_s
        and (tpot is None or tpot <= tpot_s)
    )


def summarize(
    records: Sequence[RequestRecord],
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
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
    if slo_ttft_s is not None and slo_tpot_s is not None and wall > 0:
        goodput = sum(meets_slo(r, slo_ttft_s, slo_tpot_s) for r in ok) / wall
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
    )


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
        f"TTFT ms p50 {_ms(s.ttft_p50)} p99 {_ms(s.ttft_p99)}   "
        f"TPOT ms p50 {_ms(s.tpot_p50)} p99 {_ms(s.tpot_p99)}   "
        f"e2e ms p50 {_ms(s.e2e_p50)} p99 {_ms(s.e2e_p99)}   "
        f"inter-chunk ms p50 {_ms(s.itl_p50)} p99 {_ms(s.itl_p99)}",
    ]
    if s.goodput_rps is not None:
        lines.append(f"goodput {s.goodput_rps:.2f} req/s")
    return "\n".join(lines)
