"""Whether a simulation can still meet its objectives, watched as it runs, so that `tandem plan`
stops simulating a configuration the moment it cannot. Most configurations a search tries are
too small for the load, and those are the slowest to simulate (their queues, and the core's
work, grow with simulated time); a plan's answer never depends on how badly one misses.

A percentile is certain to miss its target once enough requests are over it: of n values, the
q-th percentile (linear between closest ranks, as `loadtest.metrics.percentile`) is at least the
value of rank floor((n - 1) q / 100) in ascending order, which is over the target once
n - floor((n - 1) q / 100) values are. A request is counted over when it becomes so for good: no
first token (or no end) when the target has passed since its arrival, or a finished request's
time per output token over its target. Any failed request is a miss outright (a configuration
meets its objectives only when every request succeeds). Counting over only what is certain, the
watch never stops a simulation whose configuration would have met its objectives.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

METRICS = ("ttft", "tpot", "e2e")


@dataclass(frozen=True)
class Objective:
    metric: str  # ttft, tpot or e2e
    percentile: float  # 0..100
    target_s: float

    @property
    def name(self) -> str:
        return f"{self.metric}_p{self.percentile:g}"

    @property
    def waits(self) -> bool:
        """Missed by a request still waiting (for its first token, or its end) at the target."""
        return self.metric != "tpot"


def objectives(slo: Mapping[str, float]) -> list[Objective]:
    """{'ttft_p99': 2.0, ...} (as `tandem plan --slo` parses it) -> the objectives."""
    parsed = []
    for key, target_s in slo.items():
        metric, _, percentile = key.partition("_p")
        if metric not in METRICS or not percentile.isdigit() or not 0 <= int(percentile) <= 100:
            raise ValueError(f"an objective is <ttft|tpot|e2e>_p<0-100>, got {key!r}")
        if not target_s > 0:
            raise ValueError(f"{key}'s target must be > 0 seconds, got {target_s}")
        parsed.append(Objective(metric, float(percentile), float(target_s)))
    return parsed


def num_over_to_miss(num_values: int, percentile: float) -> int:
    """How many of `num_values` over a target put their `percentile` over it for certain."""
    return num_values - math.floor((num_values - 1) * percentile / 100)


class SloWatch:
    """Counts, per objective, the requests certain to be over its target; `verdict` says why the
    objectives can no longer be met (None while they still can)."""

    def __init__(
        self,
        slo: Mapping[str, float],
        num_requests: int,
        num_multi_token: int,
        num_streamed: int | None = None,
    ):
        """`num_multi_token`: the streamed requests asking for two or more output tokens (those
        alone have a time per output token; a failed one is a miss of its own); `num_streamed`:
        those with a TTFT (None: all), a request answered in one response having none."""
        self.objectives = objectives(slo)
        self._num_over = [0] * len(self.objectives)
        num_values = {
            "ttft": num_requests if num_streamed is None else num_streamed,
            "tpot": num_multi_token,
            "e2e": num_requests,
        }
        self._needed = [
            num_over_to_miss(num_values[o.metric], o.percentile) for o in self.objectives
        ]
        self.verdict: str | None = None

    def over(self, index: int) -> None:
        """One more request is over objective `index`'s target for good."""
        self._num_over[index] += 1
        if self._num_over[index] >= self._needed[index] and self.verdict is None:
            objective = self.objectives[index]
            self.verdict = (
                f"{objective.name} can no longer be within {objective.target_s:g} s "
                f"({self._num_over[index]} requests over it)"
            )

    def finished(self, tpot_s: float | None) -> None:
        """A request succeeded, with this time per output token (None: a one-token output)."""
        if tpot_s is None:
            return
        for index, objective in enumerate(self.objectives):
            if objective.metric == "tpot" and tpot_s > objective.target_s:
                self.over(index)

    def failed(self, error: str) -> None:
        if self.verdict is None:
            self.verdict = f"a request failed ({error})"
