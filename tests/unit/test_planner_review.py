"""Review round of the capacity planner: wrong inputs get a clear error naming them, never a
traceback or a search that cannot end."""

from __future__ import annotations

import json

import pytest

from services.commands import cli
from services.planner.profile import ProfileError, WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import SimRequest, WorkloadError, load_workload
from tests.unit.test_planner_sim import cpu_like_profile, fixed_profile


@pytest.fixture
def profile_path(tmp_path):
    path = tmp_path / "profile.json"
    cpu_like_profile().save(path)
    return str(path)


def test_a_profile_that_is_not_text_is_refused_naming_it(tmp_path):
    """A binary file given as the profile (a gzip, an image) was a UnicodeDecodeError."""
    path = tmp_path / "profile.json.gz"
    path.write_bytes(b"\x1f\x8b\x08\x00\xff\xfe binary")
    with pytest.raises(ProfileError, match="cannot read profile .*profile.json.gz"):
        WorkerProfile.load(path)


@pytest.mark.parametrize("field", ["prefill_seconds", "decode_seconds"])
def test_an_infinite_step_time_is_refused(field):
    """JSON reads `Infinity`; an infinite time interpolated to NaN step times (inf - inf), which
    broke the event heap's order."""
    data = cpu_like_profile().to_dict()
    if field == "prefill_seconds":
        data[field][-1] = float("inf")
    else:
        data[field][0][0] = float("inf")
    with pytest.raises(ProfileError, match="step time"):
        WorkerProfile.from_dict(data)


def test_too_deeply_nested_json_is_refused_naming_the_file(tmp_path):
    """A line nested past the parser's recursion limit was a RecursionError traceback."""
    deep = "[" * 100_000 + "]" * 100_000
    workload = tmp_path / "w.jsonl"
    workload.write_text(deep + "\n")
    with pytest.raises(WorkloadError, match="w.jsonl:1"):
        load_workload(str(workload))
    profile = tmp_path / "p.json"
    profile.write_text(deep)
    with pytest.raises(ProfileError, match="cannot read profile"):
        WorkerProfile.load(profile)


def test_a_rate_so_low_that_arrivals_overflow_is_refused():
    """At rate=1e-320 every arrival time is infinite: the simulation ticked towards it forever."""
    with pytest.raises(WorkloadError, match="rate"):
        load_workload("poisson:rate=1e-320,n=3")


@pytest.mark.parametrize("rate", ["1e-300", "1e-15", "1e-8"])
def test_a_rate_whose_arrivals_span_more_than_a_year_is_refused(rate):
    """A finite but huge arrival time (1e300) was past the float clock's steps: the simulated
    time stopped moving, and `tandem plan` ran at full CPU forever."""
    with pytest.raises(WorkloadError, match=f"rate={rate} is too low"):
        load_workload(f"poisson:rate={rate},n=10")
    assert len(load_workload("poisson:rate=1e-6,n=10")) == 10  # (some 4 months)


def test_a_generated_process_is_bounded_and_names_each_field_once():
    """n=10^10 ran until the memory ran out; `rate=1,rate=2` took the last, unsaid."""
    with pytest.raises(WorkloadError, match="n must be at most 10,000,000"):
        load_workload("poisson:n=10000000000")
    with pytest.raises(WorkloadError, match="'rate' is given twice"):
        load_workload("poisson:rate=1,rate=2")


@pytest.mark.parametrize(
    ("times", "words"),
    [
        ([1e308], "arrival_time seconds in"),  # its clock origin overflowed (a traceback)
        ([1e300, 0.0], "arrival_time seconds in"),
        ([1.7e12], "milliseconds are not read"),
        ([0.0, 4e7], "spans 4e\\+07 s"),
    ],
)
def test_arrival_times_the_clock_cannot_step_through_are_refused(tmp_path, times, words):
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": "hi", "max_tokens": 8, "arrival_time": t} for t in times]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(WorkloadError, match=words):
        load_workload(str(path))


def test_a_logs_unix_seconds_are_read(tmp_path):
    path = tmp_path / "w.jsonl"
    lines = [{"prompt": "hi", "max_tokens": 8, "arrival_time": 1.7e9 + i} for i in range(3)]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    assert [r.arrival_time for r in load_workload(str(path))] == [1.7e9, 1.7e9 + 1, 1.7e9 + 2]


def test_a_ttft_objective_without_a_streamed_request_is_refused(profile_path, tmp_path, capsys):
    """Requests sent for one response have no TTFT (as the bench records them): an objective on
    it could never be judged, so every configuration 'failed' while serving every request within
    it, and the search went on to --max-workers to say nothing meets."""
    path = tmp_path / "bulk.jsonl"
    lines = [
        {"num_prompt_tokens": 32, "max_tokens": 4, "arrival_time": 0.5 * i, "stream": False}
        for i in range(6)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    flags = ["plan", "--workload", str(path), "--profile", profile_path, "--jobs", "1"]
    assert cli.main([*flags, "--slo", "ttft_p99=100s,e2e_p99=100s", "--max-workers", "4"]) == 2
    err = capsys.readouterr().err
    assert "ttft_p99" in err and "stream" in err
    assert cli.main([*flags, "--slo", "e2e_p99=100s", "--max-workers", "2"]) == 0


def test_a_sequence_swapped_out_never_holds_back_those_whose_kv_arrived():
    """A decode worker kept sequences whose KV had arrived (their blocks already theirs) out of
    the batch while one swapped out waited for room: when that room was the arrived ones'
    blocks, nothing ran again and both ended "unfinished" (the real worker's engine runs an
    arrived sequence at its next step, `add_prefilled`)."""
    requests = [
        SimRequest(arrival_time=1.0, num_prompt_tokens=64, max_tokens=46),
        SimRequest(arrival_time=1.5, num_prompt_tokens=48, max_tokens=32),
        SimRequest(arrival_time=2.0, num_prompt_tokens=48, max_tokens=11),
        SimRequest(arrival_time=3.5, num_prompt_tokens=32, max_tokens=37),
    ]
    config = SimConfig(1, 1, num_kv_blocks=8, drain_s=100.0)
    result = Simulator(fixed_profile(), config).run(requests)
    assert result.num_preemptions > 0, "the scenario is meant to swap one out"
    assert [r.error for r in result.records] == [None] * 4
    assert [r.completion_tokens for r in result.records] == [46, 32, 11, 37]


@pytest.mark.parametrize("out", ["folder", "file/p.json"])
def test_tandem_profile_refuses_an_out_it_cannot_write_before_measuring(
    tmp_path, monkeypatch, capsys, out
):
    """`--out` naming a folder (or a path under a file) was an IsADirectoryError (or a
    FileExistsError) traceback after the whole measurement: minutes of the machine's time."""
    import loadtest.worker_profile as worker_profile

    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("")

    def not_reached(*args, **kwargs):
        raise AssertionError("measured before the --out check")

    monkeypatch.setattr(worker_profile, "load_model", not_reached)
    assert cli.main(["profile", "--out", str(tmp_path / out)]) == 2
    assert f"--out {tmp_path / out}" in capsys.readouterr().err


def test_tandem_plan_refuses_an_out_under_a_file_before_searching(profile_path, tmp_path, capsys):
    """Only an `--out` that is a file was refused up front; one under a file was a
    NotADirectoryError traceback after the whole search, the plan lost."""
    (tmp_path / "file").write_text("")
    out = str(tmp_path / "file" / "plan")
    flags = ["plan", "--workload", "poisson:rate=1,n=4", "--profile", profile_path]
    assert cli.main([*flags, "--slo", "e2e_p99=100s", "--jobs", "1", "--out", out]) == 2
    captured = capsys.readouterr()
    assert f"--out {out}" in captured.err and "configuration" not in captured.out


@pytest.mark.parametrize("prompt", ["20000", "100000000000"])
def test_a_request_no_decode_worker_can_hold_is_refused_before_searching(
    profile_path, capsys, prompt
):
    """Every configuration refuses a request past a decode worker's KV pool (the core's 400):
    the search went on to --max-workers to say so, and a prompt of 10^11 tokens was built
    token by token in memory first (a MemoryError, or the machine's memory)."""
    workload = f"poisson:rate=1,n=4,prompt={prompt},output=8"
    flags = ["plan", "--workload", workload, "--profile", profile_path, "--jobs", "1"]
    assert cli.main([*flags, "--slo", "e2e_p99=100s"]) == 2
    captured = capsys.readouterr()
    assert f"prompt {prompt} + max_tokens 8" in captured.err and "KV" in captured.err
    assert "configuration" not in captured.out
