"""The simulator-at-scale benchmark, tiny: it runs one simulation and reports its own speed."""

from __future__ import annotations

from loadtest.sim_scale import main, measure
from tests.unit.test_planner_sim import cpu_like_profile


def test_a_tiny_run_serves_everything_and_reports_its_speed():
    figures = measure(cpu_like_profile(), 3, 2, "poisson:rate=4,n=40,prompt=8-128,output=1-8")
    assert figures["workers"] == "3 P + 2 D"
    assert figures["requests"] == "40 (40 served)"
    assert int(figures["events"].replace(",", "")) > 40 * 5  # a request's life is many events
    assert float(figures["simulated_s"].replace(",", "")) > 5  # 40 arrivals at 4/s
    assert float(figures["simulated_s_per_cpu_s"]) > 0


def test_the_command_prints_every_figure(capsys):
    assert (
        main(["--prefill", "2", "--decode", "2", "--workload", "poisson:rate=2,n=10,output=1-4"])
        == 0
    )
    out = capsys.readouterr().out
    for name in ("events_per_cpu_s", "requests_per_cpu_s", "simulated_s_per_cpu_s", "peak_rss"):
        assert name in out


def test_wrong_values_exit_2_naming_them(tmp_path, capsys):
    assert main(["--prefill", "0", "--workload", "poisson:rate=2,n=10"]) == 2
    assert "at least one prefill" in capsys.readouterr().err
    assert main(["--workload", "poisson:rate=-1"]) == 2
    assert "positive" in capsys.readouterr().err
    assert main(["--profile", str(tmp_path / "none.json")]) == 2
    assert "cannot read profile" in capsys.readouterr().err
