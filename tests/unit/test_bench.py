"""`tandem bench` without a server: percentiles and goodput on a hand-computed case, per-class
summaries, timelines, the batch sampler, built-in generators, settings it refuses, and the
comparison of result files."""

from __future__ import annotations

import argparse
import importlib
import json
from collections import Counter

import pytest

from loadtest import bench
from loadtest.bench import BatchSampler, BenchError, compare_table, compared_runs, load_result
from loadtest.client import request_body
from loadtest.generators import (
    AGENT_FIRST_TOKENS,
    AGENT_SYSTEM_TOKENS,
    AGENT_TURN_TOKENS,
    CLASSES,
    generate,
    with_arrivals,
)
from loadtest.metrics import (
    Clock,
    RequestRecord,
    summarize,
    summarize_by_label,
    token_timeline,
)
from loadtest.summary_text import format_summary
from loadtest.workload import WorkloadError, read_workload
from services.planner.workload import WorkloadError as PlannerWorkloadError
from services.planner.workload import load_workload
from tests.unit.test_loadtest import CharTokenizer


def streamed(index, send, first, finish, tokens, label="chat") -> RequestRecord:
    gap = (finish - first) / max(1, tokens - 1)
    chunks = [first + i * gap for i in range(tokens)]
    return RequestRecord(index, tokens, 10, send, first, finish, chunks, tokens, label=label)


def test_percentiles_and_goodput_by_hand():
    # Five chats sent at 0 with TTFTs 0.1..0.5 s and 11 tokens each, one TPOT per request:
    # TPOTs 0.01, 0.02, 0.03, 0.04, 0.05 (finish = ttft + 10 * tpot).
    records = [streamed(i, 0.0, 0.1 * (i + 1), 0.1 * (i + 1) + 0.1 * (i + 1), 11)
               for i in range(5)]  # fmt: skip
    s = summarize(records, slo_ttft_s=0.35, slo_tpot_s=0.045)
    # Linear interpolation between ranks: p50 = the middle; p90 = 0.4 + 0.6 * 0.1; p99 = 0.4 +
    # 0.96 * 0.1.
    assert s.ttft_p50 == pytest.approx(0.3)
    assert s.ttft_p90 == pytest.approx(0.46)
    assert s.ttft_p99 == pytest.approx(0.496)
    assert s.tpot_p50 == pytest.approx(0.03)
    assert s.tpot_p90 == pytest.approx(0.046)
    assert s.e2e_p50 == pytest.approx(0.6)
    # The wall is 0 .. 1.0 s (the last finish); TTFT <= 0.35 and TPOT <= 0.045: requests 0-2.
    assert s.wall_s == pytest.approx(1.0)
    assert s.goodput_rps == pytest.approx(3.0)
    assert s.requests_per_s == pytest.approx(5.0)
    assert s.output_tokens_per_s == pytest.approx(55.0)
    # One objective alone counts too.
    assert summarize(records, slo_ttft_s=0.25).goodput_rps == pytest.approx(2.0)
    assert summarize(records, slo_tpot_s=0.015).goodput_rps == pytest.approx(1.0)


def test_goodput_of_a_run_where_every_request_failed_is_zero_not_missing():
    # With an objective given, goodput None reads "no objective" ("-", no goodput line); a run
    # where nothing succeeded served no request within it: 0 req/s, as its throughput reads.
    failed = [RequestRecord(i, 8, 10, 0.0, None, None, [], None, "timed out") for i in range(3)]
    s = summarize(failed, slo_ttft_s=1.0)
    assert s.goodput_rps == 0.0 and s.requests_per_s == 0.0
    assert "goodput 0.00 req/s" in format_summary(s)
    assert summarize(failed).goodput_rps is None  # no objective: no goodput


def test_a_response_not_streamed_meets_ttft_by_its_latency():
    bulk = RequestRecord(0, 8, 10, 0.0, None, 0.5, [], 8, label="bulk")
    slow = RequestRecord(1, 8, 10, 0.0, None, 2.0, [], 8, label="bulk")
    s = summarize([bulk, slow], slo_ttft_s=1.0)
    assert s.ttft_p50 is None and s.e2e_p50 == pytest.approx(1.25)
    assert s.goodput_rps == pytest.approx(0.5)  # one of two in 2 s


def test_summaries_per_class_keep_the_classes_apart():
    records = [streamed(0, 0, 0.1, 1.0, 10), streamed(1, 0, 2.0, 3.0, 5, label="long")]
    records.append(RequestRecord(2, 5, 10, 0.0, None, None, [], None, "timed out", label="long"))
    by_class = summarize_by_label(records)
    assert list(by_class) == ["chat", "long"]
    assert by_class["chat"].ttft_p50 == pytest.approx(0.1)
    assert by_class["long"].ttft_p50 == pytest.approx(2.0)
    assert (by_class["long"].num_ok, by_class["long"].num_errors) == (1, 1)


def test_each_classs_rates_are_over_the_whole_run_and_add_up_to_its_own():
    """A rare class's one request of 0.5 s read 2 requests/s over its own span, in a run of
    10 s where it made one."""
    chats = [streamed(i, float(i), i + 0.1, i + 1.0, 10) for i in range(10)]  # 0 s to 10 s
    rare = streamed(10, 4.0, 4.1, 4.5, 5, label="rare")
    by_class = summarize_by_label([*chats, rare], slo_ttft_s=1.0)
    whole = summarize([*chats, rare], slo_ttft_s=1.0)
    assert whole.wall_s == pytest.approx(10.0)
    assert by_class["rare"].wall_s == pytest.approx(10.0)
    assert by_class["rare"].requests_per_s == pytest.approx(0.1)
    assert by_class["rare"].output_tokens_per_s == pytest.approx(0.5)
    for rate in ("requests_per_s", "output_tokens_per_s", "goodput_rps"):
        parts = sum(getattr(summary, rate) for summary in by_class.values())
        assert parts == pytest.approx(getattr(whole, rate))


def test_token_timeline_spreads_tokens_over_chunks():
    records = [
        streamed(0, 0.0, 0.5, 2.5, 5),  # chunks at 0.5, 1.0, 1.5, 2.0, 2.5
        RequestRecord(1, 4, 10, 0.0, None, 1.2, [], 4),  # 4 tokens at 1.2
    ]
    assert token_timeline(records) == [[0.0, 1.0], [1.0, 6.0], [2.0, 2.0]]
    assert token_timeline([]) == []
    with pytest.raises(ValueError):
        token_timeline(records, bin_s=0)


def worker(peer, steps, sizes, role="decode"):
    return {"peer_id": peer, "role": role, "steps_completed": steps, "recent_batch_sizes": sizes}


def test_batch_sampler_takes_each_heartbeat_once_and_idle_as_zero():
    sampler = BatchSampler("http://unused", 0.5, Clock())
    sampler.take([worker("d0", 3, [1, 2, 2]), worker("p0", 9, [4], role="prefill")], now=1.0)
    sampler.take([worker("d0", 3, [1, 2, 2])], now=1.5)  # the same heartbeat: no steps since
    sampler.take([worker("d0", 5, [3, 0, 3])], now=2.0)
    assert sampler.samples == [
        {"peer": "d0", "t0": 0.5, "t1": 1.0, "sizes": [1, 2, 2]},
        {"peer": "d0", "t0": 1.0, "t1": 1.5, "sizes": [0]},
        {"peer": "d0", "t0": 1.5, "t1": 2.0, "sizes": [3, 3]},
    ]


def test_generators_shape_each_class():
    tokenizer = CharTokenizer()
    for name, shape in CLASSES.items():
        requests = generate(tokenizer, name, 8, seed=1)
        assert {r.label for r in requests} == {name}
        assert all(r.stream == shape.stream for r in requests)
        low, high = shape.prompt_range
        assert all(low <= r.num_prompt_tokens <= high for r in requests)
    mix = generate(tokenizer, "mix", 40, seed=1)
    assert mix == generate(tokenizer, "mix", 40, seed=1)
    counts = Counter(r.label for r in mix)
    assert set(counts) == {"chat", "long", "bulk"} and counts["chat"] > counts["long"]
    with pytest.raises(ValueError, match="unknown workload"):
        generate(tokenizer, "poetry", 4)
    with pytest.raises(ValueError, match=">= 1"):
        generate(tokenizer, "chat", 0)


def test_agents_share_one_system_prompt_and_each_turn_extends_the_last():
    requests = generate(CharTokenizer(), "agents", 10, seed=1)  # 3 agents, turn-major
    assert len(requests) == 10 and {r.label for r in requests} == {"agents"}
    system = requests[0].prompt_token_ids[:AGENT_SYSTEM_TOKENS]
    assert all(r.prompt_token_ids[:AGENT_SYSTEM_TOKENS] == system for r in requests)
    lengths = [r.num_prompt_tokens - AGENT_SYSTEM_TOKENS for r in requests]
    first, turn = AGENT_FIRST_TOKENS, AGENT_TURN_TOKENS
    assert lengths == [first] * 3 + [first + turn] * 3 + [first + 2 * turn] * 3 + [first + 3 * turn]
    for earlier, later in zip(requests[:-3], requests[3:], strict=True):  # one agent, a turn on
        assert later.prompt_token_ids[: earlier.num_prompt_tokens] == earlier.prompt_token_ids
    assert requests[0].prompt_token_ids != requests[1].prompt_token_ids  # agents differ
    assert requests == generate(CharTokenizer(), "agents", 10, seed=1)


def test_json_requests_are_constrained_and_end_with_their_structure():
    requests = generate(CharTokenizer(), "json", 6, seed=2)
    assert {r.label for r in requests} == {"json"} and not any(r.ignore_eos for r in requests)
    for request in requests:
        schema = request.response_format["json_schema"]["schema"]
        assert request.response_format["type"] == "json_schema" and schema["type"] == "object"
        body = request_body("m", request)
        assert body["response_format"] == request.response_format and not body["ignore_eos"]
        assert type(request).from_json(request.to_json()) == request  # the JSONL round trip


def test_arrivals_change_and_prompts_do_not():
    requests = generate(CharTokenizer(), "chat", 16)
    poisson = with_arrivals(requests, 4.0)
    assert [r.prompt_token_ids for r in poisson] == [r.prompt_token_ids for r in requests]
    assert poisson[-1].arrival_time > 0 and with_arrivals(requests, None)[-1].arrival_time == 0


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    "url", ["http://127.0.0.1:8000", "http://127.0.0.1:8000/", "http://127.0.0.1:8000/v1/"]
)
def test_the_openai_base_url_is_read_as_the_servers(url):
    """`--url http://host/v1`, the base URL an OpenAI client takes, sent every request to
    /v1/v1/completions (a 404 each)."""
    args = parse("--url", url)
    bench.check_settings(args)
    assert args.url == "http://127.0.0.1:8000"


@pytest.mark.parametrize(
    "argv,needle",
    [
        (["--sweep", "1,x"], "--sweep takes rates"),
        (["--sweep", "2,0"], "--sweep rates must be > 0"),
        (["--rate", "-1"], "--rate must be > 0"),
        (["--num", "0"], "--num must be > 0"),
        (["--slo-ttft", "0"], "--slo-ttft must be > 0"),
        (["--url", "127.0.0.1:8000"], "--url must be an http"),
        (["--compare", "only-one.json"], "two or more"),
        (["--timeout", "nan"], "--timeout must be > 0"),
        (["--deadline", "inf"], "--deadline must be > 0"),
        (["--rate", "nan"], "--rate must be > 0"),
        (["--sweep", "1,nan"], "--sweep rates must be > 0"),
        (["--slo-tpot", "nan"], "--slo-tpot must be > 0"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
    ],
)
def test_wrong_settings_are_refused_by_name(argv, needle, capsys):
    assert bench.run(parse(*argv, "--out", "/nonexistent/never-written")) == 2
    assert needle in capsys.readouterr().err


def test_wrong_workload_files_name_the_line(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "a", "max_tokens": 3}\n{"prompt": "b"}\n')
    with pytest.raises(WorkloadError, match=r"w.jsonl:2: KeyError"):
        read_workload(path)
    path.write_text('{"prompt": "a", "max_tokens": 0}\n')
    with pytest.raises(WorkloadError, match=":1: max_tokens must be >= 1"):
        read_workload(path)
    path.write_text("\n")
    with pytest.raises(WorkloadError, match="no requests"):
        read_workload(path)


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"prompt": "a", "max_tokens": 1e999}\n', ":1: (ValueError: )?max_tokens.*inf"),
        (b'{"prompt": "a", "max_tokens": 2, "arrival_time": NaN}\n', "arrival_time seconds in"),
        (
            b'{"prompt": "a", "max_tokens": 2, "arrival_time": Infinity}\n',
            "arrival_time seconds in",
        ),
        (b'{"prompt": "\xff\xfe"}\n', "cannot read workload"),  # not UTF-8
    ],
)
def test_workload_values_json_allows_but_no_request_has_are_named(tmp_path, content, needle):
    """Each escaped as a traceback (an int from 1e999, a file not in UTF-8) or was taken (a NaN
    arrival time, which then made every percentile NaN)."""
    path = tmp_path / "w.jsonl"
    path.write_bytes(content)
    with pytest.raises(WorkloadError, match=needle):
        read_workload(path)
    with pytest.raises(PlannerWorkloadError, match=needle):
        load_workload(str(path))


def fake_result(name: str, rates: list[float | None], ttft_p50: float) -> dict:
    summary = summarize([streamed(0, 0.0, ttft_p50, ttft_p50 + 1.0, 11)]).to_dict()
    runs = [{"rate": rate, "arrivals": "poisson", "summary": summary, "records": []}
            for rate in rates]  # fmt: skip
    return {"tool": "tandem bench", "version": bench.RESULT_VERSION, "name": name, "runs": runs}


def test_comparison_table_has_a_column_per_run(tmp_path):
    columns = compared_runs([fake_result("ours", [None], 0.25), fake_result("peer", [1, 2], 0.5)])
    assert [name for name, _ in columns] == ["ours", "peer @1/s", "peer @2/s"]
    table = compare_table(columns).splitlines()
    ttft = next(line for line in table if line.startswith("TTFT p50 ms"))
    assert ttft.split()[3:] == ["250", "500", "500"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"tool": "something else"}))
    with pytest.raises(BenchError, match="not a `tandem bench` result"):
        load_result(str(path))
    path.write_text("{")
    with pytest.raises(BenchError, match="cannot read"):
        load_result(str(path))


@pytest.mark.parametrize(
    ("module", "argv"),
    [
        ("grammar_ttft", ["--num", "2"]),
        ("grammar_ttft", ["--rounds", "0"]),
        ("grammar_ttft", ["--rate", "0"]),
        ("grammar_ttft", ["--rate", "x"]),
        ("grammar_bench", ["--threads", "0"]),
        ("grammar_bench", ["--steps", "0"]),
        ("grammar_bench", ["--batch-sizes", "0"]),
        ("grammar_bench", ["--threads", "x"]),
    ],
)
def test_grammar_benches_refuse_wrong_arguments_before_any_model_or_cluster(module, argv):
    bench = importlib.import_module(f"loadtest.{module}")
    with pytest.raises(SystemExit) as exit_info:
        bench.main(argv)
    assert exit_info.value.code == 2
