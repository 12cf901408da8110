"""PNG plots of `tandem bench` results (matplotlib, no display needed).

Each function takes the JSON form of a run or result (what result.json holds), draws one figure,
writes it and returns its path.

Failed requests are drawn as the summaries count them: in no latency. A latency CDF runs over
all the requests its metric applies to, successes and failures, so a run with failures ends below
1 (at its success share) and says how many failed; a percentile that is missing, or that a failed
request would hold (see loadtest/metrics.py), is left out and marked "n/a", never drawn as 0.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.transforms import blended_transform_factory  # noqa: E402

from loadtest.metrics import Summary  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency"))


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _cdf(axis, values: list[float], label: str, num_failed: int = 0) -> None:
    """The fraction of requests done within each value; failed ones never are."""
    if not values:
        return
    ordered = sorted(values)
    total = len(ordered) + num_failed
    fractions = [(i + 1) / total for i in range(len(ordered))]
    failed = f", {num_failed} failed" if num_failed else ""
    axis.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)}{failed})")


def _latencies(records: list[dict[str, Any]], key: str) -> tuple[list[float], int]:
    """A latency's values (ms) over the successful records, and how many records it applies to
    failed: TTFT and TPOT apply to streamed requests only."""
    values, num_failed = [], 0
    for record in records:
        ok = record.get("error") is None and record.get("finish_time") is not None
        if ok and record.get(key) is not None:
            values.append(record[key] * 1e3)
        elif not ok and (key == "e2e" or record.get("stream", True)):
            num_failed += 1
    return values, num_failed


def _by_label(run: dict[str, Any], key: str) -> dict[str, tuple[list[float], int]]:
    labels = dict.fromkeys(record.get("label") or "all" for record in run["records"])
    return {
        label: _latencies([r for r in run["records"] if (r.get("label") or "all") == label], key)
        for label in labels
    }


def _known_ms(summary: dict[str, Any], key: str) -> float:
    """A percentile in ms, NaN (left out of the plot) where missing or a failure's."""
    value = summary.get(key)
    if value is None or Summary.from_dict(summary).unknown(key):
        return math.nan
    return value * 1e3


def _mark_left_out(axis, xs: list[float], values: list[float]) -> None:
    base = blended_transform_factory(axis.transData, axis.transAxes)
    for x, value in zip(xs, values, strict=True):
        if math.isnan(value):
            axis.text(x, 0.02, "n/a", transform=base, ha="center", fontsize=8, color="red")


def latency_cdfs(run: dict[str, Any], path: Path) -> Path:
    """TTFT, TPOT and end-to-end latency CDFs, one line per request class."""
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, (key, title) in zip(axes, LATENCIES, strict=True):
        for label, (values, num_failed) in _by_label(run, key).items():
            _cdf(axis, values, label, num_failed)
        axis.set_title(title)
        axis.set_xlabel("ms")
        axis.set_ylabel("fraction of requests")
        axis.grid(alpha=0.3)
        if axis.get_legend_handles_labels()[0]:
            axis.legend()
    return _save(figure, path)


def throughput(run: dict[str, Any], path: Path) -> Path:
    """Output tokens/s over the run (1 s bins)."""
    figure, axis = plt.subplots(figsize=(9, 4))
    timeline = run["throughput"]
    if timeline:
        times, rates = zip(*timeline, strict=True)
        axis.step(times, rates, where="post")
    axis.set_xlabel("seconds since the run started")
    axis.set_ylabel("output tokens/s")
    axis.set_title("throughput over time")
    axis.grid(alpha=0.3)
    return _save(figure, path)


def batch_occupancy(run: dict[str, Any], path: Path) -> Path:
    """Each decode step's batch size over time, per decode worker: requests join and leave the
    running batch between steps (iteration-level batching)."""
    figure, axis = plt.subplots(figsize=(9, 4))
    by_peer: dict[str, tuple[list[float], list[int]]] = {}
    for sample in run["batch"]:
        times, sizes = by_peer.setdefault(sample["peer"], ([], []))
        count = len(sample["sizes"])
        span = sample["t1"] - sample["t0"]
        times.extend(sample["t0"] + span * (i + 1) / count for i in range(count))
        sizes.extend(sample["sizes"])
    for peer, (times, sizes) in sorted(by_peer.items()):
        axis.step(times, sizes, where="post", label=peer, linewidth=0.8)
    axis.set_xlabel("seconds since the run started")
    axis.set_ylabel("sequences in the step")
    axis.set_title("decode batch occupancy")
    axis.grid(alpha=0.3)
    if by_peer:
        axis.legend()
    return _save(figure, path)


def sweep(result: dict[str, Any], path: Path) -> Path:
    """Throughput and TTFT/TPOT percentiles against the offered rate."""
    runs = [r for r in result["runs"] if r["rate"] is not None]
    rates = [r["rate"] for r in runs]
    figure, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    left.plot(rates, [r["summary"]["output_tokens_per_s"] for r in runs], marker="o")
    left.set_xlabel("offered requests/s")
    left.set_ylabel("output tokens/s")
    left.grid(alpha=0.3)
    left_out: dict[float, list[str]] = {}
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        values = [_known_ms(r["summary"], key) for r in runs]
        right.plot(rates, values, marker="o", label=key.replace("_", " "))
        for rate, value in zip(rates, values, strict=True):
            if math.isnan(value):
                left_out.setdefault(rate, []).append(key.replace("_", " "))
    base = blended_transform_factory(right.transData, right.transAxes)
    for rate, keys in left_out.items():
        text = "n/a:\n" + "\n".join(keys)
        right.text(rate, 0.02, text, transform=base, ha="center", fontsize=7, color="red")
    right.set_xlabel("offered requests/s (failed requests' share; n/a: none, or a failure's)")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend()
    right.grid(alpha=0.3)
    shares = [r["summary"]["num_errors"] / max(1, r["summary"]["num_requests"]) for r in runs]
    ticks = [f"{rate:g}" + (f"\n{share:.0%} failed" if share else "")
             for rate, share in zip(rates, shares, strict=True)]  # fmt: skip
    for axis in (left, right):
        axis.set_xticks(rates, ticks)
    right.set_xlim(left.get_xlim())
    return _save(figure, path)


def compare(columns: list[tuple[str, dict[str, Any]]], path: Path) -> Path:
    """Side by side: throughput, TTFT and TPOT percentiles as bars, and the TTFT CDFs."""
    names = [name for name, _ in columns]
    figure, axes = plt.subplots(1, 4, figsize=(18, 4))
    axes[0].bar(names, [run["summary"]["output_tokens_per_s"] for _, run in columns])
    axes[0].set_title("output tokens/s")
    for axis, metric in ((axes[1], "ttft"), (axes[2], "tpot")):
        width = 0.4
        for offset, q in ((-width / 2, "p50"), (width / 2, "p99")):
            xs = [i + offset for i in range(len(names))]
            values = [_known_ms(run["summary"], f"{metric}_{q}") for _, run in columns]
            drawn = [(x, v) for x, v in zip(xs, values, strict=True) if not math.isnan(v)]
            axis.bar([x for x, _ in drawn], [v for _, v in drawn], width, label=q)
            _mark_left_out(axis, xs, values)
        axis.set_xticks(range(len(names)), names)
        axis.set_title(f"{metric.upper()} ms (n/a: none, or a failure's)")
        axis.legend()
    for name, run in columns:
        values, num_failed = _latencies(run["records"], "ttft")
        _cdf(axes[3], values, name, num_failed)
    axes[3].set_title("TTFT CDF (ms), failed requests never arrive")
    if axes[3].get_legend_handles_labels()[0]:
        axes[3].legend()
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.tick_params(axis="x", labelrotation=20)
    return _save(figure, path)
