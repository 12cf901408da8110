"""`loadtest/bulk_beside_agents.py`: a batch job beside agents in the simulator (the real
scheduler core): the job takes spare capacity, the agents' long prompts do not wait for it."""

from __future__ import annotations

import pytest

from loadtest import bulk_beside_agents


def test_a_batch_job_leaves_agents_their_long_prompts_first_token():
    """Until 2026-12-07 an agent's long prompt waited in the scheduler's queue for a batch
    line's whole prefill (the prefill window's one big slot held by the line): p90 1.62x its
    TTFT alone here, 1.36x now (the engine prefills the agent's first, and now gets it)."""
    args = bulk_beside_agents.parse_args(["--lines", "12", "--agents", "5", "--every-s", "11"])
    result = bulk_beside_agents.run(args)
    alone, beside = result["alone"], result["beside_the_job"]
    assert result["errors"] == 0 and result["job_done_s"] > result["last_agent_s"]
    assert alone["p90"] <= beside["p90"] < 1.5 * alone["p90"]


def test_the_bulk_flag_reaches_the_core():
    from services.planner.profile import WorkerProfile
    from services.planner.simulator import SimConfig, Simulator
    from services.planner.workload import SimRequest

    simulator = Simulator(WorkerProfile.load(bulk_beside_agents.DEFAULT_PROFILE), SimConfig(1, 1))
    seen = []
    on_submit = simulator.core.on_submit
    simulator.core.on_submit = lambda identity, submit, now: (
        seen.append(submit.bulk) or on_submit(identity, submit, now)
    )
    simulator.run([SimRequest(0.0, 10, 2, bulk=True), SimRequest(0.0, 10, 2)])
    assert sorted(seen) == [False, True]


@pytest.mark.parametrize(
    "argv, message",
    [(["--lines", "0"], "--lines"), (["--every-s", "nan"], "--every-s"),
     (["--every-s", "-1"], "--every-s"), (["--tokens", "0"], "--tokens")],
)  # fmt: skip
def test_settings_that_measure_nothing_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        bulk_beside_agents.parse_args(argv)
    assert message in capsys.readouterr().err
