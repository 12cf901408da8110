"""The workload writers' command lines (`loadtest.workload`, `loadtest.generators`): a wrong
value is refused before any tokenizer loads, naming the flag."""

from __future__ import annotations

import math
import random

import pytest

from loadtest import generators, workload


@pytest.mark.parametrize("main", [workload.main, generators.main])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--rate", "0"], "--rate"),
        (["--rate", "-2"], "--rate"),
        (["--rate", "nan"], "--rate"),  # (wrote NaN arrival times the readers then refuse)
        (["--rate", "inf"], "--rate"),
        (["--num", "0"], "--num"),
    ],
)
def test_a_wrong_rate_or_count_exits_2_naming_the_flag(main, flags, message, tmp_path, capsys):
    argv = ["--out", str(tmp_path / "w.jsonl"), *flags]
    if main is generators.main:
        argv = ["chat", *argv]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "w.jsonl").exists()


def test_arrival_times_refuse_a_rate_that_is_no_positive_number():
    for rate in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="rate"):
            workload.arrival_times(random.Random(0), 3, rate)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("[1, 2]", "a request is a JSON object, got list"),  # (an AttributeError escaped)
        ("7", "a request is a JSON object, got int"),
        ('{"max_tokens": 2}', "'prompt'"),
    ],
)
def test_a_bench_workload_line_that_is_no_request_is_named(line, message, tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text('{"prompt": "x", "max_tokens": 1}\n' + line + "\n")
    with pytest.raises(workload.WorkloadError, match=f"w.jsonl:2: .*{message}"):
        workload.read_workload(path)
