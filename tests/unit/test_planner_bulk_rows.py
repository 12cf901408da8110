"""The planner's simulated decode worker holds batch lines out of a step beside interactive work
as the real engine does (`--bulk-step-slack`): its answers for jobs beside chats had every line
in every step, and chats the pace of the whole batch."""

from __future__ import annotations

import pytest

from services.planner.workers import SimDecodeWorker, _Sequence
from tests.unit.test_planner_caches import Recorder
from tests.unit.test_planner_sim import cpu_like_profile

CONTEXT = 128


def first_step(profile, chats: int, lines: int) -> tuple[list[str], float]:
    """The rows and time of the step a worker running `lines` batch lines (admitted first) and
    `chats` interactive sequences takes."""
    cluster = Recorder(profile)
    worker = SimDecodeWorker("d", profile, cluster, 10_000)
    for i in range(lines):
        worker.running[f"line{i}"] = _Sequence(f"line{i}", CONTEXT, 1, 50, 8, bulk=True)
    for i in range(chats):
        worker.running[f"chat{i}"] = _Sequence(f"chat{i}", CONTEXT, 1, 50, 8)
    worker._maybe_step()
    ((_, _, (_, batch, duration)),) = cluster.events
    return [s.request_id for s in batch], duration


@pytest.mark.parametrize("slack", [0.0, 0.25, 1.0])
def test_beside_a_chat_the_oldest_lines_join_within_the_slack(slack):
    profile = cpu_like_profile(bulk_step_slack=slack)
    rows, duration = first_step(profile, chats=1, lines=20)
    lines = [r for r in rows if r.startswith("line")]
    assert "chat0" in rows and lines == [f"line{i}" for i in range(len(lines))]
    bound = (1 + slack) * profile.decode_time(1, CONTEXT)
    assert duration <= bound + 1e-12
    assert profile.decode_time(len(rows) + 1, CONTEXT) > bound  # one more would pass it
    if slack == 0.0:
        assert lines == []


def test_without_a_chat_or_a_bound_every_line_runs():
    rows, _ = first_step(cpu_like_profile(), chats=0, lines=20)
    assert len(rows) == 20
    rows, _ = first_step(cpu_like_profile(bulk_step_slack=None), chats=1, lines=20)
    assert len(rows) == 21


def test_a_held_line_goes_on_once_the_chat_has_ended():
    profile = cpu_like_profile(bulk_step_slack=0.0)
    cluster = Recorder(profile)
    worker = SimDecodeWorker("d", profile, cluster, 10_000)
    worker.running["line"] = _Sequence("line", CONTEXT, 1, 3, 8, bulk=True)
    worker.running["chat"] = _Sequence("chat", CONTEXT, 1, 2, 8)
    worker._maybe_step()
    cluster.run_next()  # the chat's last token: the line sat out
    assert worker.running["line"].num_generated == 1 and "chat" not in worker.running
    cluster.run_next()
    assert worker.running["line"].num_generated == 2


@pytest.mark.parametrize("slack", [-0.5, float("inf"), float("nan"), True, "0.25"])
def test_a_profile_with_a_slack_no_worker_takes_is_refused(slack):
    from services.planner.profile import ProfileError

    with pytest.raises(ProfileError, match="bulk_step_slack"):
        cpu_like_profile(bulk_step_slack=slack)
