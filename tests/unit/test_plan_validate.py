"""The validation script's pure parts: configurations, the simulated side, the table, refusals."""

from __future__ import annotations

import pytest

from loadtest.metrics import summarize
from loadtest.plan_validate import (
    ValidateError,
    main,
    parse_configs,
    ranking,
    simulated,
    table,
    within,
)
from loadtest.workload import read_workload
from tests.unit.test_planner_sim import cpu_like_profile


def test_parse_configs():
    assert parse_configs("1P1D,1P2D, 2P1D") == [(1, 1), (1, 2), (2, 1)]
    for text in ("1P", "0P1D", "PD", "1D1P"):
        with pytest.raises(ValidateError, match="look like 1P2D"):
            parse_configs(text)


def test_the_simulated_side_on_the_shipped_workload():
    requests = read_workload("loadtest/workloads/mixed64.jsonl")
    one, two = (
        simulated(cpu_like_profile(), requests, 1, 1),
        simulated(cpu_like_profile(), requests, 2, 2),
    )
    assert one.num_ok == two.num_ok == len(requests)
    assert two.ttft_p90 <= one.ttft_p90
    rows = {"1P1D": (one, one), "2P2D": (two, one)}
    assert "1P1D" in table(rows) and "+0%" in table(rows)
    assert ranking(rows, 0) == ["2P2D", "1P1D"]
    assert within({"1P1D": (one, one)}) and not within({"x": (one, summarize([]))})


def test_wrong_values_exit_2(capsys):
    assert main(["--configs", "1P"]) == 2
    assert "look like 1P2D" in capsys.readouterr().err
    assert main(["--profile", "/nonexistent.json"]) == 2
    assert "cannot read profile" in capsys.readouterr().err
    assert main(["--profile", "1P1D=/nonexistent.json", "--configs", "1P2D"]) == 2
    assert "no file for 1P2D" in capsys.readouterr().err
