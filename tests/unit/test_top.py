"""`tandem top` without a cluster: frames drawn from hand-made /ready bodies and /metrics texts,
rates and batch history across snapshots, the fetch layer on a mock transport, wrong input."""

from __future__ import annotations

import io
import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest
from rich.console import Console

from services.commands import top
from services.commands.top import (
    BatchHistory,
    Snapshot,
    Top,
    kv_usage,
    prefix_hit_rate,
    sparkline,
)

URL = "http://gateway:8000"


def worker(peer_id: str, role: str = "decode", **fields) -> dict:
    return {
        "peer_id": peer_id,
        "role": role,
        "healthy": True,
        "heartbeat_age_s": 0.25,
        "running": 0,
        "waiting": 0,
        "swapped": 0,
        "free_blocks": 100,
        "total_blocks": 100,
        "steps_completed": 0,
        "recent_batch_sizes": [],
        "metrics_address": "http://127.0.0.1:9",
        **fields,
    }


def ready_body(*workers: dict, ready: bool = True, service: list | None = None) -> dict:
    return {
        "ready": ready,
        "queued": 3,
        "in_flight": 5,
        "preemptions": {"swap": 1, "recompute": 2},
        "scheduler": {"policy": "fair", "service": service or []},
        "workers": list(workers),
    }


def metrics_text(generated: float, prefilled: float) -> str:
    return (
        "# TYPE tandem:generation_tokens_total counter\n"
        f'tandem:generation_tokens_total{{peer="gateway-1"}} {generated}\n'
        "# TYPE tandem:prefill_tokens_total counter\n"
        f'tandem:prefill_tokens_total{{peer="prefill-0"}} {prefilled}\n'
        "# TYPE tandem:num_requests_running gauge\n"
        'tandem:num_requests_running{peer="decode-0"} 4.0\n'
    )


def render(renderable, width: int = 100) -> str:
    console = Console(file=io.StringIO(), width=width, color_system=None)
    console.print(renderable)
    return console.file.getvalue()


def snapshot(at: float, body: dict, generated: float = 0.0, prefilled: float = 0.0) -> Snapshot:
    return Snapshot(at, ready=body, counters=top.parse_counters(metrics_text(generated, prefilled)))


# ---- pure pieces ----


def test_sparkline_scales_to_the_largest_value():
    assert sparkline([0, 1, 2, 4, 8]) == "▁▂▃▅█"
    assert sparkline([3, 3, 3]) == "███"
    assert sparkline([0, 0]) == "▁▁"
    assert sparkline([]) == ""
    assert sparkline(list(range(100)), width=10) == sparkline(list(range(90, 100)), width=10)
    assert len(sparkline(list(range(100)), width=10)) == 10


def test_kv_usage_counts_used_blocks_and_tolerates_missing_data():
    assert kv_usage({"free_blocks": 91, "total_blocks": 364}) == ("273/364", "75.0%")
    assert kv_usage({"free_blocks": 0, "total_blocks": 8}) == ("8/8", "100.0%")
    assert kv_usage({"free_blocks": 5, "total_blocks": 0}) == ("–", "–")
    assert kv_usage({}) == ("–", "–")


def test_prefix_hit_rate_sums_every_worker_and_tolerates_missing_data():
    workers = [
        {"prefix_query_tokens": 300, "prefix_hit_tokens": 200},
        {"prefix_query_tokens": 100, "prefix_hit_tokens": 100},
        {"role": "decode"},  # an older worker reporting nothing
    ]
    assert prefix_hit_rate(workers) == "75.0% (300/400 tokens)"
    assert prefix_hit_rate([]) == prefix_hit_rate([{"prefix_query_tokens": 0}]) == top.MISSING


def test_counters_keep_only_the_token_counters_per_series():
    counters = top.parse_counters(metrics_text(10, 20))
    assert counters == {
        ("tandem:generation_tokens_total", (("peer", "gateway-1"),)): 10.0,
        ("tandem:prefill_tokens_total", (("peer", "prefill-0"),)): 20.0,
    }


def test_token_rates_need_two_snapshots_and_survive_a_restart():
    body = ready_body()
    first, second = snapshot(10.0, body, 100, 1000), snapshot(12.0, body, 160, 1400)
    assert top.token_rates(None, first) == {top.GENERATED: None, top.PREFILLED: None}
    assert top.token_rates(first, second) == {top.GENERATED: 30.0, top.PREFILLED: 200.0}
    restarted = snapshot(14.0, body, 20, 1500)  # the gateway restarted: its counter went to 20
    assert top.token_rates(second, restarted) == {top.GENERATED: 10.0, top.PREFILLED: 50.0}
    no_metrics = Snapshot(16.0, ready=body, counters=None)
    assert top.token_rates(restarted, no_metrics)[top.GENERATED] is None


def test_batch_history_takes_only_the_steps_new_since_the_last_refresh():
    history = BatchHistory(max_steps=6)
    history.observe([worker("decode-0", steps_completed=3, recent_batch_sizes=[1, 2, 3])])
    assert list(history.sizes["decode-0"]) == [1, 2, 3]
    # The same heartbeat seen again adds nothing; a newer one adds its steps beyond the count.
    history.observe([worker("decode-0", steps_completed=3, recent_batch_sizes=[1, 2, 3])])
    history.observe([worker("decode-0", steps_completed=5, recent_batch_sizes=[3, 4, 5])])
    assert list(history.sizes["decode-0"]) == [1, 2, 3, 4, 5]
    # Steps from heartbeats never seen are missed, not invented; the oldest fall off.
    history.observe([worker("decode-0", steps_completed=50, recent_batch_sizes=[7, 8])])
    assert list(history.sizes["decode-0"]) == [2, 3, 4, 5, 7, 8]
    # A restarted worker (its step count went down) starts a new history.
    history.observe([worker("decode-0", steps_completed=2, recent_batch_sizes=[9, 9])])
    assert list(history.sizes["decode-0"]) == [9, 9]
    history.observe([worker("prefill-0", "prefill", steps_completed=4, recent_batch_sizes=[2])])
    assert "prefill-0" not in history.sizes


# ---- whole frames ----


def test_a_frame_shows_the_cluster_workers_queues_and_batches():
    service = [
        {"tenant": "gold", "class": "long", "served_tokens": 4096, "virtual_tokens": 1024.0,
         "queued": 2},
        {"tenant": "[red]free", "class": "short", "served_tokens": 17, "virtual_tokens": 17.0,
         "queued": 0},
    ]  # fmt: skip
    view = Top(URL, interval=1.0)
    view.frame(
        snapshot(
            1.0,
            ready_body(worker("decode-0", steps_completed=2, recent_batch_sizes=[1, 2])),
            generated=100,
            prefilled=500,
        )
    )
    body = ready_body(
        worker("prefill-0", "prefill", free_blocks=50, steps_completed=7),
        worker("decode-0", running=4, free_blocks=25, steps_completed=6,
               recent_batch_sizes=[2, 3, 4, 4]),
        worker("decode-1", healthy=False, heartbeat_age_s=12.5),
        service=service,
    )  # fmt: skip
    text = render(view.frame(snapshot(3.0, body, generated=180, prefilled=900)))
    for needle in ("ready", "policy fair", URL, "queued 3", "in flight 5", "1 swap, 2 recompute"):
        assert needle in text
    assert "generated 40.0" in text and "prefilled 200.0" in text
    for needle in ("prefill-0", "decode-0", "decode-1", "75/100", "75.0%", "50.0%", "12.5 s"):
        assert needle in text
    assert "stale" in text
    assert "gold" in text and "4096" in text and "[red]free" in text  # no markup from tenants
    decode_0 = next(line for line in text.splitlines() if "decode-0" in line and "█" in line)
    assert "▃▅▅▆██" in decode_0  # 1, 2 from the first frame, 2, 3, 4, 4 new; scaled to 4
    assert "2.7" in decode_0  # their mean
    assert "no steps yet" in text  # decode-1


def test_a_cluster_that_is_not_ready_is_drawn_with_what_it_has():
    text = render(Top(URL).frame(Snapshot(0.0, ready={"ready": False, "workers": []})))
    assert "NOT READY" in text
    assert "no workers registered" in text and "no requests yet" in text
    assert "generated –" in text  # one snapshot: no rate yet


def test_an_unreachable_gateway_is_a_message_in_the_frame():
    text = render(Top(URL, interval=2.0).frame(Snapshot(0.0, error="ConnectError: refused")))
    assert f"cannot reach the gateway at {URL}" in text
    assert "ConnectError: refused" in text and "retrying every 2 s" in text


def test_a_narrow_terminal_still_shows_whole_peer_ids():
    body = ready_body(worker("prefill-0", "prefill"), worker("decode-0"), worker("decode-1"))
    text = render(Top(URL).frame(snapshot(0.0, body)), width=60)
    for peer in ("prefill-0", "decode-0", "decode-1"):
        assert peer in text


# ---- fetching and the loop ----


JOBS = [
    {"id": "batch_new", "status": "in_progress", "created_at": 1000,
     "request_counts": {"total": 40, "completed": 9, "failed": 1}},
    {"id": "batch_old", "status": "completed", "created_at": 400,
     "request_counts": {"total": 5, "completed": 5, "failed": 0}},
]  # fmt: skip


def mock_gateway(
    status: int = 200, body: dict | None = None, metrics_status: int = 200, jobs_status: int = 200
):
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(status, json=body if body is not None else ready_body())
        if request.url.path == "/v1/batches":
            if request.headers.get("authorization") != "Bearer k":
                return httpx.Response(401, json={"error": {"message": "no key"}})
            return httpx.Response(jobs_status, json={"object": "list", "data": JOBS})
        return httpx.Response(metrics_status, text=metrics_text(42, 7))

    return httpx.Client(transport=httpx.MockTransport(handle))


def test_fetch_reads_ready_and_metrics_and_keeps_a_503_body():
    got = top.fetch(mock_gateway(), URL)
    assert got.error is None and got.ready["queued"] == 3
    assert got.counters[("tandem:generation_tokens_total", (("peer", "gateway-1"),))] == 42
    not_ready = top.fetch(mock_gateway(503, ready_body(ready=False)), URL)
    assert not_ready.error is None and not_ready.ready["ready"] is False
    without_metrics = top.fetch(mock_gateway(metrics_status=500), URL)
    assert without_metrics.error is None and without_metrics.counters is None


def test_fetch_reads_the_keys_batch_jobs_or_says_why_not():
    got = top.fetch(mock_gateway(), URL, api_key="k")
    assert [job["id"] for job in got.jobs] == ["batch_new", "batch_old"] and got.jobs_note is None
    keyless = top.fetch(mock_gateway(), URL)
    assert keyless.jobs is None and "--api-key" in keyless.jobs_note
    missing = top.fetch(mock_gateway(jobs_status=404), URL, api_key="k")
    assert missing.jobs is None and "404" in missing.jobs_note


def test_a_frame_shows_batch_jobs_with_their_progress(monkeypatch):
    monkeypatch.setattr(top.time, "time", lambda: 1030.0)
    frame = Top(URL).frame(Snapshot(0.0, ready=ready_body(), jobs=JOBS))
    text = render(frame, width=120)
    new = next(line for line in text.splitlines() if "batch_new" in line)
    assert "in_progress" in new and "30 s" in new and "25%" in new  # (9 + 1) of 40
    old = next(line for line in text.splitlines() if "batch_old" in line)
    assert "100%" in old
    empty = render(Top(URL).frame(Snapshot(0.0, ready=ready_body(), jobs=[])))
    assert "no batch jobs" in empty
    noted = Snapshot(0.0, ready=ready_body(), jobs_note="the gateway wants an API key")
    assert "wants an API key" in render(Top(URL).frame(noted))


def test_on_an_80_column_terminal_the_bar_gives_way_to_the_figures(monkeypatch):
    """The bar kept its 20 columns and the figures read "…" (`tandem top --once` in a default
    terminal); now the bar takes what the figures leave."""
    monkeypatch.setattr(top.time, "time", lambda: 5030.0)
    jobs = [{"id": "batch_6f1c2a9e0b7d4c3e8a5f1b2c", "status": "in_progress", "created_at": 1000,
             "request_counts": {"total": 10000, "completed": 1234, "failed": 5}}]  # fmt: skip
    for width in (80, 120):
        text = render(Top(URL).frame(Snapshot(0.0, ready=ready_body(), jobs=jobs)), width=width)
        row = next(line for line in text.splitlines() if "batch_6f1c" in line)
        assert "1234" in row and "10000" in row and "4030 s" in row and "12%" in row, row
        assert "…" not in row
    assert "━" in row  # the bar, where there is room


def test_fetch_names_what_went_wrong():
    assert "/ready answered 404" in top.fetch(mock_gateway(404), URL).error
    assert "not an object" in top.fetch(mock_gateway(body=[]), URL).error

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused")

    client = httpx.Client(transport=httpx.MockTransport(refuse))
    assert top.fetch(client, URL).error == "ConnectError: connection refused"


ANOTHER_SERVERS_READY = [
    {"status": "ready", "workers": 4},
    {"workers": {"decode-0": "ok"}},
    {"workers": [1, 2]},
    {"scheduler": "fair"},
    {"scheduler": {"service": ["tenant-a"]}},
    {"preemptions": 3},
    {"workers": [worker("d", steps_completed="many")]},
    {"workers": [worker("d", recent_batch_sizes=5)]},
    {"workers": [worker("d", recent_batch_sizes=["a"])]},
    {"workers": [worker(["d"])]},
    {"workers": [worker("d", heartbeat_age_s="1 s")]},
    {"workers": [worker("d", prefix_query_tokens="x")]},
    {"scheduler": {"service": [{"tenant": "t", "virtual_tokens": "x"}]}},
]


@pytest.mark.parametrize("body", ANOTHER_SERVERS_READY, ids=lambda body: str(body)[:40])
def test_a_ready_body_of_another_shape_is_an_error_not_a_traceback(body):
    """Another server's /ready (JSON, but not a tandem gateway's) raised from the frame's
    drawing: a traceback in place of the view, `--once` included."""
    got = top.fetch(mock_gateway(body=body), URL)
    assert got.error is not None and "not a tandem gateway?" in got.error
    assert "cannot reach" in render(Top(URL).frame(got))


def test_a_batch_job_of_another_shape_is_drawn_with_dashes():
    job = {"id": "batch_x", "status": "in_progress", "request_counts": [1, 2, 3]}
    assert "batch_x" in render(Top(URL).frame(Snapshot(0.0, ready=ready_body(), jobs=[job])))


def test_live_loop_draws_the_asked_number_of_frames():
    console = Console(file=io.StringIO(), width=100, color_system=None)
    client, sleeps = mock_gateway(), []
    status = top.live_loop(
        Top(URL, interval=0.5), lambda: top.fetch(client, URL), console, 3, sleep=sleeps.append
    )
    assert status == 0 and sleeps == [0.5, 0.5]
    assert "workers" in console.file.getvalue()


# ---- the command ----


def tandem_top(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.commands.cli", "top", *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--interval", "0"], "--interval: must be greater than 0, got 0"),
        (["--interval", "-1"], "--interval: must be greater than 0"),
        (["--interval", "soon"], "--interval: expected a number, got 'soon'"),
        (["--interval", "inf"], "--interval: must be greater than 0"),
        (["--iterations", "0"], "--iterations: must be greater than 0"),
        (["--iterations", "2.5"], "--iterations: expected an integer"),
        # An IPv6 host unbracketed ended in httpx.InvalidURL's traceback.
        (["--once", "--url", "http://::1:8000"], "--url: not a URL: 'http://::1:8000'"),
        (["--url", "http://::1:8000"], "an IPv6 host goes in brackets: http://[::1]:8000"),
        (["--once", "--url", "127.0.0.1:8000"], "--url: expected an http:// or https:// URL"),
    ],
)
def test_wrong_input_exits_2_naming_the_problem(argv, needle):
    result = tandem_top(*argv)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr
    assert "Traceback" not in result.stderr


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_once_against_nothing_exits_1_with_a_clear_error():
    url = f"http://127.0.0.1:{closed_port()}"
    result = tandem_top("--url", url, "--once")
    assert result.returncode == 1
    assert f"tandem top: cannot reach the gateway at {url}" in result.stderr
    assert "Traceback" not in result.stderr


def test_ctrl_c_exits_0_without_a_traceback():
    url = f"http://127.0.0.1:{closed_port()}"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "top", "--url", url, "--interval", "0.2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "COLUMNS": "100"},
    )
    time.sleep(4)  # imports, then a few frames
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=30)
    assert process.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "cannot reach the gateway" in stdout


def test_a_counter_missing_from_both_snapshots_has_no_rate_rather_than_zero():
    """With no prefill worker's series in /metrics (none scraped: their scrapes failed, or
    none is up), `prefilled` showed 0.0 tokens/s, as if the cluster were idle; it is unknown."""
    only_generated = (
        "# TYPE tandem:generation_tokens_total counter\n"
        'tandem:generation_tokens_total{peer="gateway-1"} %d\n'
    )
    body = ready_body()
    first = Snapshot(10.0, ready=body, counters=top.parse_counters(only_generated % 100))
    second = Snapshot(12.0, ready=body, counters=top.parse_counters(only_generated % 160))
    rates = top.token_rates(first, second)
    assert rates == {top.GENERATED: 30.0, top.PREFILLED: None}
    header = render(top.render_header(URL, body, rates))
    assert "generated 30.0" in header and f"prefilled {top.MISSING}" in header
    # A series that came and went is no reading either: a new peer's first frame, say.
    moved = Snapshot(14.0, ready=body, counters=top.parse_counters(metrics_text(200, 5)))
    assert top.token_rates(second, moved)[top.PREFILLED] is None


@pytest.mark.parametrize("data", [None, 5, "jobs", {"id": "batch_1"}])
def test_batches_whose_data_is_not_a_list_are_a_note_not_a_traceback(data):
    """Another server's /v1/batches answering `data` that is no list (null, a number) raised
    TypeError out of `fetch`: `tandem top` ended with a traceback instead of drawing the
    cluster; a string or an object was taken for its characters or keys, shown as no jobs."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/ready":
            return httpx.Response(200, json=ready_body())
        if request.url.path == "/v1/batches":
            return httpx.Response(200, json={"object": "list", "data": data})
        return httpx.Response(200, text=metrics_text(42, 7))

    got = top.fetch(httpx.Client(transport=httpx.MockTransport(handle)), URL, api_key="k")
    assert got.error is None and got.jobs is None
    assert "without a list" in got.jobs_note
