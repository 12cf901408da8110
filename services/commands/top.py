"""`tandem top`: a live terminal view of a running cluster, from its gateway's HTTP port.

Each refresh fetches the gateway's `/ready` (the scheduler's view: every worker's load, KV blocks
and heartbeat age, the fair-share parties and their queues), `/metrics` (every peer's counters,
federated) and `/v1/batches` (the API key's newest batch jobs) into a `Snapshot`, and draws one
frame from it. A `/ready` that answers 503 is drawn as
well: a cluster that is not ready is what one most wants to look at. The data side (fetching,
rates, batch history) is `services.commands.top_data`.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import httpx
from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.panel import Panel
from rich.progress_bar import ProgressBar
from rich.table import Table
from rich.text import Text

from services.commands.arguments import positive
from services.commands.top_data import (  # noqa: F401 - re-exported for tests and callers
    GENERATED,
    HISTORY_STEPS,
    PREFILLED,
    RATE_METRICS,
    BatchHistory,
    Counters,
    Snapshot,
    fetch,
    increase,
    parse_counters,
    token_rates,
)

BARS = "▁▂▃▄▅▆▇█"
MISSING = "–"


def gateway_url(text: str) -> str:
    """An argparse type: an http:// or https:// URL that httpx can request (an IPv6 host
    unbracketed, `http://::1:8000`, raised its InvalidURL, a traceback, at the first fetch)."""
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL:
        raise argparse.ArgumentTypeError(f"not a URL: {text!r}{_ipv6_hint(text)}") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise argparse.ArgumentTypeError(f"expected an http:// or https:// URL, got {text!r}")
    return text


def _ipv6_hint(text: str) -> str:
    authority = text.partition("://")[2].partition("/")[0]
    if "[" in authority or authority.count(":") < 2:
        return ""
    return " (an IPv6 host goes in brackets: http://[::1]:8000)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--url", type=gateway_url, default="http://127.0.0.1:8000", help="the gateway's HTTP URL"
    )
    parser.add_argument("--interval", type=positive(float), default=1.0, help="seconds per frame")
    parser.add_argument(
        "--once", action="store_true", help="print one frame and exit (1 if unreachable)"
    )
    parser.add_argument("--iterations", type=positive(int), default=None, help="frames, then exit")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("OPENAI_API_KEY"),
        help="whose batch jobs to show (default: $OPENAI_API_KEY)",
    )


# ---- rendering (pure: data in, renderables out) ------------------------------------------------


def sparkline(values: Sequence[int], width: int = HISTORY_STEPS) -> str:
    """The last `width` values as block characters, scaled so that the largest is a full block."""
    shown = list(values)[-width:]
    peak = max(shown, default=0)
    if peak <= 0:
        return BARS[0] * len(shown)
    return "".join(BARS[round(max(v, 0) / peak * (len(BARS) - 1))] for v in shown)


def kv_usage(worker: Mapping[str, Any]) -> tuple[str, str]:
    """('used/total', 'percent') of a worker's KV blocks; dashes when it reported none."""
    free, total = worker.get("free_blocks"), worker.get("total_blocks")
    if not isinstance(free, int) or not isinstance(total, int) or total <= 0:
        return MISSING, MISSING
    used = total - free
    return f"{used}/{total}", f"{100 * used / total:.1f}%"


def prefix_hit_rate(workers: Sequence[Mapping[str, Any]]) -> str:
    """The cluster's prefix cache hit rate in prompt tokens, hits / queries over every worker
    (since their start); a dash before any lookup."""
    queries = sum(w.get("prefix_query_tokens") or 0 for w in workers)
    hits = sum(w.get("prefix_hit_tokens") or 0 for w in workers)
    if queries <= 0:
        return MISSING
    return f"{100 * hits / queries:.1f}% ({hits:,}/{queries:,} tokens)"


def _value(value: Any) -> str:
    return MISSING if value is None else str(value)


def _health(healthy: Any) -> Text:
    if healthy is None:
        return Text(MISSING)
    return Text("ok", "green") if healthy else Text("stale", "bold red")


def _rate(value: float | None) -> str:
    return MISSING if value is None else f"{value:,.1f}"


def render_header(url: str, ready: Mapping[str, Any], rates: Mapping[str, float | None]) -> Panel:
    state = Text("ready", "bold green") if ready.get("ready") else Text("NOT READY", "bold red")
    policy = (ready.get("scheduler") or {}).get("policy", MISSING)
    preemptions = ready.get("preemptions") or {}
    lines = (
        Text.assemble(("cluster ", "bold"), state, f"   policy {policy}   {url}"),
        Text(
            f"queued {_value(ready.get('queued'))}   in flight {_value(ready.get('in_flight'))}   "
            f"preemptions {_value(preemptions.get('swap'))} swap, "
            f"{_value(preemptions.get('recompute'))} recompute"
        ),
        Text(
            f"tokens/s generated {_rate(rates.get(GENERATED))}   "
            f"prefilled {_rate(rates.get(PREFILLED))}"
        ),
        Text(f"prefix cache hit rate {prefix_hit_rate(ready.get('workers') or [])}"),
    )
    return Panel(Group(*lines), title="tandem top", title_align="left")


def _table(title: str, left: Sequence[str], right: Sequence[str]) -> Table:
    """A compact table: `left` columns of names, never cut, then `right` columns of figures."""
    table = Table(
        title=title,
        title_justify="left",
        title_style="bold",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    for name in left:
        table.add_column(name, no_wrap=True)
    for name in right:  # on a narrow terminal their headers wrap first
        table.add_column(name, justify="right")
    return table


def render_workers(workers: Sequence[Mapping[str, Any]]) -> Table:
    table = _table(
        "workers",
        ("peer", "role", "health"),
        ("run", "wait", "swap", "KV blocks", "KV %", "heartbeat"),
    )
    for worker in sorted(workers, key=lambda w: (str(w.get("role")), str(w.get("peer_id")))):
        age = worker.get("heartbeat_age_s")
        table.add_row(
            Text(_value(worker.get("peer_id"))),
            Text(_value(worker.get("role"))),
            _health(worker.get("healthy")),
            _value(worker.get("running")),
            _value(worker.get("waiting")),
            _value(worker.get("swapped")),
            *kv_usage(worker),
            MISSING if age is None else f"{age:.1f} s",
        )
    if not workers:
        table.caption = "no workers registered"
    return table


def render_fair_share(service: Sequence[Mapping[str, Any]]) -> Table:
    table = _table(
        "queue per tenant and class (fair share)",
        ("tenant", "class"),
        ("queued", "served tokens", "virtual tokens"),
    )
    for party in sorted(service, key=lambda p: (str(p.get("tenant")), str(p.get("class")))):
        virtual = party.get("virtual_tokens")
        table.add_row(
            Text(_value(party.get("tenant"))),
            Text(_value(party.get("class"))),
            _value(party.get("queued")),
            _value(party.get("served_tokens")),
            MISSING if virtual is None else f"{virtual:,.0f}",
        )
    if not service:
        table.caption = "no requests yet"
    return table


def render_batches(
    workers: Sequence[Mapping[str, Any]], history: Mapping[str, Sequence[int]]
) -> Table:
    table = _table(
        "running batch per decode step",
        ("decode",),
        ("running", "last", "mean", "max"),
    )
    table.add_column(f"last {HISTORY_STEPS} steps", no_wrap=True)
    decode = sorted(
        (w for w in workers if w.get("role") == "decode"), key=lambda w: str(w.get("peer_id"))
    )
    for worker in decode:
        sizes = list(history.get(worker.get("peer_id"), ()))
        spark = Text(sparkline(sizes), "cyan") if sizes else Text("no steps yet", "dim")
        table.add_row(
            Text(_value(worker.get("peer_id"))),
            _value(worker.get("running")),
            str(sizes[-1]) if sizes else MISSING,
            f"{sum(sizes) / len(sizes):.1f}" if sizes else MISSING,
            str(max(sizes)) if sizes else MISSING,
            spark,
        )
    if not decode:
        table.caption = "no decode workers"
    return table


ACTIVE_JOBS = ("validating", "in_progress", "finalizing", "cancelling")
BAR_WIDTH = 20  # a job's progress bar at its widest


def render_jobs(jobs: Sequence[Mapping[str, Any]] | None, note: str | None, now: float) -> Table:
    """The key's newest jobs. Every column but the bar is kept whole (`no_wrap`): on a narrow
    terminal the bar shrinks, then goes, before a figure is cut (at 80 columns the figures
    read "…" beside a full bar)."""
    table = _table("batch jobs", ("id", "status"), ())
    for name in ("done", "failed", "total", "age", "%"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("progress", max_width=BAR_WIDTH)
    for job in jobs or ():
        counts = job.get("request_counts")
        counts = counts if isinstance(counts, dict) else {}  # (another server's shape: dashes)
        done, failed, total = (counts.get(k) for k in ("completed", "failed", "total"))
        status = str(job.get("status"))
        created = job.get("created_at")
        age = f"{max(0.0, now - created):.0f} s" if isinstance(created, int | float) else MISSING
        table.add_row(
            Text(_value(job.get("id"))),
            Text(status, "bold green" if status in ACTIVE_JOBS else "dim"),
            _value(done), _value(failed), _value(total), age,
            *progress(done, failed, total),
        )  # fmt: skip
    if note is not None:
        table.caption = note
    elif not jobs:
        table.caption = "no batch jobs"
    return table


def progress(done: Any, failed: Any, total: Any) -> tuple[RenderableType, RenderableType]:
    """A job's share of lines ended, and a bar of it as wide as the table leaves room for."""
    counts = (done, failed, total)
    if not all(isinstance(c, int) and c >= 0 for c in counts) or not total:
        return MISSING, ""
    ended = min(total, done + failed)
    bar = ProgressBar(total=total, completed=ended, complete_style="cyan", finished_style="cyan")
    return f"{ended / total:.0%}", bar


def render_unreachable(url: str, error: str, interval: float | None = None) -> Panel:
    retry = f"\nretrying every {interval:g} s (Ctrl-C to quit)" if interval else ""
    body = Text.assemble(("cannot reach the gateway at ", "bold red"), (url, "bold"), f"\n{error}")
    body.append(retry, "dim")
    return Panel(body, title="tandem top", title_align="left", border_style="red")


def render_frame(
    url: str,
    ready: Mapping[str, Any],
    rates: Mapping[str, float | None],
    history: Mapping[str, Sequence[int]],
    jobs: Table | None = None,
) -> Group:
    workers = ready.get("workers") or []
    service = (ready.get("scheduler") or {}).get("service") or []
    parts = [
        render_header(url, ready, rates),
        render_workers(workers),
        render_fair_share(service),
        render_batches(workers, history),
    ]
    return Group(*parts, *([jobs] if jobs is not None else []))


# ---- the loop ----------------------------------------------------------------------------------


class Top:
    """The state kept between frames: the previous snapshot (for rates) and the batch history."""

    def __init__(self, url: str, interval: float | None = None) -> None:
        self.url = url
        self.interval = interval
        self.batches = BatchHistory()
        self._previous: Snapshot | None = None

    def frame(self, snapshot: Snapshot) -> RenderableType:
        if snapshot.error is not None:
            return render_unreachable(self.url, snapshot.error, self.interval)
        rates = token_rates(self._previous, snapshot)
        self.batches.observe(snapshot.ready.get("workers") or [])
        self._previous = snapshot
        jobs = render_jobs(snapshot.jobs, snapshot.jobs_note, time.time())
        return render_frame(self.url, snapshot.ready, rates, self.batches.sizes, jobs)


def live_loop(
    top: Top,
    next_snapshot: Callable[[], Snapshot],
    console: Console,
    iterations: int | None,
    sleep: Callable[[float], None] = time.sleep,
) -> int:
    """Redraws in place every interval, `iterations` frames or until Ctrl-C."""
    with Live(top.frame(next_snapshot()), console=console, auto_refresh=False) as live:
        done = 1
        while iterations is None or done < iterations:
            sleep(top.interval or 0)
            live.update(top.frame(next_snapshot()), refresh=True)
            done += 1
    if not console.is_terminal:
        console.line()  # Live ends the last frame's line only on a terminal
    return 0


def run(args: argparse.Namespace) -> int:
    url = args.url.rstrip("/")
    console = Console()
    # The gateway's /metrics scrapes every peer before it answers, hence more than a ping's time.
    timeout = httpx.Timeout(5.0, connect=2.0)
    try:
        with httpx.Client(trust_env=False, timeout=timeout) as client:
            if args.once:
                return print_once(Top(url), fetch(client, url, args.api_key), console)
            top = Top(url, args.interval)
            snapshots = lambda: fetch(client, url, args.api_key)  # noqa: E731
            return live_loop(top, snapshots, console, args.iterations)
    except KeyboardInterrupt:  # the last frame stays on screen, without a traceback
        return 0


def print_once(top: Top, snapshot: Snapshot, console: Console) -> int:
    if snapshot.error is not None:
        print(
            f"tandem top: cannot reach the gateway at {top.url}: {snapshot.error}", file=sys.stderr
        )
        return 1
    console.print(top.frame(snapshot))
    return 0
