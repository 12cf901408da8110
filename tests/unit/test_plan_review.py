"""`tandem plan` under review: objectives it cannot judge, its headline, repeated budgets,
workload and profile values of the wrong type."""

from __future__ import annotations

import json

import pytest

from services.commands import cli
from tests.unit.test_planner_sim import cpu_like_profile

TINY = "poisson:rate=2,n=20,prompt=8-128,output=4-16,seed=1"


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan_review") / "profile.json"
    cpu_like_profile().save(path)
    return str(path)


def plan(profile_path: str, workload: str, *flags: str) -> int:
    argv = ["plan", "--workload", workload, "--profile", profile_path, "--jobs", "1", *flags]
    return cli.main(argv)


def test_a_tpot_objective_without_a_streamed_request_is_refused(profile_path, tmp_path, capsys):
    """A request answered in one response has no TPOT (as the bench records it), so a TPOT
    objective judged nothing: 1 ms per token, far below any step, was printed as met."""
    workload = tmp_path / "whole.jsonl"
    lines = [
        json.dumps({"prompt": "x" * 200, "max_tokens": 40, "arrival_time": i / 2, "stream": False})
        for i in range(10)
    ]
    workload.write_text("\n".join(lines) + "\n")
    assert plan(profile_path, str(workload), "--slo", "tpot_p99=1ms", "--max-workers", "3") == 2
    captured = capsys.readouterr()
    assert "tpot_p99" in captured.err and "streamed" in captured.err
    assert "meeting" not in captured.out


def test_the_headline_states_the_objectives_as_given(profile_path, capsys):
    """0.4 ms was printed as `<= 0 ms` and 100.6 ms as `<= 101 ms`."""
    plan(profile_path, TINY, "--slo", "ttft_p99=0.4ms,tpot_p99=100.6ms", "--max-workers", "2")
    headline = capsys.readouterr().out.splitlines()[0]
    assert "ttft_p99 <= 0.4 ms, tpot_p99 <= 100.6 ms" in headline


def test_a_chunk_budget_named_twice_is_refused(profile_path, capsys):
    """Each was simulated twice, and the best came back as its own runner-up."""
    flags = ["--slo", "ttft_p99=2s", "--max-workers", "3", "--chunk-budgets", "256,512,256"]
    assert plan(profile_path, TINY, *flags) == 2
    assert "--chunk-budgets names 256 twice" in capsys.readouterr().err


def test_a_plan_is_the_same_run_after_run_and_side_by_side(profile_path, tmp_path, capsys):
    """The workload's seed fixes the plan: one process or two, the same configurations tried
    with the same figures (all but the simulator's own speed)."""
    plans = []
    for jobs in ("1", "2"):
        out = tmp_path / jobs
        flags = ["--slo", "ttft_p99=300ms,tpot_p99=120ms", "--max-workers", "4", "--out", str(out)]
        assert plan(profile_path, TINY, *flags, "--jobs", jobs) == 0
        data = json.loads((out / "plan.json").read_text())
        data.pop("events_per_s")
        plans.append(data)
    assert plans[0] == plans[1] and plans[0]["best"]["cost"] == 3


@pytest.mark.parametrize(
    "line, named",
    [
        ('{"num_prompt_tokens": 32, "max_tokens": 2.7}', "max_tokens"),
        ('{"num_prompt_tokens": 32, "max_tokens": true}', "max_tokens"),
        ('{"num_prompt_tokens": "32", "max_tokens": 4}', "num_prompt_tokens"),
        ('{"prompt": [1, 2.5], "max_tokens": 4}', "a token id"),
    ],
)
def test_a_workload_count_that_is_no_whole_number_is_refused(tmp_path, line, named):
    """Read as ints (2.7 as 2, true as 1), they planned for requests the server refuses."""
    from services.planner.workload import WorkloadError, load_workload

    path = tmp_path / "w.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(WorkloadError, match=f"w.jsonl:1: {named} must be a whole number"):
        load_workload(str(path))


def test_a_workload_saved_with_a_byte_order_mark_reads(tmp_path):
    from services.planner.workload import load_workload

    path = tmp_path / "w.jsonl"
    path.write_text('{"num_prompt_tokens": 32, "max_tokens": 4}\n', encoding="utf-8-sig")
    assert [r.max_tokens for r in load_workload(str(path))] == [4]


@pytest.mark.parametrize("name", ["transfer_latency_s", "transfer_bytes_per_s"])
def test_a_profile_number_that_is_text_is_refused_by_name(name):
    """ "fast" was refused as "'<' not supported between instances of 'int' and 'str'"."""
    from services.planner.profile import ProfileError, WorkerProfile

    data = cpu_like_profile().to_dict()
    data[name] = "fast"
    with pytest.raises(ProfileError, match=f"{name} must be a number, got 'fast'"):
        WorkerProfile.from_dict(data)
