"""The scheduler service's tick after a stall of its own loop (`CatchUp`); the whole story, a
SIGSTOPped scheduler among beating workers, is tests/integration/test_scheduler_stall.py."""

from __future__ import annotations

from services.scheduler.service import CatchUp


def test_a_tick_after_a_stall_waits_once_for_what_was_sent_meanwhile():
    """A turn more than a heartbeat interval late (the process stopped, or starved) does not
    judge silence at once: ZeroMQ's thread may still hold the stall's heartbeats. It waits one
    interval, once; on time, or late twice running (an overloaded loop), it ticks."""
    hearing = CatchUp(heartbeat_interval_s=0.5)
    assert hearing.caught_up(now=10.2, due=10.0)  # on time (within an interval)
    assert not hearing.caught_up(now=14.0, due=10.1)  # four seconds late: wait
    assert hearing.caught_up(now=14.6, due=14.5)  # the interval after
    assert not hearing.caught_up(now=20.0, due=15.0)
    assert hearing.caught_up(now=22.0, due=20.5)  # late again: ticks all the same
    assert not hearing.caught_up(now=30.0, due=23.0)  # (and the next stall waits again)
