"""The decode step cost model: a line through the worker's own decode steps, and how many bulk
rows it lets join a step within a slack."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.decode_cost import DecodeCost

CPU_LIKE = (0.062, 0.015)  # seconds: a step's fixed cost and each row's (measured: 1 row 0.077)
GPU_LIKE = (0.010, 0.00002)


def fitted(a: float, b: float, sizes=(1, 2, 8, 40)) -> DecodeCost:
    cost = DecodeCost()
    for _ in range(3):
        for rows in sizes:
            cost.record(rows, a + b * rows)
    return cost


def test_a_fit_recovers_the_line():
    cost = fitted(*CPU_LIKE)
    assert cost.predict(1) == pytest.approx(0.077)
    assert cost.predict(48) == pytest.approx(0.782)


def test_the_extra_rows_keep_the_step_within_the_slack():
    cost = fitted(*CPU_LIKE)
    # a/b = 4.13 rows of fixed cost: beside 1 row, 25% more time is 1.28 rows.
    assert cost.max_extra_rows(1, 0.25) == 1
    assert cost.max_extra_rows(1, 1.0) == 5
    assert cost.max_extra_rows(10, 0.25) == 3
    assert cost.max_extra_rows(1, 0.0) == 0


def test_on_a_gpu_like_line_many_rows_fit():
    cost = fitted(*GPU_LIKE)
    assert cost.max_extra_rows(1, 0.25) == 125


def test_a_flat_or_falling_line_bounds_nothing_but_a_zero_slack():
    cost = fitted(0.01, 0.0)
    assert cost.max_extra_rows(1, 0.25) is None
    falling = fitted(0.05, -0.0001)
    assert falling.max_extra_rows(3, 0.1) is None
    assert falling.max_extra_rows(3, 0.0) == 0


def test_before_two_sizes_apart_it_assumes_time_proportional_to_rows():
    """The most a row can cost (no fixed cost): the bound holds whatever the true line, and a
    step of the interactive rows alone is a second size to fit."""
    cost = DecodeCost()
    assert cost.predict(4) is None
    assert cost.max_extra_rows(1, 0.25) == 0
    assert cost.max_extra_rows(8, 0.25) == 2
    for _ in range(10):
        cost.record(40, 0.6)
        cost.record(41, 0.61)  # a size one row apart says little of the slope
    assert cost.predict(40) is None and cost.max_extra_rows(4, 0.5) == 2
    for _ in range(3):  # a size counts from its third step: one step may be an outlier
        assert cost.predict(1) is None
        cost.record(1, 0.077)
    assert cost.predict(1) == pytest.approx(0.077, rel=0.01)
    assert cost.max_extra_rows(1, 0.25) == 1


def test_each_size_counts_once_however_often_it_ran():
    """A size seen a few times still pins the line's far end: hundreds of steps at one size do
    not fade it out (a fit over steps would lose its slope)."""
    cost = DecodeCost(max_age=500)
    for _ in range(3):
        cost.record(40, 0.062 + 0.015 * 40)
    for _ in range(3):
        cost.record(1, 0.077)
    for _ in range(490):
        cost.record(1, 0.077)
    assert cost.predict(40) == pytest.approx(0.662)


def test_a_size_not_seen_for_long_is_measured_again():
    """Dropped, it leaves the model to its prior: the steps that prior allows are new sizes to
    measure, so a slope from another time (a busier or idler machine) is not kept for good."""
    cost = DecodeCost(max_age=100)
    for _ in range(3):
        cost.record(40, 0.662)
    for _ in range(99):  # its last step 99 steps ago
        cost.record(1, 0.077)
    assert cost.predict(40) == pytest.approx(0.662)
    cost.record(1, 0.077)
    assert cost.predict(40) is None and cost.max_extra_rows(4, 0.25) == 1


def test_a_slow_step_now_and_then_does_not_move_the_line():
    cost = fitted(*CPU_LIKE)
    cost.record(1, 0.5)  # a step that waited on something else
    assert cost.predict(1) == pytest.approx(0.077)


def test_recent_steps_of_a_size_replace_old_ones():
    cost = fitted(*CPU_LIKE)
    for _ in range(5):  # the machine got twice as slow
        for rows in (1, 2, 8, 40):
            cost.record(rows, 2 * (0.062 + 0.015 * rows))
    assert cost.predict(40) == pytest.approx(2 * 0.662)


def test_only_recent_sizes_are_kept():
    cost = DecodeCost(max_sizes=3)
    for rows in (50, 1, 2, 3):
        for _ in range(3):
            cost.record(rows, 1.0 if rows == 50 else 0.01 * rows)
    assert cost.predict(50) == pytest.approx(0.5)  # the line through 1..3, 50 forgotten


@pytest.mark.parametrize(
    ("rows", "seconds"), [(0, 0.1), (-1, 0.1), (1, -0.1), (1, math.nan), (1, math.inf)]
)
def test_a_nonsense_sample_is_ignored(rows, seconds):
    cost = fitted(*CPU_LIKE)
    cost.record(rows, seconds)
    assert cost.predict(1) == pytest.approx(0.077)


@pytest.mark.parametrize(
    ("base", "slack", "other_s"),
    [(-1, 0.25, 0), (1, -0.1, 0), (1, math.nan, 0), (1, math.inf, 0), (1, 1, -1), (1, 1, math.nan)],
)
def test_wrong_arguments_are_refused(base, slack, other_s):
    with pytest.raises(ValueError, match="must be >= 0"):
        DecodeCost().max_extra_rows(base, slack, other_s)


def test_other_work_in_the_step_counts_to_its_own_time():
    cost = fitted(*CPU_LIKE)
    # A prompt chunk of 0.3 s beside one row: 25% of 0.377 s is 6.28 rows of 0.015 s.
    assert cost.max_extra_rows(1, 0.25, other_seconds=0.3) == 6
    assert cost.max_extra_rows(0, 0.25, other_seconds=0.3) == 6  # (0.362 s: 6.03 rows)
    assert DecodeCost().max_extra_rows(0, 0.25, other_seconds=0.3) == 0  # no line: no guess


@pytest.mark.parametrize(
    ("kwargs", "message"), [({"max_sizes": 1}, "max_sizes"), ({"max_age": 0}, "max_age")]
)
def test_a_model_that_could_never_fit_is_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        DecodeCost(**kwargs)


@settings(max_examples=200, deadline=None)
@given(
    st.floats(0.0, 0.2),
    st.floats(0.0, 0.05),
    st.integers(1, 64),
    st.floats(0.0, 4.0),
)
def test_the_extra_rows_never_pass_the_bound_on_the_fitted_line(a, b, base, slack):
    cost = fitted(a, b)
    extra = cost.max_extra_rows(base, slack)
    if extra is None:
        assert slack > 0
        return
    limit = (1 + slack) * (a + b * base)
    assert a + b * (base + extra) <= limit + 1e-9
    # and the most that fit: one more row passes it (unless nothing grows)
    assert b < 1e-12 or a + b * (base + extra + 1) > limit - 1e-9


def test_a_slope_too_small_to_divide_by_bounds_nothing():
    cost = fitted(0.1, 5e-324)
    assert cost.max_extra_rows(1, 0.25) is None
