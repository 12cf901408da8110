"""Which prefill worker computes a prompt: the one with the least predicted time to first token.

A worker's predicted wait is the prompt work it already holds plus the part of this prompt it
would compute (the tokens its cached prefix does not cover), at its measured prefill rate. So a
worker holding the prompt's prefix wins while its queue is short, and loses as soon as another
worker's shorter queue more than makes up for computing the prefix again: affinity never beats a
far shorter wait, and one hot prefix does not pile every request onto one worker. The weights
tilt the balance (`queued` > `uncached` favours spreading load, the reverse favours cache hits).
Pure: candidates in, a choice out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_TOKENS_PER_S = 300.0  # until a worker has measured its rate (a CPU's order of magnitude)
RATE_STEPS_PER_DOUBLING = 16  # routing reads a measured rate to within 2.2%
# Prompt tokens a second past any worker's: a rate above is a broken report. (The grid raises on
# the largest floats, and a few of them would sum to infinity in the registry's total.)
MAX_TOKENS_PER_S = 1e12


def routing_rate(tokens_per_s: float) -> float:
    """A worker's measured prefill rate as routing reads it: on a grid of 16 steps a doubling
    (each 4.4% above the last). The measurement is a moving average that never repeats itself
    exactly, so a thousand workers of one kind would report a thousand rates, and the index,
    which keeps workers per rate (`candidates.py`), would hand the placement all thousand to
    compare; on the grid they are a few groups, and rates that close are noise, not a reason to
    prefer one worker. 0 (not measured) stays 0, and so does a rate no worker can have (NaN,
    infinite, negative, past `MAX_TOKENS_PER_S`: a heartbeat's floats are not range-checked on
    the wire)."""
    if not 0.0 < tokens_per_s <= MAX_TOKENS_PER_S:
        return 0.0
    steps = round(math.log2(tokens_per_s) * RATE_STEPS_PER_DOUBLING)
    return 2.0 ** (steps / RATE_STEPS_PER_DOUBLING)


@dataclass(frozen=True)
class RoutingWeights:
    queued: float = 1.0  # weight of the prompt tokens a worker already holds
    uncached: float = 1.0  # weight of the tokens of this prompt it would compute

    def __post_init__(self) -> None:
        if self.queued < 0 or self.uncached < 0 or self.queued + self.uncached == 0:
            raise ValueError(
                f"routing weights must be >= 0 and not both 0, got {self.queued}, {self.uncached}"
            )


@dataclass(frozen=True)
class PrefillCandidate:
    peer_id: str
    num_queued_tokens: int  # prompt tokens it holds and has not finished
    num_cached_tokens: int  # of this prompt, held in its cache (as the index knows)
    tokens_per_s: float = 0.0  # its measured prefill rate; 0: not measured yet
    room: int = 0  # room left in its window: the tie-breaker, more is better


def predicted_wait_s(
    candidate: PrefillCandidate, num_prompt_tokens: int, weights: RoutingWeights
) -> float:
    return wait_s(
        candidate.num_queued_tokens,
        candidate.num_cached_tokens,
        candidate.tokens_per_s,
        num_prompt_tokens,
        weights,
    )


def wait_s(
    num_queued_tokens: int,
    num_cached_tokens: int,
    tokens_per_s: float,
    num_prompt_tokens: int,
    weights: RoutingWeights,
) -> float:
    """`predicted_wait_s` of a candidate with these figures (no candidate built)."""
    rate = tokens_per_s if tokens_per_s > 0 else DEFAULT_TOKENS_PER_S
    uncached = max(0, num_prompt_tokens - num_cached_tokens)
    return (weights.queued * num_queued_tokens + weights.uncached * uncached) / rate


MAX_STEP_S = 3600.0  # past it a reported step duration is no measurement


def routing_step_s(step_s: float) -> float:
    """A decode worker's reported step duration as routing reads it: one no worker can have
    (NaN, infinite, negative, past an hour: a heartbeat's floats are not range-checked on the
    wire) is taken as endless, so the worker prefills nothing locally (NaN made it never, a
    negative one always, whatever its load)."""
    return step_s if 0.0 <= step_s <= MAX_STEP_S else math.inf


def local_prefill_wait_s(
    step_s: float, num_running: int, num_uncached: int, tokens_per_s: float
) -> float:
    """A decode worker prefilling a prompt's uncached suffix itself: its first token waits for the
    step in progress (half of one, on average) and the step that takes the suffix in beside the
    running sequences; an idle worker starts at once. `step_s`: its recent step duration."""
    rate = tokens_per_s if tokens_per_s > 0 else DEFAULT_TOKENS_PER_S
    steps = 1.5 * step_s if num_running > 0 else 0.0
    return steps + num_uncached / rate


def choose_prefill(
    candidates: Sequence[PrefillCandidate],
    num_prompt_tokens: int,
    weights: RoutingWeights | None = None,
) -> PrefillCandidate:
    if not candidates:
        raise ValueError("no prefill candidate")
    weights = weights or RoutingWeights()
    return min(
        candidates,
        key=lambda c: (predicted_wait_s(c, num_prompt_tokens, weights), -c.room, c.peer_id),
    )


def decode_affinity(
    num_cached_tokens: int, num_tokens: int, num_requests: int, max_num_seqs: int
) -> float:
    """How much to prefer a decode worker for a request: the share of its KV the worker holds
    already (those blocks are not sent) less the share of its seats taken. A conversation thus
    returns to the decode worker holding its previous turns unless that worker is far busier
    than another, and a prefix every worker holds (a shared system prompt) tilts nothing."""
    held = num_cached_tokens / num_tokens if num_tokens > 0 else 0.0
    busy = num_requests / max_num_seqs if max_num_seqs > 0 else 1.0
    return held - busy
