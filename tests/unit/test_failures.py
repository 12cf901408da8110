"""FailureWindow: a few failures pass, more than `limit` within `window_s` raise."""

from __future__ import annotations

import pytest

from shared.failures import FailureWindow, PersistentFailures


class Clock:
    def __init__(self):
        self.now = 50.0

    def __call__(self) -> float:
        return self.now


def test_more_than_the_limit_within_the_window_raises():
    clock = Clock()
    window = FailureWindow(limit=3, window_s=10.0, clock=clock)
    for _ in range(3):
        window.record()
        clock.now += 3  # the three within 6 s
    with pytest.raises(PersistentFailures, match="4 messages failed within 10 s"):
        window.record()  # at 9 s: the fourth within 10


def test_failures_older_than_the_window_no_longer_count():
    clock = Clock()
    window = FailureWindow(limit=3, window_s=10.0, clock=clock)
    for at in (0, 4, 8, 12, 16, 20, 24):  # never more than three within 10 s
        clock.now = 100.0 + at
        window.record()
    clock.now = 100.0 + 25  # with 16, 20, 24: four within 10 s
    with pytest.raises(PersistentFailures):
        window.record()


@pytest.mark.parametrize("limit, window_s", [(0, 10.0), (3, 0.0), (3, -1.0), (3, float("nan"))])
def test_a_window_that_cannot_work_is_refused(limit, window_s):
    with pytest.raises(ValueError, match="limit must be >= 1 and window_s > 0"):
        FailureWindow(limit=limit, window_s=window_s)
