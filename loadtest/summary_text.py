"""A run's summary as text: the lines `tandem bench` and the race print, and the warnings about
the client itself (a client that fell behind its schedule measured itself, not the server)."""

from __future__ import annotations

from loadtest.metrics import LATENCY_METRICS, QUANTILES, Summary

LATE_WARNING_S = 0.010  # send lateness p99 above which the client fell behind its schedule


def format_ms(seconds: float | None) -> str:
    """Seconds as whole milliseconds; "-" for none."""
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def percentile_ms(summary: Summary, key: str) -> str:
    """Percentile `key` ("ttft_p99") in ms: "n/a" where it would be a failed request's, "-"
    where there is none."""
    return "n/a" if summary.unknown(key) else format_ms(getattr(summary, key))


def client_warnings(summary: Summary) -> list[str]:
    """What makes the run's figures misleading on the client's side: it fell behind."""
    p99 = summary.lateness_p99
    if p99 is None or p99 <= LATE_WARNING_S:
        return []
    late = f"p99 {format_ms(p99)} ms, max {format_ms(summary.lateness_max)} ms"
    return [
        f"WARNING: the client fell behind its schedule: send lateness {late} (over "
        f"{LATE_WARNING_S * 1e3:.0f} ms): the server saw less load than offered, and a client "
        "this busy also reads its streams late, which inflates the latencies; offer less load "
        "per client process"
    ]


def _latencies(summary: Summary, metric: str, name: str) -> str:
    n = getattr(summary, f"{metric}_n")
    cells = " ".join(f"p{q} {percentile_ms(summary, f'{metric}_p{q}')}" for q in QUANTILES)
    return f"{name} ms {cells}" + ("" if n is None else f" (n={n})")


def unknown_note(summary: Summary) -> str | None:
    """Which percentiles are "n/a" and why, with their figures over the successes; None if
    none is."""
    keys = [k for m in LATENCY_METRICS for q in QUANTILES if summary.unknown(k := f"{m}_p{q}")]
    if not keys:
        return None
    over_ok = ", ".join(f"{k} {format_ms(getattr(summary, k))}" for k in keys)
    return (
        f"n/a: {summary.num_errors} of {summary.num_requests} requests failed, and counting them "
        f"as slower than every success the percentile would be a failure's; over the successes "
        f"only (a lower bound), ms: {over_ok}"
    )


def _prompt_cache_line(summary: Summary) -> str:
    if summary.cache_hit_share is None:
        return "prompt cache: cached tokens not reported by the server"
    return (
        f"prompt cache: {summary.cache_hit_share:.1%} of prompt tokens from the server's cache "
        f"({summary.cached_prompt_tokens} tokens)"
    )


def format_summary(summary: Summary) -> str:
    s = summary
    lines = [
        f"requests {s.num_ok}/{s.num_requests} ok ({s.num_errors} errors, {s.error_share:.1%}); "
        f"{s.output_tokens} output tokens in {s.wall_s:.2f} s = {s.output_tokens_per_s:.1f} tok/s",
        _latencies(s, "ttft", "TTFT") + "   " + _latencies(s, "tpot", "TPOT"),
        _latencies(s, "e2e", "e2e") + "   " + _latencies(s, "itl", "ITL"),
    ]
    note = unknown_note(s)
    lines += [note] if note else []
    lines.append(_prompt_cache_line(s))
    if s.lateness_n:
        lines.append(
            f"send lateness ms p50 {format_ms(s.lateness_p50)} p99 {format_ms(s.lateness_p99)} "
            f"max {format_ms(s.lateness_max)} (n={s.lateness_n})"
        )
    lines += client_warnings(s)
    if s.goodput_rps is not None:
        lines.append(f"goodput {s.goodput_rps:.2f} req/s")
    return "\n".join(lines)
