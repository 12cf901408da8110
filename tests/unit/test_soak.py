"""The soak's pure pieces on hand-made data, without a cluster: outcomes and their reasons,
throughput windows around the kill, RSS and argv parsing, the rejoin test on `/ready` bodies,
the metric sum, the report, and the flags it refuses."""

from __future__ import annotations

import json

import pytest

from loadtest.soak import format_report, parse_args, passed
from loadtest.soak_measures import (
    Attempt,
    Completion,
    Outcome,
    classify,
    has_rejoined,
    memory_rows,
    metric_total,
    parse_vmrss,
    pauses_across,
    reason_key,
    service_name,
    tally,
    throughput,
    windows,
)

TOKENS = 16


def finished(**fields) -> Attempt:
    return Attempt(send_time=1.0, finish_time=2.0, **fields)


def completed(finish_time: float = 2.0) -> Attempt:
    return Attempt(1.0, finish_time, status=200, done=True, num_tokens=TOKENS)


# --- outcomes ----------------------------------------------------------------------------------


def test_a_full_stream_with_the_expected_count_is_completed():
    assert classify(completed(), TOKENS) == (Outcome.COMPLETED, "")


def test_a_429_with_retry_after_is_refused_and_without_it_failed():
    assert classify(finished(status=429, retry_after="1"), TOKENS)[0] is Outcome.REFUSED
    assert classify(finished(status=429), TOKENS) == (
        Outcome.FAILED,
        "HTTP 429 without Retry-After",
    )


@pytest.mark.parametrize(
    "attempt,reason",
    [
        (
            finished(status=503, body=json.dumps({"error": {"message": "no decode worker"}})),
            "HTTP 503: no decode worker",
        ),
        (finished(status=500, body="not json"), "HTTP 500: not json"),
        (finished(exception="ReadError: closed"), "ReadError: closed"),
        (
            finished(status=200, done=True, num_tokens=3, error_event="lost: worker died"),
            "error event: lost: worker died",
        ),
        (finished(status=200, num_tokens=TOKENS), "the stream ended without [DONE]"),
        (finished(status=200, done=True, num_tokens=15), "15 tokens, expected 16"),
        (finished(status=200, done=True), "None tokens, expected 16"),
    ],
)
def test_what_fails_and_why(attempt, reason):
    assert classify(attempt, TOKENS) == (Outcome.FAILED, reason)


def test_a_request_without_an_outcome_is_lost():
    assert classify(Attempt(1.0), TOKENS) == (Outcome.LOST, "no outcome by the run's deadline")
    timed_out = finished(timed_out_after_s=120.0)
    assert classify(timed_out, TOKENS) == (Outcome.LOST, "no outcome within the 120 s timeout")


def test_the_tally_counts_every_outcome_and_groups_reasons_without_ids():
    lost_a = "request cmpl-0123456789abcdef0123 lost: worker died"
    lost_b = "request cmpl-fedcba9876543210fedc~1 lost: worker died"
    attempts = [
        completed(),
        completed(),
        finished(status=429, retry_after="1"),
        finished(status=200, done=True, error_event=lost_a),
        finished(status=200, done=True, error_event=lost_b),
        finished(status=200),
        Attempt(5.0),
    ]
    counts = tally(attempts, TOKENS)
    assert {k: counts[k] for k in ("sent", "completed", "refused", "failed", "lost")} == {
        "sent": 7,
        "completed": 2,
        "refused": 1,
        "failed": 3,
        "lost": 1,
    }
    assert counts["failed_reasons"] == {
        "error event: request cmpl-<id> lost: worker died": 2,
        "the stream ended without [DONE]": 1,
    }
    assert counts["lost_reasons"] == {"no outcome by the run's deadline": 1}


def test_reason_key_keeps_short_numbers_and_caps_the_length():
    assert reason_key("HTTP 503: retry in 1 s") == "HTTP 503: retry in 1 s"
    assert len(reason_key("x" * 1000)) == 300


def test_an_empty_run_tallies_zeros():
    counts = tally([], TOKENS)
    assert counts["sent"] == counts["completed"] == counts["lost"] == 0


# --- throughput windows ------------------------------------------------------------------------


def test_windows_split_at_the_kill_and_the_rejoin_plus_settling():
    assert windows(kill_s=24, rejoin_s=40, end_s=60, settle_s=5) == {
        "before": (0.0, 24),
        "during": (24, 45),
        "after": (45, 60),
    }


def test_without_a_rejoin_the_outage_runs_to_the_end():
    assert windows(24, None, 60, 5) == {"before": (0.0, 24), "during": (24, 60)}


def test_a_rejoin_too_late_leaves_no_after_window():
    assert windows(24, 58, 60, 5) == {"before": (0.0, 24), "during": (24, 60)}


def test_requests_count_by_finish_time_in_half_open_windows():
    done = [Completion(t, 16, []) for t in (1.0, 9.99, 10.0, 15.0, 30.0)]
    assert throughput(done, (0.0, 10.0)) == {
        "start_s": 0.0,
        "end_s": 10.0,
        "requests": 2,
        "tokens": 32,
        "requests_per_s": 0.2,
        "tokens_per_s": 3.2,
    }
    assert throughput(done, (10.0, 20.0))["requests"] == 2
    assert throughput([], (0.0, 5.0))["tokens_per_s"] == 0.0


def test_tokens_count_where_their_chunks_arrived():
    # 16 tokens in 4 chunks: 3 before the kill at 10 s, the last (after a resume) at 25 s.
    resumed = Completion(25.0, 16, [2.0, 3.0, 4.0, 25.0])
    before, during = throughput([resumed], (0.0, 10.0)), throughput([resumed], (10.0, 30.0))
    assert (before["requests"], before["tokens"]) == (0, 12)
    assert (during["requests"], during["tokens"]) == (1, 4)
    assert during["tokens_per_s"] == pytest.approx(0.2)


# --- processes and memory ----------------------------------------------------------------------


def test_vmrss_is_read_in_bytes():
    status = "Name:\tpython\nVmPeak:\t  900 kB\nVmRSS:\t  123456 kB\nThreads:\t4\n"
    assert parse_vmrss(status) == 123456 * 1024
    assert parse_vmrss("Name:\tzombie\nState:\tZ (zombie)\n") is None


@pytest.mark.parametrize(
    "argv,name",
    [
        (
            [
                "python",
                "-m",
                "services.commands.cli",
                "decode",
                "--peer-id",
                "decode-1",
                "--x",
                "1",
            ],
            "decode-1",
        ),
        (
            ["python", "-m", "services.commands.cli", "scheduler", "--address", "ipc://s"],
            "scheduler",
        ),
        (["python", "-m", "services.commands.cli", "gateway"], "gateway"),
        (["python", "-m", "services.commands.cli"], None),
        (["bash", "-c", "sleep 1"], None),
        (["python", "--peer-id"], None),
        ([], None),
    ],
)
def test_a_service_is_named_by_its_peer_id_or_its_subcommand(argv, name):
    assert service_name(argv) == name


def test_memory_rows_mark_a_new_pid_as_restarted():
    start = {
        "decode-0": {"pid": 10, "rss_bytes": 100},
        "gateway": {"pid": 11, "rss_bytes": 200},
        "prefill-0": {"pid": 12, "rss_bytes": 300},
    }
    end = {"decode-0": {"pid": 20, "rss_bytes": 150}, "gateway": {"pid": 11, "rss_bytes": 210}}
    rows = {row["service"]: row for row in memory_rows(start, end)}
    assert rows["decode-0"]["restarted"] and rows["decode-0"]["pid_end"] == 20
    assert not rows["gateway"]["restarted"] and rows["gateway"]["rss_end_bytes"] == 210
    assert rows["prefill-0"]["pid_end"] is None and not rows["prefill-0"]["restarted"]


def test_metric_total_sums_every_labelled_sample_of_that_name_only():
    exposition = "\n".join(
        [
            "# HELP tandem:requests_resumed_total Requests resumed",
            "# TYPE tandem:requests_resumed_total counter",
            'tandem:requests_resumed_total{peer="gateway"} 3.0',
            'tandem:requests_resumed_total{peer="gateway-2"} 2.0',
            "tandem:requests_resumed_total_created 1.7e9",
            "tandem:requests_resumed 99",
        ]
    )
    assert metric_total(exposition, "tandem:requests_resumed_total") == 5.0
    assert metric_total("", "tandem:requests_resumed_total") == 0.0


def ready(*workers: dict) -> dict:
    return {"ready": True, "workers": list(workers)}


def test_the_dead_workers_aging_entry_is_not_a_rejoin():
    stale = {"peer_id": "decode-0", "healthy": True, "heartbeat_age_s": 6.2}
    assert not has_rejoined(ready(stale), "decode-0", since_kill_s=6.5)


def test_a_fresh_healthy_entry_after_the_kill_is_a_rejoin():
    fresh = {"peer_id": "decode-0", "healthy": True, "heartbeat_age_s": 0.3}
    other = {"peer_id": "decode-1", "healthy": True, "heartbeat_age_s": 0.1}
    assert has_rejoined(ready(other, fresh), "decode-0", since_kill_s=12.0)
    assert not has_rejoined(ready(other), "decode-0", since_kill_s=12.0)
    assert not has_rejoined(ready({**fresh, "healthy": False}), "decode-0", since_kill_s=12.0)
    assert not has_rejoined({}, "decode-0", since_kill_s=12.0)


# --- flags and report --------------------------------------------------------------------------


def test_the_defaults_parse():
    args = parse_args([])
    assert (args.kill, args.kill_at, args.prefill, args.decode) == ("decode", 0.4, 1, 2)


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--kill", "gateway"], "invalid choice: 'gateway'"),
        (["--kill-at", "0"], "must be strictly between 0 and 1, got 0"),
        (["--kill-at", "1"], "must be strictly between 0 and 1, got 1"),
        (["--kill-at", "1.5"], "must be strictly between 0 and 1, got 1.5"),
        (["--kill-at", "soon"], "argument --kill-at: not a number (float): 'soon'"),
        (["--decode", "1.5"], "argument --decode: not a number (int): '1.5'"),
        (["--duration", "-5"], "must be > 0, got -5"),
        (["--decode", "0"], "must be > 0, got 0"),
    ],
)
def test_bad_flags_are_refused_with_a_clear_message(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def report(lost: int = 0, rejoin_s: float | None = 31.0) -> dict:
    return {
        "settings": {"duration": 60.0, "overload": 2.0, "prompt_tokens": 32, "max_tokens": 16},
        "log": "/tmp/tandem-up.log",
        "calibration": {
            "clients": 16,
            "requests_per_s": 2.5,
            "tokens_per_s": 40.0,
            "outcomes": tally([completed()] * 3, TOKENS),
        },
        "rate_per_s": 5.0,
        "outcomes": {
            "sent": 300,
            "completed": 150,
            "refused": 140,
            "failed": 10 - lost,
            "lost": lost,
            "failed_reasons": {"HTTP 503: no decode worker": 10 - lost},
            "lost_reasons": {"no outcome by the run's deadline": lost} if lost else {},
        },
        "kill": {
            "victim": "decode-0",
            "old_pid": 10,
            "new_pid": 20 if rejoin_s else None,
            "kill_s": 24.0,
            "rejoin_s": rejoin_s,
            "error": None,
        },
        "throughput": {
            "before": throughput([Completion(5.0, 16, [4.0, 5.0])], (0.0, 24.0)),
            "during": throughput([Completion(30.0, 16, [30.0])], (24.0, 36.0)),
        },
        "pauses": pauses_across([Completion(30.0, 16, [20.0, 21.0, 27.5, 30.0])], 24.0),
        "drained_s": 70.2,
        "requests_resumed": 4.0,
        "memory": memory_rows(
            {"decode-0": {"pid": 10, "rss_bytes": 500 << 20}},
            {"decode-0": {"pid": 20, "rss_bytes": 480 << 20}},
        ),
    }


def test_the_report_names_counts_reasons_windows_and_restarts():
    text = format_report(report())
    assert "soak requests: sent 300, completed 150, refused (429) 140, failed 10, lost 0" in text
    assert "calibration requests: sent 3, completed 3, refused (429) 0, failed 0, lost 0" in text
    assert "HTTP 503: no decode worker" in text
    assert "decode-0 (pid 10) at 24.0 s, rejoined at 31.0 s (pid 20)" in text
    assert "requests resumed: 4" in text
    assert "streams across the kill: 1, their longest pause p50 6.50 s, max 6.50 s" in text
    assert "before" in text and "during" in text and "after" not in text
    assert "restarted (new pid)" in text and "500" in text and "480" in text
    assert "FAIL" not in text
    assert passed(report())


def test_the_pauses_are_those_of_the_streams_the_kill_cut():
    cut = [Completion(9.0, 4, [1.0, 2.0, 6.0, 9.0]), Completion(8.0, 4, [3.0, 3.5, 8.0])]
    untouched = [
        Completion(4.0, 4, [1.0, 4.0]),
        Completion(9.0, 4, [6.0, 9.0]),
        Completion(5, 4, []),
    ]
    assert pauses_across(cut + untouched, kill_s=5.0) == {"streams": 2, "p50_s": 4.25, "max_s": 4.5}
    assert pauses_across(untouched, kill_s=5.0) == {"streams": 0, "p50_s": None, "max_s": None}


def test_a_lost_request_or_a_worker_that_never_rejoined_fails_the_soak():
    assert not passed(report(lost=1))
    assert not passed(report(rejoin_s=None))
    assert "FAIL" in format_report(report(rejoin_s=None))
    assert "never rejoined" in format_report(report(rejoin_s=None))
