"""`loadtest.race`: its arguments and its table (the servers themselves run by hand)."""

from __future__ import annotations

import pytest

from loadtest.metrics import RequestRecord, Result, summarize
from loadtest.race import parse_args, race_table


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
