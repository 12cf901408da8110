"""PNG plots of `tandem bench` results (matplotlib, no display needed).

Each function takes the JSON form of a run or result (what result.json holds), draws one figure,
writes it and returns its path.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # files only: no display on servers and CI

import matplotlib.pyplot as plt  # noqa: E402

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("e2e", "end-to-end latency"))


def _save(figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _cdf(axis, values: list[float], label: str) -> None:
    if not values:
        return
    ordered = sorted(values)
    fractions = [(i + 1) / len(ordered) for i in range(len(ordered))]
    axis.step(ordered, fractions, where="post", label=f"{label} (n={len(ordered)})")


def _by_label(run: dict[str, Any], key: str) -> dict[str, list[float]]:
    values: dict[str, list[float]] = {}
    for record in run["records"]:
        value = record.get(key)
        if record.get("error") is None and value is not None:
            values.setdefault(record.get("label") or "all", []).append(value * 1e3)
    return values


def latency_cdfs(run: dict[str, Any], path: Path) -> Path:
    """TTFT, TPOT and end-to-end latency CDFs, one line per request class."""
    figure, axes = plt.subplots(1, 3, figsize=(15, 4))
    for axis, (key, title) in zip(axes, LATENCIES, strict=True):
        for label, values in _by_label(run, key).items():
            _cdf(axis, values, label)
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
    for key in ("ttft_p50", "ttft_p99", "tpot_p50", "tpot_p99"):
        values = [(r["summary"][key] or 0) * 1e3 for r in runs]
        right.plot(rates, values, marker="o", label=key.replace("_", " "))
    right.set_xlabel("offered requests/s")
    right.set_ylabel("ms")
    right.set_yscale("log")
    right.legend()
    right.grid(alpha=0.3)
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
            values = [(run["summary"][f"{metric}_{q}"] or 0) * 1e3 for _, run in columns]
            axis.bar([i + offset for i in range(len(names))], values, width, label=q)
        axis.set_xticks(range(len(names)), names)
        axis.set_title(f"{metric.upper()} ms")
        axis.legend()
    for name, run in columns:
        values = [r["ttft"] * 1e3 for r in run["records"] if r.get("ttft") is not None]
        _cdf(axes[3], values, name)
    axes[3].set_title("TTFT CDF (ms)")
    if axes[3].get_legend_handles_labels()[0]:
        axes[3].legend()
    for axis in axes:
        axis.grid(alpha=0.3)
        axis.tick_params(axis="x", labelrotation=20)
    return _save(figure, path)
