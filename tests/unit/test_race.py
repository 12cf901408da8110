"""`loadtest.race`: its arguments and its table (the servers themselves run by hand)."""

from __future__ import annotations

import pytest

from loadtest.metrics import RequestRecord, Result, summarize
from loadtest.race import parse_args, race_table, worker_work, workers_table
from loadtest.worker_metrics import WorkerCounters


def result(name: str, tokens_per_request: int, seconds: float) -> Result:
    records = []
    for i in range(4):
        record = RequestRecord(i, tokens_per_request, 8, send_time=0.0)
        record.first_token_time = 0.1
        record.finish_time = seconds
        record.completion_tokens = tokens_per_request
        records.append(record)
    return Result(name, summarize(records), records)


def test_the_table_gives_tandems_ratio_to_llama_cpp():
    table = race_table({"tandem": result("t", 30, 2.0), "llama.cpp": result("l", 30, 3.0)})
    tandem_row, llama_row = table.splitlines()[2:]
    assert tandem_row.split()[:5] == ["tandem", "4/4", "2.0", "60.0", "1.50x"]
    assert llama_row.split()[:5] == ["llama.cpp", "4/4", "3.0", "40.0", "1.00x"]


@pytest.mark.parametrize(
    "argv,words",
    [
        (["--slots", "0"], "--slots must be >= 1"),
        (["--context-per-slot", "8"], "--context-per-slot >= 64"),
        (["--llama-server", "/bin/true"], "--llama-server needs --llama-gguf"),
        (["--slots", "many"], "invalid int value"),
    ],
)
def test_wrong_arguments_exit_2_naming_them(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert words in capsys.readouterr().err


def test_worker_work_is_the_difference_over_the_wall():
    before = {
        "prefill-0": WorkerCounters("prefill", steps=10, busy_s=1.0),
        "decode-0": WorkerCounters("decode", steps=5, busy_s=2.0, batch_sequences=5, batch_steps=5),
    }
    after = {
        "prefill-0": WorkerCounters("prefill", steps=30, busy_s=9.0),
        "decode-0": WorkerCounters(
            "decode", steps=105, busy_s=11.0, batch_sequences=805, batch_steps=105
        ),
        # A worker that joined during the burst counts from zero.
        "decode-1": WorkerCounters("decode", steps=4, busy_s=1.0, batch_sequences=8, batch_steps=4),
    }
    work = worker_work(before, after, wall_s=10.0)
    assert work["prefill-0"] == {"role": "prefill", "busy": 0.8, "steps": 20, "mean_batch": None}
    assert work["decode-0"] == {"role": "decode", "busy": 0.9, "steps": 100, "mean_batch": 8.0}
    assert work["decode-1"]["mean_batch"] == 2.0
    table = workers_table(work)
    assert "decode-0 (decode): busy 90% of the wall, 100 steps, 8.0 sequences per step" in table
