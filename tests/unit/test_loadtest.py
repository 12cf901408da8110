"""Tests of the load-test tools without a model: workload generation (with a character-level
fake tokenizer), the latency and throughput math on hand-made records, the client against a fake
OpenAI streaming server in the same event loop, and the baselines' pure helpers."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loadtest.baselines import StepTimes, _record_step, left_pad
from loadtest.client import run_workload
from loadtest.metrics import Clock, RequestRecord, percentile, summarize
from loadtest.served import free_port
from loadtest.workload import (
    CORPUS_PATH,
    WorkloadRequest,
    arrival_times,
    build_workload,
    long_tailed_lengths,
    read_workload,
    stream,
    write_workload,
)
from services.gateway.openai_shapes import SSE_DONE, completion_chunk, sse_event, usage_chunk
from shared.engine.engine import RequestOutput

MIXED64 = Path(__file__).resolve().parents[2] / "loadtest" / "workloads" / "mixed64.jsonl"


# --- workload ----------------------------------------------------------------------------------


class CharTokenizer:
    """One token per character, with the transformers calls the workload builder uses."""

    def __call__(self, text, add_special_tokens=False, return_offsets_mapping=False):
        return {
            "input_ids": self.encode(text),
            "offset_mapping": [(i, i + 1) for i in range(len(text))],
        }

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i) for i in ids)


def small_workload(seed: int = 0, rate: float | None = None) -> list[WorkloadRequest]:
    return build_workload(CharTokenizer(), num=32, seed=seed, rate=rate)


def test_workload_is_deterministic_for_a_seed():
    assert small_workload(0) == small_workload(0)
    assert small_workload(0) != small_workload(1)


def test_rate_changes_only_the_arrival_times():
    burst, poisson = small_workload(0), small_workload(0, rate=4.0)
    assert all(r.arrival_time == 0.0 for r in burst)
    assert [r.arrival_time for r in poisson] == sorted(r.arrival_time for r in poisson)
    assert poisson[0].arrival_time > 0
    assert [(r.prompt_token_ids, r.max_tokens) for r in burst] == [
        (r.prompt_token_ids, r.max_tokens) for r in poisson
    ]


def test_prompts_are_corpus_text_of_exactly_the_drawn_length():
    corpus = CORPUS_PATH.read_text()
    for request in small_workload():
        assert request.prompt_token_ids is not None
        assert len(request.prompt_token_ids) == request.num_prompt_tokens
        assert 8 <= request.num_prompt_tokens <= 1024
        assert 1 <= request.max_tokens <= 256
        assert request.prompt == CharTokenizer().decode(request.prompt_token_ids)
        assert request.prompt[0].isupper() or request.prompt[0] == " "  # a sentence start
        if request.num_prompt_tokens < len(corpus):
            assert request.prompt in corpus + corpus  # a window, wrapping round


def test_lengths_are_long_tailed_and_clipped():
    lengths = long_tailed_lengths(stream(0, "test"), 2000, 8, 1024)
    assert min(lengths) >= 8 and max(lengths) == 1024  # the top clips a few draws
    median = statistics.median(lengths)
    assert 70 <= median <= 115  # the geometric middle of the range, about 90.5
    assert max(lengths) > 8 * median
    assert statistics.mean(lengths) > 1.3 * median  # a right tail pulls the mean up


def test_poisson_arrivals_have_the_asked_rate():
    times = arrival_times(stream(0, "arrivals"), 4000, rate=10.0)
    gaps = [b - a for a, b in zip([0.0, *times], times, strict=False)]
    assert all(g >= 0 for g in gaps)
    assert statistics.mean(gaps) == pytest.approx(0.1, rel=0.1)
    with pytest.raises(ValueError):
        arrival_times(stream(0, "arrivals"), 1, rate=0.0)


def test_jsonl_round_trip(tmp_path):
    requests = small_workload(rate=2.0) + [WorkloadRequest("text only", 3, 0.5)]
    path = tmp_path / "w.jsonl"
    write_workload(path, requests)
    assert read_workload(path) == requests
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first)[:4] == ["prompt", "max_tokens", "ignore_eos", "arrival_time"]
    assert "prompt_token_ids" not in json.loads(path.read_text().splitlines()[-1])


@pytest.mark.parametrize("field", ["stream", "ignore_eos"])
def test_a_flag_given_as_a_string_is_refused(field):
    """`"false"` is true to `bool`: a request meant to be sent whole was streamed (or its EOS
    ignored)."""
    line = json.dumps({"prompt": "x", "max_tokens": 1, field: "false"})
    with pytest.raises(TypeError, match=f"{field} must be true or false"):
        WorkloadRequest.from_json(line)
    assert getattr(WorkloadRequest.from_json(line.replace('"false"', "false")), field) is False


def test_the_committed_default_workload():
    requests = read_workload(MIXED64)
    assert len(requests) == 64
    prompt_lens = [r.num_prompt_tokens for r in requests]
    output_lens = [r.max_tokens for r in requests]
    assert all(8 <= n <= 1024 for n in prompt_lens) and all(1 <= n <= 256 for n in output_lens)
    assert statistics.median(prompt_lens) * 4 < max(prompt_lens)
    assert statistics.median(output_lens) * 4 < max(output_lens)
    assert all(r.ignore_eos and r.arrival_time == 0.0 for r in requests)


@pytest.mark.slow
def test_the_default_workload_text_round_trips_through_the_real_tokenizer():
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_dir()[0])
    for request in read_workload(MIXED64):
        assert tokenizer.decode(request.prompt_token_ids) == request.prompt
        num = len(tokenizer.encode(request.prompt, add_special_tokens=False))
        assert abs(num - request.num_prompt_tokens) <= 1


def test_a_built_in_generator_is_written_for_the_planner_with_its_shared_prefixes(tmp_path):
    from loadtest.generators import main
    from services.planner.workload import load_workload

    path = tmp_path / "agents.jsonl"
    main(["agents", "--num", "8", "--rate", "1", "--out", str(path)])
    written = read_workload(path)
    assert len(written) == 8 and all(r.label == "agents" for r in written)
    planned = load_workload(str(path))
    system = planned[0].prompt_token_ids[:512]
    assert all(r.shares_tokens and r.prompt_token_ids[:512] == system for r in planned)
    assert [r.arrival_time for r in planned] == sorted(r.arrival_time for r in written)
    for wrong in (["nope"], ["agents", "--num", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            main([*wrong, "--out", str(tmp_path / "wrong.jsonl")])
        assert exit_info.value.code == 2 and not (tmp_path / "wrong.jsonl").exists()


# --- metrics -----------------------------------------------------------------------------------


def test_percentile_interpolates_between_ranks():
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0, 4.0], 99) == pytest.approx(3.97)
    assert percentile([1.0, 2.0, 3.0, 4.0], 0) == 1.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 100) == 4.0
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def record(index, send, first, finish, tokens, error=None, chunks=None) -> RequestRecord:
    return RequestRecord(
        index,
        tokens,
        10,
        send,
        first,
        finish,
        chunks or [],
        tokens if error is None else None,
        error,
    )


def test_record_latencies():
    r = record(0, send=1.0, first=1.5, finish=3.5, tokens=5, chunks=[1.5, 2.0, 3.0, 3.5])
    assert r.ttft == 0.5 and r.e2e == 2.5
    assert r.tpot == pytest.approx(2.0 / 4)  # (e2e - ttft) / (tokens - 1)
    assert r.chunk_gaps == pytest.approx([0.5, 1.0, 0.5])
    assert record(1, 0.0, 0.2, 0.2, tokens=1).tpot is None  # one token has no TPOT


def test_summary_over_hand_made_records():
    records = [
        record(0, send=0.0, first=0.1, finish=1.1, tokens=11),  # tpot 0.1
        record(1, send=0.5, first=0.9, finish=2.9, tokens=11),  # tpot 0.2
        record(2, send=0.0, first=None, finish=None, tokens=4, error="HTTP 500"),
        record(3, send=1.0, first=1.2, finish=1.2, tokens=1),
    ]
    s = summarize(records, slo_ttft_s=0.3, slo_tpot_s=0.15)
    assert (s.num_requests, s.num_ok, s.num_errors) == (4, 3, 1)
    assert s.output_tokens == 23
    assert s.wall_s == 2.9  # the first send (the failed one counts) to the last finish
    assert s.output_tokens_per_s == pytest.approx(23 / 2.9)
    assert s.ttft_p50 == pytest.approx(0.2)
    assert s.tpot_p50 == pytest.approx(0.15) and s.tpot_p99 == pytest.approx(0.199)
    assert s.e2e_p50 == pytest.approx(1.1)
    assert s.goodput_rps == pytest.approx(2 / 2.9)  # requests 0 and 3 meet both objectives


def test_summary_of_nothing_finished():
    s = summarize([record(0, 0.0, None, None, 3, error="timed out")])
    assert s.num_ok == 0 and s.output_tokens_per_s == 0.0 and s.ttft_p50 is None


# --- the client against a fake server ----------------------------------------------------------

FIRST_TOKEN_S = 0.15
TOKEN_GAP_S = 0.05


@dataclass
class FakeServer:
    """A minimal OpenAI streaming server; the prompt's first token id picks its behaviour:
    1 streams correctly, 2 answers HTTP 500, 3 reports a wrong token count, 4 hangs,
    5 sends an error event mid-stream."""

    bodies: list[dict] = field(default_factory=list)
    heads: list[bytes] = field(default_factory=list)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        body = json.loads(await reader.readexactly(length))
        self.bodies.append(body)
        self.heads.append(head)
        try:
            await self.answer(body, writer)
        finally:
            writer.close()

    async def answer(self, body: dict, writer: asyncio.StreamWriter) -> None:
        mode, num_tokens = body["prompt"][0], body["max_tokens"]
        if not body["stream"]:
            await asyncio.sleep(FIRST_TOKEN_S)
            usage = {"prompt_tokens": 1, "completion_tokens": num_tokens}
            text = json.dumps({"choices": [{"text": "t" * num_tokens}] if mode == 1 else [],
                               "usage": usage}).encode()  # fmt: skip
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: "
                + str(len(text)).encode()
                + b"\r\nConnection: close\r\n\r\n"
                + text
            )
            return
        if mode == 2:
            writer.write(
                b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 4\r\n"
                b"Connection: close\r\n\r\nboom"
            )
            return
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n"
        )
        await asyncio.sleep(3600 if mode == 4 else FIRST_TOKEN_S)
        for i in range(num_tokens):
            if i:
                await asyncio.sleep(TOKEN_GAP_S)
            if mode == 5 and i == 1:
                writer.write(sse_event({"error": {"message": "worker lost"}}))
                break
            finish = "length" if i == num_tokens - 1 else None
            writer.write(sse_event(completion_chunk("c", "fake", 0, 0, f"t{i}", finish, None)))
            await writer.drain()
        reported = num_tokens + (1 if mode == 3 else 0)
        usage = {"prompt_tokens": 1, "completion_tokens": reported, "total_tokens": reported + 1}
        writer.write(sse_event(usage_chunk("c", "fake", 0, usage, chat=False)) + SSE_DONE)
        await writer.drain()


def run_fake(requests: list[WorkloadRequest], **kwargs):
    async def main():
        fake = FakeServer()
        server = await asyncio.start_server(fake.handle, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        async with server:
            result = await run_workload(f"http://127.0.0.1:{port}", "fake", requests, **kwargs)
        return result, fake

    return asyncio.run(main())


def req(mode: int, max_tokens: int, arrival: float = 0.0, stream: bool = True) -> WorkloadRequest:
    return WorkloadRequest("unused", max_tokens, arrival, [mode, 7, 7], stream=stream)


def test_client_measures_a_response_that_is_not_streamed():
    result, fake = run_fake([req(1, 4, stream=False), req(0, 4, stream=False)])
    ok, empty = result.records
    assert fake.bodies[0]["stream"] is False and "stream_options" not in fake.bodies[0]
    assert ok.ok and ok.completion_tokens == 4 and ok.ttft is None and ok.tpot is None
    assert ok.e2e == pytest.approx(FIRST_TOKEN_S, abs=0.1)
    assert not empty.ok and "without choices" in empty.error


def test_client_measures_ttft_tpot_and_tokens():
    result, fake = run_fake([req(1, 5), req(1, 1), req(1, 3, arrival=0.3)])
    assert [r.error for r in result.records] == [None, None, None]
    assert [r.completion_tokens for r in result.records] == [5, 1, 3]
    first, one, late = result.records
    assert len(first.chunk_times) == 5
    assert FIRST_TOKEN_S <= first.ttft < FIRST_TOKEN_S + 1.0
    # Client and server share one event loop on a busy machine: allow a gap's worth of jitter.
    assert TOKEN_GAP_S * 0.75 <= first.tpot < TOKEN_GAP_S + 0.5
    assert len(first.chunk_gaps) == 4 and sum(first.chunk_gaps) >= 3 * TOKEN_GAP_S
    assert late.send_time >= 0.3  # sent at its arrival time
    assert one.tpot is None
    assert result.summary.output_tokens == 9 and result.summary.num_ok == 3
    body = fake.bodies[0]
    assert body["prompt"] == [1, 7, 7] and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}


def test_client_records_errors_without_raising():
    requests = [req(2, 3), req(3, 3), req(4, 3), req(5, 3), req(1, 2)]
    result, _ = run_fake(requests, timeout_s=1.0)
    errors = [r.error for r in result.records]
    assert "HTTP 500" in errors[0] and "boom" in errors[0]
    assert "completion_tokens 4 != max_tokens 3" in errors[1]
    assert "timed out" in errors[2]
    assert "worker lost" in errors[3]
    assert errors[4] is None
    assert result.summary.num_errors == 4 and result.summary.output_tokens == 2


def test_client_global_deadline_cancels_what_is_left():
    result, _ = run_fake([req(4, 3), req(1, 1)], deadline_s=0.5)
    assert "global deadline" in result.records[0].error
    assert result.records[1].error is None


def test_client_to_a_closed_port_records_a_connection_error():
    requests = [req(1, 2)]
    result = asyncio.run(run_workload(f"http://127.0.0.1:{free_port()}", "fake", requests))
    assert result.records[0].error and "Connect" in result.records[0].error


# --- baseline helpers --------------------------------------------------------------------------


def test_left_pad():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def test_step_times_skip_the_prompt():
    streamer = StepTimes(Clock())
    for _ in range(4):
        streamer.put(None)
    assert len(streamer.times) == 3  # the first put is the prompt


def test_engine_outputs_become_records():
    records = [RequestRecord(0, 2), RequestRecord(1, 1)]
    _record_step(
        [RequestOutput("0", [5]), RequestOutput("1", [6], finish_reason="length")], records, 1.0
    )
    _record_step([RequestOutput("0", [7], finish_reason="length")], records, 1.5)
    assert (records[0].first_token_time, records[0].finish_time) == (1.0, 1.5)
    assert records[0].completion_tokens == 2 and records[0].chunk_times == [1.0, 1.5]
    assert (records[1].completion_tokens, records[1].finish_time) == (1, 1.0)


# --- the pipeline report -----------------------------------------------------------------------


def test_ratios_and_table_of_hand_made_results():
    from loadtest.metrics import Result
    from loadtest.pipeline_bench import format_table, ratios

    def result(name: str, finish: float) -> Result:
        records = [record(0, send=0.0, first=0.1, finish=finish, tokens=10)]
        return Result(name, summarize(records), records)

    results = {"static": result("static", 4.0), "engine": result("engine", 1.0)}
    assert ratios(results) == {"static_over_engine": 0.25, "engine_over_static": 4.0}
    table = format_table(results).splitlines()
    assert table[2].split()[:4] == ["static", "1/1", "4.0", "2.5"]
    assert "4.00x" in table[3] and "1.00x" in table[3]


def test_client_sends_the_api_key_as_a_bearer_token():
    _, fake = run_fake([req(1, 2)], api_key="sk-test-0123456789")
    assert b"authorization: bearer sk-test-0123456789" in fake.heads[0].lower()
    _, fake = run_fake([req(1, 2)])
    assert b"authorization" not in fake.heads[0].lower()


def test_the_disconnect_watch_bench_holds_its_requests_waiting_and_reports():
    """`loadtest.disconnect_watch` (what watching for disconnects costs the gateway) runs, and
    its requests really wait in `_unless_gone` (it asserts none was answered)."""
    result = subprocess.run(
        [sys.executable, "-m", "loadtest.disconnect_watch", "--requests", "20", "--seconds", "0.5"],
        capture_output=True, text=True, timeout=120, cwd=Path(__file__).resolve().parents[2],
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-2000:]
    assert re.search(r"20 requests waiting: the server used [\d.]+% of a core", result.stdout)


def test_the_pipeline_table_shows_na_for_a_percentile_a_failure_would_be():
    """Failed requests are in no latency: with 1 of 4 failed, the p99s over the successes were
    printed as the run's, flattering a run whose requests failed (`tandem bench` says "n/a")."""
    from loadtest.metrics import Result
    from loadtest.pipeline_bench import format_table

    records = [record(i, send=0.0, first=0.1, finish=1.0, tokens=10) for i in (0, 1, 2)]
    records.append(record(3, send=0.0, first=None, finish=None, tokens=0, error="timed out"))
    table = format_table({"cluster": Result("cluster", summarize(records), records)})
    row = table.splitlines()[2].split()
    assert row[1] == "3/4"
    assert row[-3:] == ["100/n/a", "100/n/a", "1000/n/a"]  # TTFT, TPOT, e2e p50/p99
    assert "cluster: n/a: 1 of 4 requests failed" in table
