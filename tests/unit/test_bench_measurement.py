"""What `tandem bench` and the race measure, against a small fake OpenAI SSE server on
127.0.0.1 (in a thread, so the bench's own event loops can run): fresh prompts for every run of a
sweep and the cached tokens the server reports, identical bodies for the race's two servers, the
send time taken on the wire with the schedule beside it, failures beside the percentiles, which
chunks count as tokens, per-class random streams, and plots that draw no failure as fast."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from loadtest import bench, client, plots, race
from loadtest.bench import compare_table
from loadtest.client import carries_output, run_workload
from loadtest.fairness_bench import Traffic, print_flood, ttft_figures
from loadtest.fairness_bench import parse_args as fairness_args
from loadtest.generators import generate, prompt_nonce, with_prompt_nonce
from loadtest.metrics import RequestRecord, Summary, beyond_successes, summarize
from loadtest.summary_text import client_warnings, format_summary
from loadtest.workload import WorkloadRequest, write_workload
from tests.unit.test_loadtest import CharTokenizer

BLOCK = 16  # the fake's prefix cache works in blocks of this many prompt tokens


@dataclass
class FakeSSE:
    """An OpenAI `/v1/completions` stub: the first token after `ttft_s` (or `slow_ttft_s` for a
    prompt whose first id is in `slow_ids`), then one chunk per token `gap_s` apart, then the
    usage. With `prefix_cache`, prompts are remembered in 16-token blocks and the usage reports
    the leading blocks seen before as `cached_tokens`. With `llama_final`, the stream ends as
    llama.cpp's does: a chunk with empty text, the finish reason and the usage. Every body is
    kept with the time it arrived."""

    ttft_s: float = 0.0
    gap_s: float = 0.0
    prefix_cache: bool = False
    llama_final: bool = False
    slow_ids: frozenset[int] = frozenset()
    slow_ttft_s: float = 0.0
    bodies: list[dict] = field(default_factory=list)
    seen_blocks: set[tuple[int, ...]] = field(default_factory=set)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
            lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")]  # fmt: skip
            if not lengths:  # GET /ready: not tandem
                writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                return
            body = json.loads(await reader.readexactly(lengths[0]))
            self.bodies.append(body)
            await self.answer(body, writer)
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # a client gone, or the server stopping (its answer ends quietly)
        finally:
            writer.close()

    def cached(self, prompt: list[int]) -> int:
        blocks = [tuple(prompt[: i + BLOCK]) for i in range(0, len(prompt) // BLOCK * BLOCK, BLOCK)]
        hits = 0
        while hits < len(blocks) and blocks[hits] in self.seen_blocks:
            hits += 1
        self.seen_blocks.update(blocks)
        return hits * BLOCK

    async def answer(self, body: dict, writer: asyncio.StreamWriter) -> None:
        prompt, num_tokens = body["prompt"], body["max_tokens"]
        cached = self.cached(prompt) if self.prefix_cache else 0
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n")
        await asyncio.sleep(self.slow_ttft_s if prompt[0] in self.slow_ids else self.ttft_s)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(self.gap_s)
            finish = "length" if i == num_tokens - 1 and not self.llama_final else None
            writer.write(sse({"choices": [{"index": 0, "text": f"t{i}", "finish_reason": finish}]}))
            await writer.drain()
        usage = {"prompt_tokens": len(prompt), "completion_tokens": num_tokens,
                 "prompt_tokens_details": {"cached_tokens": cached}}  # fmt: skip
        choices = [{"index": 0, "text": "", "finish_reason": "length"}] if self.llama_final else []
        writer.write(sse({"choices": choices, "usage": usage}) + b"data: [DONE]\n\n")
        await writer.drain()


def sse(event: dict) -> bytes:
    return b"data: " + json.dumps(event).encode() + b"\n\n"


@contextlib.contextmanager
def serving(fake: FakeSSE) -> Iterator[str]:
    """Runs the fake in its own thread's event loop; yields its base URL."""
    loop = asyncio.new_event_loop()
    started = threading.Event()
    holder: dict = {}

    async def start() -> None:
        holder["server"] = await asyncio.start_server(fake.handle, "127.0.0.1", 0, backlog=256)
        started.set()

    def run() -> None:
        loop.run_until_complete(start())
        loop.run_forever()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert started.wait(10)

    async def stop() -> None:  # cancels the answers still running (a request that timed out)
        holder["server"].close()
        answers = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for answer in answers:
            answer.cancel()
        await asyncio.gather(*answers, return_exceptions=True)

    try:
        yield f"http://127.0.0.1:{holder['server'].sockets[0].getsockname()[1]}"
    finally:
        asyncio.run_coroutine_threadsafe(stop(), loop).result(10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def token_requests(num: int, prompt_len: int = 48, max_tokens: int = 2) -> list[WorkloadRequest]:
    """Distinct prompts of ids; ids start at 100, so the first picks a request."""
    return [
        WorkloadRequest(
            f"prompt {i}",
            max_tokens,
            0.0,
            [100 + i] + [1000 + i * 97 + j for j in range(prompt_len - 1)],
        )  # fmt: skip
        for i in range(num)
    ]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


# --- 1. a sweep's later rates do not find the earlier rates' prompts in the cache --------------


def sweep(tmp_path, *extra: str) -> tuple[dict, FakeSSE]:
    workload = tmp_path / "w.jsonl"
    requests = token_requests(8)
    write_workload(workload, requests)
    fake = FakeSSE(prefix_cache=True)
    with serving(fake) as url:
        argv = ["--url", url, "--workload", str(workload), "--sweep", "200,200", "--no-plots",
                "--out", str(tmp_path / "out"), *extra]  # fmt: skip
        assert bench.run(parse(*argv)) == 0
    return json.loads((tmp_path / "out" / "result.json").read_text()), fake


def test_each_rate_of_a_sweep_sends_prompts_the_server_has_not_seen(tmp_path):
    result, fake = sweep(tmp_path, "--warmup", "0")  # (the warm-up's bodies: below)
    first, second = result["runs"]
    for run in result["runs"]:
        assert run["summary"]["cache_hit_share"] == 0.0
        assert [r["cached_tokens"] for r in run["records"]] == [0] * 8
        assert all(r["num_prompt_tokens"] == 48 + 4 for r in run["records"])
    nonces = [run["prompt_nonce"]["token_ids"] for run in result["runs"]]
    assert len(nonces[0]) == 4 and nonces[0] != nonces[1]
    # One nonce for a whole run, ahead of the prompt as the workload holds it.
    sent = Counter(tuple(body["prompt"][:4]) for body in fake.bodies)
    assert sent == {tuple(nonces[0]): 8, tuple(nonces[1]): 8}
    assert sorted(body["prompt"][4:] for body in fake.bodies[:8]) == sorted(
        r.prompt_token_ids for r in token_requests(8)
    )
    assert "prompt cache: 0.0%" in bench.describe_run(second)


def test_reuse_prompts_lets_the_second_rate_hit_the_cache_and_says_so(tmp_path):
    result, _ = sweep(tmp_path, "--reuse-prompts")
    first, second = (run["summary"] for run in result["runs"])
    assert first["cache_hit_share"] == 0.0
    assert second["cache_hit_share"] == 1.0 and second["cached_prompt_tokens"] == 8 * 48
    assert result["runs"][1]["prompt_nonce"] is None and result["reuse_prompts"] is True


def test_a_nonce_goes_ahead_of_ids_and_text_alike():
    requests = [*token_requests(3), WorkloadRequest("only text here", 2, 0.0)]
    nonce = prompt_nonce(requests)
    assert set(nonce.token_ids) <= {t for r in requests[:3] for t in r.prompt_token_ids}
    assert len(nonce.text.split()) == 4
    fresh = with_prompt_nonce(requests, nonce)
    assert all(r.prompt == nonce.text + old.prompt for r, old in zip(fresh, requests, strict=True))
    assert fresh[0].prompt_token_ids == nonce.token_ids + requests[0].prompt_token_ids
    assert fresh[3].prompt_token_ids is None
    assert prompt_nonce(requests) != nonce  # fresh randomness every run


def test_a_nonce_goes_after_the_bos_every_prompt_starts_with():
    """Recorded traffic starts each prompt with its BOS: the nonce went ahead of it (and could
    be drawn from it), which no real prompt does."""
    requests = [WorkloadRequest("", 2, 0.0, prompt_token_ids=[1, 40 + i, 50, 60]) for i in range(3)]
    nonce = prompt_nonce(requests)
    assert 1 not in nonce.token_ids
    fresh = with_prompt_nonce(requests, nonce)
    assert fresh[0].prompt_token_ids == [1, *nonce.token_ids, 40, 50, 60]
    unlike = [*requests, WorkloadRequest("", 2, 0.0, prompt_token_ids=[7, 8])]
    assert with_prompt_nonce(unlike, nonce)[3].prompt_token_ids == [*nonce.token_ids, 7, 8]


def test_the_race_sends_both_servers_the_same_bodies():
    requests = token_requests(6)
    sent = []
    for _ in range(2):
        fake = FakeSSE()
        with serving(fake) as url:
            result = race.burst(url, "smollm2", requests, "server")
        assert result.summary.num_errors == 0
        sent.append(sorted(fake.bodies, key=lambda body: body["prompt"]))
    assert sent[0] == sent[1]
    assert [body["prompt"] for body in sent[0]] == [r.prompt_token_ids for r in requests]


# --- 2. the client's own work in a burst is not the server's TTFT ------------------------------


def test_client_work_in_a_burst_shows_as_lateness_not_as_ttft(monkeypatch):
    """Building each body takes 60 ms of the client's event loop: before the fix the first
    request's TTFT included the other five's 300 ms, against a server that answers at once."""
    build = client.request_body

    def slow_build(*args, **kwargs):
        time.sleep(0.06)
        return build(*args, **kwargs)

    monkeypatch.setattr(client, "request_body", slow_build)
    with serving(FakeSSE()) as url:
        result = asyncio.run(run_workload(url, "m", token_requests(6), honor_arrivals=False))
    records = result.records
    assert all(r.ok for r in records)
    assert max(r.ttft for r in records) < 0.15
    assert len({r.scheduled_time for r in records}) == 1  # a burst: all due at its start
    assert result.summary.lateness_max >= 0.25  # the client's work, where it belongs
    assert client_warnings(result.summary)


# --- 4. open-loop arrivals: the schedule is kept beside the send ------------------------------


def test_a_client_that_falls_behind_its_schedule_is_reported_and_warned():
    """The first request's completion blocks the client's loop for 0.5 s; the others were due
    at 0.3 s and go out late."""
    requests = [WorkloadRequest("x", 1, 0.0, [100, 5])]
    requests += [WorkloadRequest("x", 1, 0.3 + 0.01 * i, [101 + i, 5]) for i in range(5)]
    blocked = []

    def on_done(record: RequestRecord) -> None:
        if not blocked:
            blocked.append(record.index)
            time.sleep(0.5)

    with serving(FakeSSE()) as url:
        result = asyncio.run(run_workload(url, "m", requests, on_done=on_done))
    records, s = result.records, result.summary
    start = records[0].scheduled_time
    for record, request in zip(records, requests, strict=True):
        assert record.scheduled_time == pytest.approx(start + request.arrival_time)
    assert min(r.lateness for r in records[1:]) >= 0.1
    assert s.lateness_max >= 0.1 and s.lateness_p99 > 0.01 and s.lateness_n == 6
    assert all(r.ttft < r.lateness for r in records[1:])  # lateness is not charged to TTFT
    text = format_summary(s)
    assert "send lateness ms" in text and "WARNING: the client fell behind" in text
    assert client_warnings(summarize(records[:1])) == []


def test_arrival_times_count_from_the_first_so_a_log_of_unix_timestamps_replays():
    """A production log's arrival times are Unix timestamps: the client slept until start +
    1.7e9 s (decades), or every request was cancelled at the deadline."""
    epoch = 1.7e9
    requests = [WorkloadRequest("x", 1, epoch + 0.05 * i, [100 + i, 5]) for i in range(3)]
    with serving(FakeSSE()) as url:
        result = asyncio.run(run_workload(url, "m", requests, deadline_s=5.0))
    records = result.records
    assert all(r.ok for r in records), [r.error for r in records]
    start = records[0].scheduled_time
    for record, request in zip(records, requests, strict=True):
        due = start + (request.arrival_time - epoch)
        assert record.scheduled_time == pytest.approx(due, abs=1e-6)


# --- 3 and 8. failures beside the percentiles, and the samples behind them ---------------------


def ok_record(index: int, ttft: float, finish: float = 1.0) -> RequestRecord:
    return RequestRecord(index, 4, 10, 0.0, ttft, finish, [ttft, finish], 4)


def failed_record(index: int) -> RequestRecord:
    return RequestRecord(index, 4, 10, 0.0, None, None, [], None, "timed out after 2 s")


def test_a_percentile_a_failure_would_hold_is_flagged_with_the_counts():
    """95 answered within 0.1-0.19 s, 5 timed out: p99 over the successes says 0.19 s, but
    the true p99 is a timed-out request's."""
    records = [ok_record(i, 0.1 + 0.001 * i) for i in range(95)]
    records += [failed_record(95 + i) for i in range(5)]
    s = summarize(records)
    assert (s.num_errors, s.error_share, s.ttft_n, s.e2e_n, s.tpot_n) == (5, 0.05, 95, 95, 95)
    assert "ttft_p99" in s.unknown_percentiles and "e2e_p99" in s.unknown_percentiles
    assert "ttft_p90" not in s.unknown_percentiles and "ttft_p50" not in s.unknown_percentiles
    assert s.ttft_p99 == pytest.approx(0.1 + 0.001 * 93.06)  # still there, over the successes
    text = format_summary(s)
    assert "TTFT ms p50 147 p90 185 p99 n/a (n=95)" in text
    assert "5 of 100 requests failed" in text and "ttft_p99 193" in text
    run = {"summary": s.to_dict()}
    table = compare_table([("a", run), ("b", {"summary": summarize(records[:95]).to_dict()})])
    rows = {line[:16].strip(): line[16:].split() for line in table.splitlines()}
    assert " ".join(rows["TTFT p99 ms"]) == "n/a: 5% failed 193"
    assert rows["failed"] == ["5.0%", "0.0%"] and rows["TTFT n"] == ["95", "95"]


def test_a_server_that_sheds_load_does_not_look_faster():
    served = [ok_record(i, 0.05) for i in range(8)]
    shed = [RequestRecord(8 + i, 4, 10, 0.0, None, 0.01, [], None, "HTTP 429: overloaded")
            for i in range(56)]  # fmt: skip
    s = summarize(served + shed)
    assert {"ttft_p50", "ttft_p90", "ttft_p99", "e2e_p50"} <= set(s.unknown_percentiles)
    table = race.race_table({"shedding": race.Result("shedding", s, served + shed)})
    row = table.splitlines()[2].split()
    assert row[5:8] == ["n/a/n/a", "n/a/n/a", "87.5%"]
    assert "56 of 64 failed" in table


def test_requests_that_time_out_do_not_vanish_from_the_tail():
    """2 of 20 requests would take 30 s, the timeout is 3 s: p90 and p99 are theirs. (The
    others answer at once: the margin is for a loaded machine, where 0.5 s failed them all.)"""
    requests = token_requests(20)
    fake = FakeSSE(ttft_s=0.01, slow_ids=frozenset({100, 101}), slow_ttft_s=30.0)
    with serving(fake) as url:
        result = asyncio.run(run_workload(url, "m", requests, timeout_s=3.0))
    s = result.summary
    errors = sorted({str(r.error) for r in result.records if r.error})
    assert (s.num_errors, s.ttft_n) == (2, 18), errors
    assert {"ttft_p90", "ttft_p99"} <= set(s.unknown_percentiles)
    assert "ttft_p50" not in s.unknown_percentiles
    assert "TTFT ms p50 " in format_summary(s) and " p90 n/a p99 n/a (n=18)" in format_summary(s)


def test_rank_rule_for_a_failures_percentile():
    assert not beyond_successes(100, 0, 99)
    assert beyond_successes(0, 3, 50)  # all failed
    assert beyond_successes(63, 1, 99) and not beyond_successes(63, 1, 90)
    assert not beyond_successes(999, 1, 99)
    assert beyond_successes(18, 2, 90) and not beyond_successes(18, 2, 50)


def test_an_older_result_without_counts_is_still_flagged():
    old = summarize([ok_record(i, 0.1) for i in range(9)] + [failed_record(9)]).to_dict()
    for key in ("ttft_n", "tpot_n", "e2e_n", "itl_n", "unknown_percentiles", "error_share"):
        del old[key]
    summary = Summary.from_dict(old)
    assert summary.unknown("ttft_p99") and not summary.unknown("ttft_p50")
    rows = {line[:16].strip(): line[16:].strip() for line in compare_table(
        [("old", {"summary": old}), ("new", {"summary": old})]).splitlines()}  # fmt: skip
    assert rows["failed"].split() == ["10.0%", "10.0%"]
    assert rows["TTFT n"].split() == ["-", "-"]


def test_fairness_reports_the_samples_behind_p99_and_its_failures(capsys):
    traffic = Traffic()
    for i in range(19):
        traffic.add("short", ok_record(i, 0.1 + 0.01 * i))
    traffic.add("short", failed_record(19))
    figures = ttft_figures(traffic, "short")
    assert figures["short_requests"] == 19 and figures["short_failed"] == 1
    assert figures["short_ttft_p99_unknown"] is True
    row = {**figures, "long_requests": 3, "long_ttft_max_s": 9.0, "max_queue_wait_s": 2.0,
           "errors": 1, "short_p99_over_alone": None}  # fmt: skip
    print_flood({"fair": row}, aging_s=30.0)
    out = capsys.readouterr().out
    assert "shorts n" in out and "n/a" in out.splitlines()[1]
    assert "p99 of n <= 101 shorts (here as few as 19)" in out


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["tenants", "--duration", "10", "--warmup", "15"], "--warmup"),  # an empty window
        (["tenants", "--warmup", "-1"], "--warmup"),
        (["tenants", "--light-rate", "0"], "--light-rate"),  # 1 / rate
        (["flood", "--short-interval", "0"], "--short-interval"),  # a task per loop, unpaced
        (["flood", "--duration", "nan"], "--duration"),
    ],
)
def test_fairness_refuses_settings_that_measure_nothing_naming_the_flag(argv, flag, capsys):
    with pytest.raises(SystemExit):
        fairness_args(argv)
    assert flag in capsys.readouterr().err
    assert fairness_args(["tenants", "--duration", "20", "--warmup", "5"]).warmup == 5


# --- 6. which chunks are tokens ----------------------------------------------------------------


def test_llama_cpps_last_chunk_is_no_token():
    requests = token_requests(4, max_tokens=4)
    for llama_final in (True, False):
        with serving(FakeSSE(ttft_s=0.01, gap_s=0.03, llama_final=llama_final)) as url:
            result = asyncio.run(run_workload(url, "m", requests))
        for record in result.records:
            assert record.ok and len(record.chunk_times) == 4 and len(record.chunk_gaps) == 3
            assert min(record.chunk_gaps) > 0.01  # no ~0 ms gap from the final chunk
        assert result.summary.itl_n == 12
        assert [record.cached_tokens for record in result.records] == [0] * 4


def test_what_carries_output():
    assert carries_output({"choices": [{"text": "a", "finish_reason": None}]})
    assert not carries_output({"choices": [{"text": "", "finish_reason": "length"}]})
    assert not carries_output({"choices": [], "usage": {"completion_tokens": 3}})
    assert carries_output({"choices": [{"delta": {"content": "b"}}]})
    assert not carries_output({"choices": [{"delta": {"role": "assistant", "content": ""}}]})
    assert carries_output({"choices": [{"text": "", "logprobs": {"tokens": ["\ufffd"]}}]})


# --- 5. the mix's classes do not share prompt starts -------------------------------------------


def test_the_mix_classes_draw_their_prompts_from_their_own_streams():
    mix = generate(CharTokenizer(), "mix", 60, seed=0)
    by_class: dict[str, list[list[int]]] = {}
    for request in mix:
        by_class.setdefault(request.label, []).append(request.prompt_token_ids[:BLOCK])
    assert set(by_class) == {"chat", "long", "bulk"}
    for other in ("long", "bulk"):
        pairs = list(zip(by_class["chat"], by_class[other], strict=False))
        same = sum(a == b for a, b in pairs)
        assert same <= len(pairs) // 4, (other, same, len(pairs))  # was every pair
    assert mix == generate(CharTokenizer(), "mix", 60, seed=0)


# --- 7. plots draw no failure as fast ----------------------------------------------------------


def plotted(monkeypatch) -> list:
    figures = []
    monkeypatch.setattr(plots, "_save", lambda figure, path: figures.append(figure) or path)
    return figures


def as_run(records: list[RequestRecord], rate: float | None = None) -> dict:
    return {"rate": rate, "summary": summarize(records).to_dict(),
            "records": [r.to_dict() for r in records]}  # fmt: skip


def test_compare_plot_leaves_a_failed_runs_percentiles_out_and_its_cdf_empty(monkeypatch):
    figures = plotted(monkeypatch)
    good = [ok_record(i, 0.2) for i in range(4)]
    failed = [RequestRecord(i, 8, 10, 0.0, 9.0, None, [9.0], None, "timed out") for i in range(4)]
    plots.compare([("A", as_run(good)), ("B", as_run(failed))], "unused.png")
    axes = figures[0].axes
    for axis in axes[1:3]:  # TTFT and TPOT bars: A's drawn, B's marked n/a
        heights = [bar.get_height() for bar in axis.patches]
        assert heights and all(h > 0 for h in heights) and len(heights) == 2
        assert [t.get_text() for t in axis.texts] == ["n/a", "n/a"]
    (line,) = axes[3].lines  # B's CDF has no values: its TTFT came from a failed request
    assert line.get_label() == "A (n=4)"


def test_latency_cdfs_end_at_the_success_share_and_sweep_leaves_out_unknowns(monkeypatch):
    figures = plotted(monkeypatch)
    records = [ok_record(i, 0.1 * (i + 1)) for i in range(6)] + [failed_record(6), failed_record(7)]
    plots.latency_cdfs(as_run(records), "unused.png")
    ttft_line = figures[0].axes[0].lines[0]
    assert ttft_line.get_label() == "all (n=6, 2 failed)"
    assert max(ttft_line.get_ydata()) == pytest.approx(0.75)
    plots.sweep({"runs": [as_run(records, 1.0), as_run(records[:6], 2.0)]}, "unused.png")
    right = figures[1].axes[1]
    p99 = next(line for line in right.lines if line.get_label() == "ttft p99")
    values = list(p99.get_ydata())
    assert math.isnan(values[0]) and values[1] == pytest.approx(1e3 * (0.5 + 0.95 * 0.1))


# --- a warm-up before the measured runs -----------------------------------------------------


def test_a_warm_up_goes_first_unmeasured_and_warms_no_measured_prompt(tmp_path, capsys):
    """The first requests paid the server's cold start (first allocations and compiles) in
    their TTFT: a few requests now go before the runs, in no record, under a nonce of their
    own (so the measured prompts find nothing of theirs in a prefix cache)."""
    workload = tmp_path / "w.jsonl"
    write_workload(workload, token_requests(8, max_tokens=40))
    fake = FakeSSE(prefix_cache=True)
    with serving(fake) as url:
        argv = ["--url", url, "--workload", str(workload), "--burst", "--no-plots",
                "--out", str(tmp_path / "out"), "--reuse-prompts"]  # fmt: skip
        assert bench.run(parse(*argv)) == 0
    result = json.loads((tmp_path / "out" / "result.json").read_text())
    (run,) = result["runs"]
    assert result["warmup"]["requests"] == 2 and result["warmup"]["errors"] == 0
    assert len(fake.bodies) == 2 + 8 and len(run["records"]) == 8
    warm, measured = fake.bodies[:2], fake.bodies[2:]
    assert all(body["max_tokens"] <= bench.WARMUP_MAX_TOKENS for body in warm)
    workload_prompts = [r.prompt_token_ids for r in token_requests(8)]
    assert sorted(body["prompt"] for body in measured) == sorted(workload_prompts)
    assert all(body["prompt"] not in workload_prompts for body in warm)
    assert run["summary"]["cache_hit_share"] == 0.0
    assert "warm-up: 2 requests, not measured" in capsys.readouterr().out


def test_warm_up_0_sends_none(tmp_path):
    result, fake = sweep(tmp_path, "--warmup", "0")
    assert len(fake.bodies) == 16 and result["warmup"] is None
