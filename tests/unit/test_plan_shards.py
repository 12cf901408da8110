"""Scheduler shards by tenant in the simulator: the split, the hash, the merged answer."""

from __future__ import annotations

import pytest

from loadtest.plan_shards import main, shard_of, simulate, split, with_zipf_tenants
from services.planner.workload import SimRequest
from tests.unit.test_planner_sim import fixed_profile


def requests(num: int, num_tenants: int) -> list[SimRequest]:
    return [
        SimRequest(
            arrival_time=i * 0.5, num_prompt_tokens=16, max_tokens=2, tenant=f"t{i % num_tenants}"
        )
        for i in range(num)
    ]


def test_workers_and_tenants_split_between_shards():
    assert split(5, 2) == [3, 2] and split(4, 4) == [1, 1, 1, 1]
    assert all(shard_of(f"t{i}", 2) == shard_of(f"t{i}", 2) for i in range(20))
    assert {shard_of(f"t{i}", 2) for i in range(20)} == {0, 1}


def test_every_request_ends_once_in_its_tenants_shard():
    workload = requests(24, 6)
    one = simulate(fixed_profile(), workload, 2, 2, 1)
    two = simulate(fixed_profile(), workload, 2, 2, 2)
    assert one.num_requests == [24] and sum(two.num_requests) == 24
    expected = [sum(shard_of(r.tenant, 2) == s for r in workload) for s in (0, 1)]
    assert two.num_requests == expected
    assert one.summary.num_ok == two.summary.num_ok == 24
    assert simulate(fixed_profile(), workload, 2, 2, 2).summary == two.summary  # deterministic


def test_the_shards_answers_are_merged_on_the_workloads_clock():
    # The second shard's tenant arrives 10 s in: each shard's simulated clock starts at its
    # own first arrival, and merged on those the run's wall time lost the 10 s (its rates
    # doubled).
    tenants = [f"t{i}" for i in range(10)]
    first = next(t for t in tenants if shard_of(t, 2) == 0)
    second = next(t for t in tenants if shard_of(t, 2) == 1)
    workload = [SimRequest(0.0, 16, 2, tenant=first), SimRequest(10.0, 16, 2, tenant=second)]
    one = simulate(fixed_profile(), workload, 2, 2, 1)
    two = simulate(fixed_profile(), workload, 2, 2, 2)
    assert one.summary.wall_s > 10
    assert two.summary.wall_s == pytest.approx(one.summary.wall_s)


def test_zipf_tenants_make_the_first_heavy():
    skewed = with_zipf_tenants(requests(2000, 1), 10, 1.5, seed=0)
    counts = {f"tenant{i}": sum(r.tenant == f"tenant{i}" for r in skewed) for i in range(10)}
    assert counts["tenant0"] > 3 * counts["tenant9"]


def test_wrong_values_exit_2(capsys):
    workload = "poisson:rate=1,n=4,prompt=8-16,output=1-2"
    for argv, message in [
        (["--shards", "1"], "--shards must be at least 2"),
        (["--shards", "3"], "3 shards need at least 3 prefill"),
        (["--skew", "-1"], "--skew must be >= 0"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(["--workload", workload, "--prefill", "2", "--decode", "2", *argv])
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_the_default_profile_is_found_from_any_folder(tmp_path, monkeypatch, capsys):
    """The shipped profile is the package's, not a path from the repository's root."""
    monkeypatch.chdir(tmp_path)
    workload = "poisson:rate=1,n=4,prompt=8-16,output=1-2"
    assert main(["--workload", workload, "--prefill", "2", "--decode", "2"]) == 0
    assert "requests per shard" in capsys.readouterr().out
