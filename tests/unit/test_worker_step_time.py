"""The moving average of a worker's step durations, which its heartbeats report."""

from __future__ import annotations

import pytest

from shared.engine.pace import STEP_SMOOTHING, smoothed


def test_the_first_step_stands_alone_and_later_ones_move_the_average_by_their_weight():
    assert smoothed(0.0, 0.4) == 0.4
    assert smoothed(0.4, 1.4) == pytest.approx(0.4 + STEP_SMOOTHING * 1.0)
    average = 0.4
    for _ in range(50):  # a steady step time is where the average settles
        average = smoothed(average, 0.1)
    assert average == pytest.approx(0.1, abs=1e-6)
