"""What a soak measures (`loadtest.soak` runs it): each request's outcome, throughput in the
windows around the kill, the services' memory from /proc, and the gateway's resumption count.
Pure functions over records, so they are tested without a cluster.
"""

from __future__ import annotations

import enum
import json
import re
import statistics
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

MAX_REASON_CHARS = 300
RESUMED_METRIC = "tandem:requests_resumed_total"
REJOIN_MARGIN_S = 1.0  # the gateway's view of a heartbeat's age may be this stale


# --- one request and its outcome ---------------------------------------------------------------


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REFUSED = "refused"
    FAILED = "failed"
    LOST = "lost"


@dataclass
class Attempt:
    """What the client saw of one request; times in seconds since the soak began."""

    send_time: float
    finish_time: float | None = None  # None: never ended (cancelled at the run's deadline)
    status: int | None = None  # HTTP status; None when no response came
    retry_after: str | None = None  # the header, on a refusal
    body: str = ""  # the body of a non-200 answer
    done: bool = False  # the stream ended with [DONE]
    num_tokens: int | None = None  # usage.completion_tokens
    error_event: str | None = None  # the first error event in the stream
    exception: str | None = None  # a transport or protocol error
    timed_out_after_s: float | None = None  # hit its own timeout
    chunk_times: list[float] = field(default_factory=list)  # each chunk with tokens


def classify(attempt: Attempt, expected_tokens: int) -> tuple[Outcome, str]:
    """The request's outcome and its reason ("" when completed)."""
    if attempt.timed_out_after_s is not None:
        return Outcome.LOST, f"no outcome within the {attempt.timed_out_after_s:g} s timeout"
    if attempt.finish_time is None:
        return Outcome.LOST, "no outcome by the run's deadline"
    if attempt.status == 429:
        if attempt.retry_after is None:
            return Outcome.FAILED, "HTTP 429 without Retry-After"
        return Outcome.REFUSED, "HTTP 429"
    if attempt.status is not None and attempt.status != 200:
        return Outcome.FAILED, f"HTTP {attempt.status}: {error_message(attempt.body)}"
    if attempt.exception is not None:
        return Outcome.FAILED, attempt.exception
    if attempt.error_event is not None:
        return Outcome.FAILED, f"error event: {attempt.error_event}"
    if not attempt.done:
        return Outcome.FAILED, "the stream ended without [DONE]"
    if attempt.num_tokens != expected_tokens:
        return Outcome.FAILED, f"{attempt.num_tokens} tokens, expected {expected_tokens}"
    return Outcome.COMPLETED, ""


def error_message(body: str) -> str:
    """The `error.message` of an OpenAI-shaped error body, else the body itself."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body


def reason_key(reason: str) -> str:
    """A reason without its request ids, so that equal failures count together."""
    return re.sub(r"[0-9a-f]{16,}(~\d+)?", "<id>", reason)[:MAX_REASON_CHARS]


def tally(attempts: Sequence[Attempt], expected_tokens: int) -> dict[str, Any]:
    counts = Counter({outcome.value: 0 for outcome in Outcome})
    reasons: dict[str, Counter] = {"failed": Counter(), "lost": Counter()}
    for attempt in attempts:
        outcome, reason = classify(attempt, expected_tokens)
        counts[outcome.value] += 1
        if outcome.value in reasons:
            reasons[outcome.value][reason_key(reason)] += 1
    return {
        "sent": len(attempts),
        **counts,
        "failed_reasons": dict(reasons["failed"].most_common()),
        "lost_reasons": dict(reasons["lost"].most_common()),
    }


# --- throughput around the kill ----------------------------------------------------------------


def windows(
    kill_s: float, rejoin_s: float | None, end_s: float, settle_s: float
) -> dict[str, tuple[float, float]]:
    """[0, kill), [kill, rejoin + settle), [that, end), clipped to the end; without a rejoin the
    second runs to the end and there is no third."""
    recovered = end_s if rejoin_s is None else min(end_s, rejoin_s + settle_s)
    spans = {"before": (0.0, kill_s), "during": (kill_s, recovered), "after": (recovered, end_s)}
    return {name: span for name, span in spans.items() if span[1] > span[0]}


class Completion(NamedTuple):
    finish_s: float
    num_tokens: int
    chunk_times: Sequence[float]  # arrival of each streamed chunk of tokens


def throughput(completions: Sequence[Completion], span: tuple[float, float]) -> dict[str, float]:
    """Completed requests per second by finish time in [start, end), and their tokens per second
    by arrival: each chunk in the span counts its share of the request's tokens (all of them at
    the finish when no chunk was timed), so a request resumed after the kill counts the tokens
    it got before it where they came."""
    start, end = span
    num_requests, num_tokens = 0, 0.0
    for done in completions:
        num_requests += start <= done.finish_s < end
        times = done.chunk_times or [done.finish_s]
        num_tokens += done.num_tokens * sum(start <= t < end for t in times) / len(times)
    wall = end - start
    return {
        "start_s": start,
        "end_s": end,
        "requests": num_requests,
        "tokens": round(num_tokens, 3),
        "requests_per_s": num_requests / wall,
        "tokens_per_s": num_tokens / wall,
    }


def pauses_across(completions: Sequence[Completion], kill_s: float) -> dict[str, Any]:
    """The streams the kill cut: completed requests with a chunk before the kill and one after
    it (resumed elsewhere, or served on by the survivor), each one's longest pause between two
    chunks, in seconds: their count, median and longest. A killed worker's streams stood still
    until the scheduler took it out of rotation (the whole heartbeat timeout before its
    connection was watched)."""
    longest = sorted(
        max(b - a for a, b in zip(done.chunk_times, done.chunk_times[1:], strict=False))
        for done in completions
        if done.chunk_times and done.chunk_times[0] < kill_s < done.chunk_times[-1]
    )
    return {
        "streams": len(longest),
        "p50_s": statistics.median(longest) if longest else None,
        "max_s": longest[-1] if longest else None,
    }


def completions(attempts: Sequence[Attempt], expected_tokens: int) -> list[Completion]:
    return [
        Completion(a.finish_time, a.num_tokens or 0, a.chunk_times)
        for a in attempts
        if classify(a, expected_tokens)[0] is Outcome.COMPLETED and a.finish_time is not None
    ]


# --- processes, memory, metrics ----------------------------------------------------------------


def parse_vmrss(status: str) -> int | None:
    """Bytes of `VmRSS` in the text of /proc/<pid>/status (None when absent: a zombie)."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            value, unit = line.split()[1:3]
            assert unit == "kB", line
            return int(value) * 1024
    return None


def service_name(argv: Sequence[str]) -> str | None:
    """A `tandem` service's name from its argv: the `--peer-id`, else the subcommand."""
    if "--peer-id" in argv[:-1]:
        return argv[argv.index("--peer-id") + 1]
    if "services.commands.cli" in argv[:-1]:
        return argv[argv.index("services.commands.cli") + 1]
    return None


def service_pids(parent: int) -> dict[str, int]:
    """The children of `tandem up` (process `parent`), by service name."""
    pids = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
        name = service_name(argv)
        if ppid == parent and name is not None:
            pids[name] = int(entry.name)
    return pids


def memory_snapshot(parent: int) -> dict[str, dict[str, int | None]]:
    snapshot = {}
    for name, pid in sorted(service_pids(parent).items()):
        try:
            rss = parse_vmrss(Path(f"/proc/{pid}/status").read_text())
        except OSError:
            rss = None
        snapshot[name] = {"pid": pid, "rss_bytes": rss}
    return snapshot


def memory_rows(start: Mapping[str, dict], end: Mapping[str, dict]) -> list[dict[str, Any]]:
    """One row per service seen at either time; `restarted` when its pid changed."""
    rows = []
    for name in sorted(set(start) | set(end)):
        first, last = start.get(name, {}), end.get(name, {})
        rows.append(
            {
                "service": name,
                "pid_start": first.get("pid"),
                "rss_start_bytes": first.get("rss_bytes"),
                "pid_end": last.get("pid"),
                "rss_end_bytes": last.get("rss_bytes"),
                "restarted": bool(first and last and first["pid"] != last["pid"]),
            }
        )
    return rows


def metric_total(exposition: str, name: str) -> float:
    """The sum of a metric's samples over all labels in a Prometheus text exposition."""
    total = 0.0
    for line in exposition.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def has_rejoined(ready: Mapping[str, Any], peer_id: str, since_kill_s: float) -> bool:
    """`/ready` lists `peer_id` healthy with a heartbeat younger than the kill: the new process
    (the dead one's entry, until dropped, only ages)."""
    return any(
        w.get("peer_id") == peer_id
        and w.get("healthy")
        and w.get("heartbeat_age_s", float("inf")) < since_kill_s - REJOIN_MARGIN_S
        for w in ready.get("workers", [])
    )
