"""Splitting TTFT into its parts from a cluster's log lines, without a cluster."""

from __future__ import annotations

import json

import pytest

from loadtest import ttft_breakdown


def line(service: str, event: str, request_id: str, second: float, **fields) -> str:
    stamp = f"2026-12-01T10:00:{second:09.6f}Z"
    record = {"request_id": request_id, "event": event, "timestamp": stamp, **fields}
    return f"[{service:>9}] {json.dumps(record)}"


def remote(request: str, t0: float) -> list[str]:
    """A chat request prefilled on a prefill worker: 0.01 + 0.02 + 0.3 + 0.2 + 0.05 s."""
    choice = f"{request}-0"
    return [
        line("gateway", "request arrived", request, t0),
        line("scheduler", "request queued", choice, t0 + 0.01),
        line("scheduler", "request dispatched", choice, t0 + 0.03),
        line("prefill-0", "prefill started", choice, t0 + 0.33),
        line("prefill-0", "prefill finished", choice, t0 + 0.53),
        line("gateway", "first token", choice, t0 + 0.58),
    ]


def test_each_part_is_the_gap_between_its_steps_and_local_prefills_stream_nothing():
    local = [
        line("gateway", "request arrived", "chatcmpl-b", 20.0),
        line("scheduler", "request queued", "chatcmpl-b-0", 20.0),
        line("scheduler", "request dispatched", "chatcmpl-b-0", 20.0),
        line("decode-0", "local prefill", "chatcmpl-b-0", 20.5),
        line("gateway", "first token", "chatcmpl-b-0", 21.0),
    ]
    noise = ["not json", "[  gateway] {broken", line("gateway", "request arrived", "cmpl-x", 1.0)]
    lines = remote("chatcmpl-a", 10.0) + local + noise + remote("chatcmpl-c", 30.0)
    times = ttft_breakdown.choice_times(lines, "chatcmpl-")
    assert set(times) == {"chatcmpl-a-0", "chatcmpl-b-0", "chatcmpl-c-0"}
    split = ttft_breakdown.parts(times["chatcmpl-a-0"])
    expected = {"submit": 0.01, "queue": 0.02, "reserve": 0.3, "prefill": 0.2, "stream": 0.05,
                "ttft": 0.58}  # fmt: skip
    assert split == pytest.approx(expected, abs=1e-6)
    assert ttft_breakdown.parts(times["chatcmpl-b-0"]) == pytest.approx(
        {"submit": 0, "queue": 0, "reserve": 0.5, "prefill": 0.5, "stream": 0, "ttft": 1.0}
    )
    result = ttft_breakdown.breakdown(lines, "chatcmpl-")
    assert result["reserve"] == {"p50": 0.3, "p99": 0.5, "n": 3}
    start = ttft_breakdown.choice_times(lines, "chatcmpl-")["chatcmpl-b-0"]["arrived"]
    window = ttft_breakdown.breakdown(lines, "chatcmpl-", since=start, until=start + 5)
    assert window["ttft"] == {"p50": 1.0, "p99": 1.0, "n": 1}  # b alone arrived then


def test_an_unfinished_choice_is_left_out_and_an_empty_log_says_so(tmp_path, capsys):
    unfinished = remote("chatcmpl-a", 10.0)[:-1]  # no first token yet
    assert ttft_breakdown.breakdown(unfinished, "chatcmpl-") == {}
    log = tmp_path / "run.log"
    log.write_text("\n".join(unfinished) + "\n")
    assert ttft_breakdown.main([str(log)]) == 1
    assert "no complete choice" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        ttft_breakdown.main([str(tmp_path / "missing.log")])
    assert exit_info.value.code == 2
