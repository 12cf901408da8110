"""A review of `tandem bench`'s numbers and its wrong input, against real sockets (the fake
OpenAI server of test_bench_measurement, and a closed port): the time failed requests took counts
in the run's wall (goodput and throughput), a failure's cause is printed, and workload lines or an
`--out` that cannot be used are refused by name instead of escaping as a traceback."""

from __future__ import annotations

import asyncio
import json

import pytest

from loadtest import bench
from loadtest.client import run_workload
from loadtest.workload import WorkloadError, read_workload, write_workload
from tests.helpers import free_port
from tests.unit.test_bench import fake_result
from tests.unit.test_bench_measurement import FakeSSE, parse, serving, token_requests


def test_requests_that_time_out_count_in_the_wall_of_goodput_and_throughput():
    """2 of 4 answer at once, 2 would answer after 30 s and time out at 1 s: the run lasted 1 s,
    so 2 good requests make 2 req/s at most. The wall ended at the last success (a few ms), so a
    server that let its slow requests time out showed a goodput hundreds of times higher than
    one that served them slowly."""
    requests = token_requests(4)
    slow = frozenset(r.prompt_token_ids[0] for r in requests[2:])
    with serving(FakeSSE(slow_ids=slow, slow_ttft_s=30.0)) as url:
        result = asyncio.run(run_workload(url, "fake", requests, timeout_s=1.0, slo_ttft_s=0.5))
    s = result.summary
    assert [r.ok for r in result.records] == [True, True, False, False]
    assert s.wall_s >= 0.9
    assert s.goodput_rps <= 2 / 0.9 and s.requests_per_s <= 2 / 0.9
    assert s.output_tokens_per_s <= 4 / 0.9


def test_a_run_says_why_its_requests_failed(tmp_path, capsys):
    """An unreachable server without a warm-up printed `requests 0/2 ok (2 errors)` and no cause."""
    workload = tmp_path / "w.jsonl"
    write_workload(workload, token_requests(2))
    argv = ["--url", f"http://127.0.0.1:{free_port()}", "--workload", str(workload),
            "--warmup", "0", "--no-plots", "--out", str(tmp_path / "out")]  # fmt: skip
    assert bench.run(parse(*argv)) == 1
    out = capsys.readouterr().out
    assert "2 failed: ConnectError" in out


def test_an_out_that_is_a_file_is_refused_by_name(tmp_path, capsys):
    workload, taken = tmp_path / "w.jsonl", tmp_path / "taken"
    write_workload(workload, token_requests(1))
    taken.write_text("not a folder")
    results = [tmp_path / "a.json", tmp_path / "b.json"]
    for path in results:
        path.write_text(json.dumps(fake_result(path.stem, [None], 0.25)))
    for argv in (
        ["--workload", str(workload), "--out", str(taken)],
        ["--compare", *map(str, results), "--out", str(taken)],
    ):
        assert bench.run(parse(*argv, "--url", "http://127.0.0.1:1", "--no-plots")) == 2
        assert "--out" in capsys.readouterr().err
    assert taken.read_text() == "not a folder"


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ({"prompt": [1, 2], "max_tokens": 3}, "prompt must be a string"),
        ({"prompt": None, "max_tokens": 3}, "prompt must be a string"),
        ({"prompt": "a", "max_tokens": 2.9}, "max_tokens must be a whole number"),
        ({"prompt": "a", "max_tokens": "3"}, "max_tokens must be a whole number"),
        ({"prompt": "a", "max_tokens": True}, "max_tokens must be a whole number"),
        ({"prompt": "a", "max_tokens": 3, "prompt_token_ids": "123"}, "prompt_token_ids"),
        ({"prompt": "a", "max_tokens": 3, "prompt_token_ids": [1.5]}, "prompt_token_ids"),
        ({"prompt": "a", "max_tokens": 3, "prompt_token_ids": []}, "prompt_token_ids"),
        ({"prompt": "a", "max_tokens": 3, "prompt_token_ids": [-1]}, "prompt_token_ids"),
    ],
)
def test_workload_lines_of_the_wrong_type_are_refused_by_line(tmp_path, capsys, line, needle):
    """A prompt not a string escaped as a traceback (AttributeError in the nonce); ids given as
    a string were sent as its digits, a fractional max_tokens was truncated."""
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "ok", "max_tokens": 2}\n' + json.dumps(line) + "\n")
    with pytest.raises(WorkloadError, match=f"w.jsonl:2: .*{needle}"):
        read_workload(path)
    argv = ["--workload", str(path), "--url", "http://127.0.0.1:1", "--out", str(tmp_path / "o")]
    assert bench.run(parse(*argv)) == 2
    assert needle in capsys.readouterr().err
