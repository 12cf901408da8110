"""A worker's measured pace, as its heartbeat reports it to the scheduler's routing: its recent
step duration and its prompt tokens per second, each a moving average. The real workers
(`services/worker/loop.py`, the engine's preemption costs) and the planner's simulated ones
measure them alike, so the scheduler core routes a simulation as it routes a cluster."""

from __future__ import annotations

STEP_SMOOTHING = 0.3  # weight of the newest step in the moving average of step durations
RATE_SMOOTHING = 0.3  # weight of the newest measurement in a rate's moving average
INITIAL_PREFILL_TOKENS_PER_S = 500.0  # until measured: two CPU cores, a 135M-parameter model
MIN_MEASURED_PREFILL_TOKENS = 64  # prompt tokens in a step that make it a prefill rate sample


def smoothed(average: float, newest: float) -> float:
    """The moving average of step durations; the first step stands alone."""
    return newest if average == 0 else (1 - STEP_SMOOTHING) * average + STEP_SMOOTHING * newest


def smoothed_rate(old: float, new: float) -> float:
    return (1 - RATE_SMOOTHING) * old + RATE_SMOOTHING * new


def prefill_rate(old: float, num_prompt_tokens: int, seconds: float) -> float:
    """The prefill rate after a step that computed `num_prompt_tokens` prompt tokens in
    `seconds` (decode tokens riding along count in the time, not the tokens): a sample only
    when the step held enough prompt to measure it."""
    if num_prompt_tokens < MIN_MEASURED_PREFILL_TOKENS or seconds <= 0:
        return old
    return smoothed_rate(old, num_prompt_tokens / seconds)
