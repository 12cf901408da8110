"""Where the time to first token went, read from a cluster's logs.

Every service logs a request's steps under one request id (the gateway's `request arrived` and
`first token`, the scheduler's `request queued` and `request dispatched`, the worker's `prefill
started`/`prefill finished` or the decode worker's `local prefill`), so the logs of a run (what
`tandem up` prints, one JSON object a line, optionally behind a `[service]` prefix) split each
choice's TTFT into:

- `submit`: the gateway's arrival to the scheduler's queue;
- `queue`: queued until dispatched (fair share, room on the workers);
- `reserve`: dispatched until the prefill began (the decode worker's reservation round trip,
  which waits for the step the decode worker is in, then the prefill worker's step in progress);
- `prefill`: the prefill itself (for a local prefill: until the first token, streaming included);
- `stream`: the prefill's end to the gateway's first token.

    .venv/bin/python -m loadtest.ttft_breakdown LOG [--id-prefix chatcmpl-] [--since S --until S]

Prints the median and p99 of each part (seconds) over the choices whose id starts with the
prefix (default: chat requests; a batch job's lines are completions, `cmpl-`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Iterable
from datetime import datetime
from pathlib import Path

PARTS = ("submit", "queue", "reserve", "prefill", "stream", "ttft")
EVENTS = {
    "request arrived": "arrived",
    "request queued": "queued",
    "request dispatched": "dispatched",
    "prefill started": "started",
    "local prefill": "started_local",
    "prefill finished": "finished",
    "first token": "first",
}


def records(lines: Iterable[str]) -> Iterable[dict]:
    """The JSON objects of the log lines that hold one (a `[service]` prefix is skipped)."""
    for line in lines:
        brace = line.find("{")
        if brace < 0:
            continue
        try:
            record = json.loads(line[brace:])
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict):
            yield record


def choice_times(lines: Iterable[str], id_prefix: str) -> dict[str, dict[str, float]]:
    """Per choice id (`<request id>-<index>`): the time of each step, in seconds since epoch.
    The gateway's arrival is logged under the request id and counts for its every choice."""
    arrivals: dict[str, float] = {}
    choices: dict[str, dict[str, float]] = {}
    for record in records(lines):
        step = EVENTS.get(record.get("event", ""))
        request_id = record.get("request_id", "")
        if step is None or not request_id.startswith(id_prefix) or "timestamp" not in record:
            continue
        at = datetime.fromisoformat(record["timestamp"].replace("Z", "+00:00")).timestamp()
        if step == "arrived":
            arrivals[request_id] = at
        else:
            choices.setdefault(request_id, {}).setdefault(step, at)  # a retry keeps the first
    for choice_id, times in choices.items():
        request_id = choice_id.rsplit("-", 1)[0]
        if request_id in arrivals:
            times["arrived"] = arrivals[request_id]
    return choices


def parts(times: dict[str, float]) -> dict[str, float] | None:
    """A choice's TTFT split into PARTS; None when a step is missing (not finished, resumed)."""
    if "started" in times:  # on a prefill worker
        started, finished = times["started"], times.get("finished")
    else:  # on the decode worker (its end is the first token's arrival: stream counts 0)
        started, finished = times.get("started_local"), times.get("first")
    needed = (times.get("arrived"), times.get("queued"), times.get("dispatched"), started,
              finished, times.get("first"))  # fmt: skip
    if any(t is None for t in needed):
        return None
    arrived, queued, dispatched, started, finished, first = needed
    return {
        "submit": queued - arrived,
        "queue": dispatched - queued,
        "reserve": started - dispatched,
        "prefill": finished - started,
        "stream": first - finished,
        "ttft": first - arrived,
    }


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def breakdown(
    lines: Iterable[str],
    id_prefix: str,
    since: float = float("-inf"),
    until: float = float("inf"),
) -> dict[str, dict[str, float]]:
    """Median and p99 of each part over the complete choices that arrived between `since` and
    `until` (seconds since epoch), and how many there were."""
    times = choice_times(lines, id_prefix).values()
    arrived = [t for t in times if since <= t.get("arrived", since) <= until]
    split = [p for p in map(parts, arrived) if p is not None]
    if not split:
        return {}
    return {
        part: {
            "p50": round(statistics.median(p[part] for p in split), 4),
            "p99": round(percentile([p[part] for p in split], 0.99), 4),
            "n": len(split),
        }
        for part in PARTS
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("log", type=Path, help="a run's log (what `tandem up` printed)")
    parser.add_argument("--id-prefix", default="chatcmpl-", help="whose choices to count")
    parser.add_argument("--since", type=float, default=float("-inf"), help="arrived from (epoch s)")
    parser.add_argument("--until", type=float, default=float("inf"), help="arrived until (epoch s)")
    args = parser.parse_args(argv)
    try:
        with open(args.log, encoding="utf-8", errors="replace") as f:
            result = breakdown(f, args.id_prefix, args.since, args.until)
    except OSError as error:
        parser.error(f"cannot read {args.log}: {error}")
    if not result:
        print(f"no complete choice with an id starting {args.id_prefix!r}", file=sys.stderr)
        return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
