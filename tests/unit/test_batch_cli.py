"""`tandem batch`: wrong arguments get a clear error before anything is sent."""

from __future__ import annotations

import httpx
import pytest

from services.commands.cli import main


def test_submit_of_a_missing_file_says_so(tmp_path):
    with pytest.raises(SystemExit, match="no such file"):
        main(["batch", "--url", "http://127.0.0.1:9", "submit", str(tmp_path / "none.jsonl")])


def test_submit_without_an_endpoint_anywhere_asks_for_one(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"custom_id": "a", "url": "/v1/embeddings"}\n')
    with pytest.raises(SystemExit, match="--endpoint"):
        main(["batch", "--url", "http://127.0.0.1:9", "submit", str(path)])


def test_an_unknown_endpoint_or_action_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["batch", "submit", "x.jsonl", "--endpoint", "/v1/embeddings"])
    assert "invalid choice" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["batch", "explode"])


def test_batch_bench_refuses_wrong_values_and_builds_distinct_prompts(capsys):
    from loadtest import batch_bench

    with pytest.raises(SystemExit):
        batch_bench.main(["--num-prompts", "0"])
    assert "must be positive" in capsys.readouterr().err
    assert len(set(batch_bench.prompts(50, "batch"))) == 50
    assert batch_bench.percentile([3.0, 1.0, 2.0], 0.5) == 2.0
    assert batch_bench.percentile([], 0.99) is None


def test_following_a_batch_midway_counts_its_rates_from_the_first_poll(monkeypatch, capsys):
    """The progress line's lines/s and tokens/s count what was done while it watched, not what
    the batch did before `--wait` began following it."""
    import httpx

    from services.commands import batch as batch_command

    polls = iter(
        [(100, 5_000, "in_progress"), (110, 5_400, "in_progress"), (120, 5_800, "completed")]
    )

    def answer(request: httpx.Request) -> httpx.Response:
        done, output_tokens, status = next(polls)
        counts = {"total": 200, "completed": done, "failed": 0}
        body = {
            "status": status,
            "request_counts": counts,
            "usage": {"output_tokens": output_tokens},
        }
        return httpx.Response(200, json=body)

    clock = iter([50.0, 51.0, 52.0])  # the follower began long after the batch did
    monkeypatch.setattr(batch_command.time, "monotonic", lambda: next(clock))
    monkeypatch.setattr(batch_command.time, "sleep", lambda _: None)
    api = batch_command.Api("http://tandem.test", None)
    api.http = httpx.Client(base_url="http://tandem.test/v1", transport=httpx.MockTransport(answer))
    assert batch_command.follow(api, "batch_1")["status"] == "completed"
    lines = capsys.readouterr().err.split("\r")
    assert "100/200 done" in lines[1] and "0.0 lines/s" in lines[1] and "tokens/s" not in lines[1]
    assert "10.0 lines/s  400 tokens/s  ETA 9 s" in lines[2]
    assert "10.0 lines/s  400 tokens/s   " in lines[3] and "ETA" not in lines[3]  # it ended


def test_an_ended_batch_shows_its_own_rate_not_an_eta(monkeypatch, capsys):
    """A job that ended before a second poll said `0.0 lines/s  ETA ?` on its last line; it
    now says its rate over its run, by its own timestamps."""
    counts = {"total": 4, "completed": 4, "failed": 0}
    ended = {"status": "completed", "request_counts": counts, "in_progress_at": 1_000,
             "completed_at": 1_002}  # fmt: skip
    batch_command, api, _ = played_api([httpx.Response(200, json=ended)], monkeypatch)
    batch_command.follow(api, "batch_1")
    last = capsys.readouterr().err.split("\r")[-1]
    assert "completed   4/4 done (0 failed)  2.0 lines/s" in last and "ETA" not in last


def test_a_server_that_is_not_there_is_an_error_not_a_traceback():
    with pytest.raises(SystemExit, match="tandem batch: GET /v1/batches"):
        main(["batch", "--url", "http://127.0.0.1:9", "list"])


@pytest.mark.parametrize("url", ["http://::1:8000", "127.0.0.1:8000", "ftp://127.0.0.1"])
def test_a_url_httpx_cannot_request_is_refused_by_name(url, capsys):
    """An unbracketed IPv6 host raised httpx's InvalidURL, a traceback, from the client's
    construction (as `tandem top --url` once did)."""
    with pytest.raises(SystemExit) as exit_info:
        main(["batch", "--url", url, "list"])
    assert exit_info.value.code == 2
    assert "argument --url" in capsys.readouterr().err


def test_a_download_the_server_refuses_writes_no_output(tmp_path):
    """The file's content was streamed to the output whatever its status: a 404's error body
    became the batch's answers, and the command said nothing was wrong."""
    import argparse

    import httpx

    from services.commands import batch as batch_command

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/content"):
            return httpx.Response(404, json={"error": {"message": "no such file"}})
        return httpx.Response(200, json={"status": "completed", "output_file_id": "file-1o"})

    api = batch_command.Api("http://tandem.test", None)
    api.http = httpx.Client(base_url="http://tandem.test/v1", transport=httpx.MockTransport(answer))
    out = tmp_path / "answers.jsonl"
    args = argparse.Namespace(batch_id="batch_1", errors=False, out=out)
    with pytest.raises(SystemExit, match="404 no such file"):
        batch_command.download(api, args)
    assert not out.exists()


def played_api(answers: list[httpx.Response], monkeypatch) -> tuple:
    """An Api whose server answers `answers` in turn, on a clock that only sleeps move."""
    from services.commands import batch as batch_command

    clock, slept = [0.0], []

    def sleep(seconds: float) -> None:
        slept.append(seconds)
        clock[0] += seconds

    monkeypatch.setattr(batch_command.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(batch_command.time, "sleep", sleep)
    replies = iter(answers)
    api = batch_command.Api("http://tandem.test", None)
    transport = httpx.MockTransport(lambda request: next(replies))
    api.http = httpx.Client(base_url="http://tandem.test/v1", transport=transport)
    return batch_command, api, slept


def refused(status: int, retry_after: str | None = None) -> httpx.Response:
    headers = {"Retry-After": retry_after} if retry_after is not None else {}
    return httpx.Response(status, json={"error": {"message": "busy"}}, headers=headers)


def batch_now(status: str) -> httpx.Response:
    counts = {"total": 2, "completed": 2 if status == "completed" else 0, "failed": 0}
    return httpx.Response(200, json={"status": status, "request_counts": counts})


def test_following_waits_out_503_and_429_as_retry_after_asks(monkeypatch):
    """One 503 while the batch service restarted (or one 429) ended `submit --wait` with exit
    status 1, though the job went on."""
    answers = [batch_now("in_progress"), refused(503, "5"), refused(429), refused(503, "soon"),
               refused(429, "2"), batch_now("completed")]  # fmt: skip
    batch_command, api, slept = played_api(answers, monkeypatch)
    assert batch_command.follow(api, "batch_1")["status"] == "completed"
    assert slept == [1.0, 5.0, 2.0, 4.0, 2.0]  # the poll interval; Retry-After, else 1 s doubling


@pytest.mark.parametrize(
    "answers, message",
    [
        ([refused(500)], "500 busy"),  # other statuses: at once
        ([refused(404)], "404 busy"),
        ([refused(503, "100")] * 4, "503 busy"),  # refused past MAX_REFUSED_S in a row
    ],
)
def test_following_gives_up_on_other_statuses_and_on_refusals_that_last(
    monkeypatch, answers, message
):
    batch_command, api, slept = played_api(answers, monkeypatch)
    with pytest.raises(SystemExit, match=message):
        batch_command.follow(api, "batch_1")
    assert sum(slept) <= batch_command.MAX_REFUSED_S


def test_submit_and_wait_says_why_a_batch_failed(tmp_path, monkeypatch, capsys):
    """A batch whose input failed validation ended `submit --wait` with status 1 and a progress
    line of 0/0 done: nothing said which lines were wrong, nor how."""
    import argparse

    errors = {"object": "list", "data": [
        {"code": "duplicate_custom_id", "message": "this custom_id appears on an earlier line",
         "param": "custom_id", "line": 3},
        {"code": "empty_file", "message": "the input file has no requests", "param": None,
         "line": None},
    ]}  # fmt: skip
    counts = {"total": 0, "completed": 0, "failed": 0}
    answers = [
        httpx.Response(200, json={"id": "file-1"}),
        httpx.Response(200, json={"id": "batch_1", "status": "validating"}),
        httpx.Response(200, json={"status": "failed", "request_counts": counts, "errors": errors}),
    ]
    batch_command, api, _ = played_api(answers, monkeypatch)
    path = tmp_path / "in.jsonl"
    path.write_text('{"url": "/v1/completions"}\n')
    args = argparse.Namespace(file=path, endpoint=None, completion_window="24h", wait=True)
    assert batch_command.submit(api, args) == 1
    err = capsys.readouterr().err
    assert "line 3: this custom_id appears on an earlier line (duplicate_custom_id)" in err
    assert "the input file has no requests (empty_file)" in err


def test_a_server_on_this_machine_is_asked_directly_when_a_proxy_is_set(monkeypatch, capsys):
    """`http_proxy` sent the default `--url http://127.0.0.1:8000` to a proxy, which cannot
    reach this machine's loopback: every action failed, where `tandem top` and `tandem up`'s
    ready check ask a local gateway directly."""
    import http.server
    import json
    import threading

    class BatchServer(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the base class's name
            body = json.dumps({"data": []}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), BatchServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        for name in ("http_proxy", "HTTP_PROXY"):
            monkeypatch.setenv(name, "http://127.0.0.1:9")  # (the discard port: no one)
        for name in ("no_proxy", "NO_PROXY"):
            monkeypatch.delenv(name, raising=False)
        url = f"http://localhost:{server.server_address[1]}"
        assert main(["batch", "--url", url, "list"]) == 0
    finally:
        server.shutdown()


def test_ctrl_c_while_following_leaves_the_batch_running_without_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """Ctrl-C to stop watching a `submit --wait` printed KeyboardInterrupt's traceback, and
    said nothing of the batch, which goes on: as if it had been cancelled, or had crashed."""
    import argparse

    answers = [
        httpx.Response(200, json={"id": "file-1"}),
        httpx.Response(200, json={"id": "batch_1", "status": "validating"}),
        batch_now("in_progress"),
    ]
    batch_command, api, _ = played_api(answers, monkeypatch)

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(batch_command.time, "sleep", interrupted)
    path = tmp_path / "in.jsonl"
    path.write_text('{"url": "/v1/completions"}\n')
    args = argparse.Namespace(file=path, endpoint=None, completion_window="24h", wait=True)
    assert batch_command.submit(api, args) == 130
    err = capsys.readouterr().err
    assert "batch_1 goes on" in err and "tandem batch cancel batch_1" in err
