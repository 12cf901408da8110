"""The planner's search: the cheapest worker counts (and chunk budget) meeting the SLOs, found by
simulation (`services/planner`), each candidate judged by the same summary `tandem bench` gives.

A configuration *meets* the objectives when every request succeeds (no 429, no timeout) and each
named percentile is within its target. Its goodput counts the requests that, each on its own,
kept within the bound of every figure the SLO names (`request_objectives`). Cost is the number
of workers (prefill + decode: one accelerator each). The search walks the cost upwards (every
cost up to 16 workers, then doubling, then bisecting between the last failing and the first
meeting cost, as meeting the SLOs is monotone in cost for the best split); at each cost it tries
the splits between prefill and decode (all of them, or `max_splits` spread evenly) and every
chunk budget, and stops at the first cost where some configuration meets the objectives.
While doubling, it also stops when a doubling brought the cost level no closer to them (its
configurations simulated to their ends: no fewer errors, no more requests within the bounds, no
missed percentile lower): the workers added sat idle as far as the objectives go, and doubling
on to --max-workers only simulated ever larger idle clusters (minutes).
"""

from __future__ import annotations

import math
import multiprocessing
import re
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field

from loadtest.metrics import RequestRecord, Summary, summarize
from services.planner.profile import WorkerProfile
from services.planner.simulator import SimConfig, SimResult, Simulator
from services.planner.workload import SimRequest
from services.scheduler.core import SchedulerLimits

SLO_KEYS = tuple(f"{m}_{p}" for m in ("ttft", "tpot", "e2e") for p in ("p50", "p90", "p99"))
LINEAR_COSTS = 16  # every cost up to this is tried; beyond, doubling then bisection


class PlanError(ValueError):
    """A wrong plan argument, with the reason."""


def parse_slo(text: str) -> dict[str, float]:
    """'ttft_p99=2s,tpot_p99=100ms' -> {'ttft_p99': 2.0, 'tpot_p99': 0.1} (seconds)."""
    slo: dict[str, float] = {}
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        if not sep or key not in SLO_KEYS:
            raise PlanError(
                f"--slo entry {part!r} must be KEY=VALUE with KEY one of {', '.join(SLO_KEYS)}"
            )
        if key in slo:  # (the second silently replaced the first)
            raise PlanError(f"--slo names {key} twice")
        match = re.fullmatch(r"([0-9]*\.?[0-9]+)(ms|s)?", value.strip())
        if match is None or not 0 < float(match[1]) < math.inf:  # (400 digits read as inf)
            raise PlanError(f"--slo {key} must be a positive time like 2s or 100ms, got {value!r}")
        slo[key] = float(match[1]) / (1000 if match[2] == "ms" else 1)
    return slo


def check_measurable(slo: dict[str, float], requests: list[SimRequest]) -> None:
    """Refuses a TTFT or TPOT objective where no request is streamed: one sent for one response
    has neither (as the bench records it), so every configuration would fail a TTFT objective
    while serving every request within it, up to --max-workers, and meet a TPOT objective of
    any bound, judged on nothing. (Streamed, a TPOT objective with no figure is not judged: all
    one-token outputs.)"""
    if any(r.stream for r in requests):
        return
    named = [key for key in slo if key.startswith(("ttft_", "tpot_"))]
    if named:
        figure = named[0].partition("_")[0].upper()
        raise PlanError(
            f"--slo {named[0]}: no request of the workload is streamed (each has "
            f'"stream": false), so none has a {figure}; name e2e objectives for them'
        )


def check_fits(profile: WorkerProfile, requests: list[SimRequest]) -> None:
    """Refuses a request past a decode worker's KV pool: the core refuses it (400) in every
    configuration, so the search would go on to --max-workers only to say so (and a prompt of
    billions of tokens was built in memory first)."""
    capacity = profile.num_kv_blocks * profile.settings.block_size
    for request in requests:
        needed = request.num_prompt_tokens + request.max_tokens
        if needed > capacity:
            raise PlanError(
                f"a request arriving at {request.arrival_time:g} s (prompt "
                f"{request.num_prompt_tokens} + max_tokens {request.max_tokens} tokens) can never "
                f"fit a decode worker's KV pool of {capacity} tokens (the profile's "
                "settings.kv_cache_bytes): every configuration would refuse it"
            )


def request_objectives(slo: dict[str, float]) -> tuple[float | None, float | None, float | None]:
    """The (TTFT, TPOT, e2e) bounds one request must keep to count in goodput: a request meets
    `ttft_p90=2s` when its own TTFT is within 2 s, whatever the percentile, so of several
    objectives on one figure the tightest bound holds; None where the SLO names none."""

    def bound(metric: str) -> float | None:
        return min((t for key, t in slo.items() if key.startswith(f"{metric}_")), default=None)

    return bound("ttft"), bound("tpot"), bound("e2e")


def to_records(result: SimResult) -> list[RequestRecord]:
    """The simulated lifecycles as the bench's records (no streamed chunks: no ITL; a request
    not streamed has its first token with its response, as the bench records it: none)."""
    return [
        RequestRecord(
            index=r.index,
            max_tokens=r.max_tokens,
            num_prompt_tokens=r.num_prompt_tokens,
            send_time=r.send_time,
            first_token_time=r.first_token_time if r.stream else None,
            finish_time=r.finish_time,
            completion_tokens=r.completion_tokens,
            error=r.error,
            # A failure's end: without it the run's span stopped at its last success.
            failure_time=r.finish_time if r.error is not None else None,
            label=r.label,
            stream=r.stream,
        )
        for r in result.records
    ]


@dataclass
class Candidate:
    num_prefill: int
    num_decode: int
    chunk_budget: int
    summary: Summary
    meets: bool
    utilization: dict[str, float]
    num_preemptions: int
    max_queued: int
    num_events: int
    real_s: float
    # Its simulation stopped once the objectives could no longer be met: why, and when
    # (simulated seconds); its figures are then those of the part simulated.
    cut_short: str | None = None
    cut_at_s: float | None = None

    @property
    def cost(self) -> int:
        return self.num_prefill + self.num_decode

    @property
    def name(self) -> str:
        return f"{self.num_prefill}P{self.num_decode}D chunk {self.chunk_budget}"


def evaluate(
    profile: WorkerProfile,
    requests: list[SimRequest],
    config: SimConfig,
    slo: dict[str, float],
    cut_hopeless: bool = False,
) -> Candidate:
    """Simulates one configuration and judges it; `cut_hopeless`: stop the simulation as soon as
    the objectives can no longer be met (the verdict is the same, found sooner)."""
    result = Simulator(profile, config).run(requests, slo if cut_hopeless else None)
    summary = summarize(to_records(result), *request_objectives(slo))
    within = all(
        getattr(summary, key) is not None and getattr(summary, key) <= target
        for key, target in slo.items()
        if not (key.startswith("tpot") and getattr(summary, key) is None)  # all one-token
    )
    return Candidate(
        num_prefill=config.num_prefill,
        num_decode=config.num_decode,
        chunk_budget=config.max_num_batched_tokens or profile.settings.max_num_batched_tokens,
        summary=summary,
        meets=result.cut_short is None and summary.num_errors == 0 and within,
        utilization={r: result.utilization(r) for r in ("prefill", "decode")},
        num_preemptions=result.num_preemptions,
        max_queued=max((q for _, q, _ in result.queue_timeline), default=0),
        num_events=result.num_events,
        real_s=result.real_s,
        cut_short=result.cut_short,
        cut_at_s=result.cut_at_s,
    )


# (prefill workers, decode workers, chunk budget): one configuration to simulate
Configuration = tuple[int, int, int]
# What every configuration of one plan is simulated with: profile, workload, limits, objectives,
# whether the workers keep prefix caches, whether a hopeless simulation stops.
Work = tuple[WorkerProfile, list[SimRequest], SchedulerLimits, dict[str, float], bool, bool]


class Judges:
    """Simulates configurations: side by side in `jobs` processes, each given the profile and
    the workload once when it starts, or in this process when `jobs` is 1. The answers are the
    same either way (a simulation depends on nothing but its inputs) and come in the order
    asked. A context manager: leaving it stops the processes."""

    def __init__(
        self,
        profile: WorkerProfile,
        requests: list[SimRequest],
        limits: SchedulerLimits,
        slo: dict[str, float],
        jobs: int = 1,
        prefix_cache: bool = False,
        cut_hopeless: bool = True,
    ):
        if jobs < 1:
            raise PlanError(f"jobs must be at least 1, got {jobs}")
        self._work: Work = (profile, requests, limits, slo, prefix_cache, cut_hopeless)
        self._pool: ProcessPoolExecutor | None = None
        if jobs > 1:
            # Forked where the platform can: the workload is then shared, not pickled.
            methods = multiprocessing.get_all_start_methods()
            context = multiprocessing.get_context("fork" if "fork" in methods else None)
            self._pool = ProcessPoolExecutor(
                jobs, mp_context=context, initializer=_hold, initargs=self._work
            )

    def __call__(self, configurations: list[Configuration]) -> list[Candidate]:
        if self._pool is None or len(configurations) == 1:
            return [_judge(self._work, c) for c in configurations]
        return list(self._pool.map(_judged, configurations))

    def whole(self, candidate: Candidate) -> Candidate:
        """The candidate's configuration simulated to its end (in this process)."""
        return _judge((*self._work[:-1], False), _configuration(candidate))

    def wholes(self, candidates: list[Candidate]) -> list[Candidate]:
        """The candidates as simulated to their ends (side by side): those cut short again,
        whole; the others as they are."""
        cut = [c for c in candidates if c.cut_short is not None]
        if self._pool is None or len(cut) <= 1:
            redone = [self.whole(c) for c in cut]
        else:
            redone = list(self._pool.map(_judged_whole, map(_configuration, cut)))
        again = iter(redone)
        return [next(again) if c.cut_short is not None else c for c in candidates]

    def __enter__(self) -> Judges:
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


_held: Work | None = None


def _hold(
    profile: WorkerProfile,
    requests: list[SimRequest],
    limits: SchedulerLimits,
    slo: dict[str, float],
    prefix_cache: bool,
    cut_hopeless: bool,
) -> None:
    """A judging process's start: what every configuration it simulates shares."""
    global _held
    _held = (profile, requests, limits, slo, prefix_cache, cut_hopeless)


def _judged(configuration: Configuration) -> Candidate:
    assert _held is not None, "a judging process starts with _hold"
    return _judge(_held, configuration)


def _judged_whole(configuration: Configuration) -> Candidate:
    assert _held is not None, "a judging process starts with _hold"
    return _judge((*_held[:-1], False), configuration)


def _configuration(candidate: Candidate) -> Configuration:
    return candidate.num_prefill, candidate.num_decode, candidate.chunk_budget


def _judge(work: Work, configuration: Configuration) -> Candidate:
    profile, requests, limits, slo, prefix_cache, cut_hopeless = work
    num_prefill, num_decode, budget = configuration
    config = SimConfig(
        num_prefill, num_decode, limits, max_num_batched_tokens=budget, prefix_cache=prefix_cache
    )
    return evaluate(profile, requests, config, slo, cut_hopeless)


def splits(cost: int, max_splits: int) -> list[tuple[int, int]]:
    """(prefill, decode) pairs adding up to `cost`, at most `max_splits`, spread evenly."""
    num_prefill = list(range(1, cost))
    if len(num_prefill) > max_splits:
        step = (len(num_prefill) - 1) / (max_splits - 1)
        num_prefill = sorted({num_prefill[round(i * step)] for i in range(max_splits)})
    return [(p, cost - p) for p in num_prefill]


@dataclass
class Plan:
    best: Candidate | None
    tried: list[Candidate] = field(default_factory=list)
    real_s: float = 0.0
    # When none meets and the closest was cut short: it again, simulated to its end.
    closest_whole: Candidate | None = None
    # Why the doubling stopped short of max_workers, none meeting (more workers did not help).
    stalled: str | None = None
    num_other_events: int = 0  # of the cut configurations simulated again whole to compare

    @property
    def num_events(self) -> int:
        return sum(c.num_events for c in self.tried) + self.num_other_events

    @property
    def events_per_s(self) -> float:
        return self.num_events / self.real_s if self.real_s > 0 else 0.0

    def runners_up(self, count: int = 3) -> list[Candidate]:
        """The next best: meeting ones by cost then goodput, then the closest failures."""
        others = [c for c in self.tried if c is not self.best]
        return sorted(others, key=_rank)[:count]


def _rank(candidate: Candidate) -> tuple:
    """Meeting ones first, cheapest then best goodput; then failing ones, closest first: those
    simulated to the end by goodput, then those cut short, the latest cut first."""
    goodput = candidate.summary.goodput_rps or 0.0
    if candidate.meets:
        return (0, candidate.cost, -goodput, candidate.num_prefill)
    if candidate.cut_at_s is not None:
        return (2, -candidate.cut_at_s, candidate.cost, candidate.num_prefill)
    return (1, -goodput, candidate.cost, candidate.num_prefill)


def search(
    max_workers: int,
    chunk_budgets: list[int],
    judge: Callable[[list[Configuration]], list[Candidate]],
    max_splits: int = 8,
    slo: dict[str, float] | None = None,
    whole: Callable[[list[Candidate]], list[Candidate]] | None = None,
) -> Plan:
    """The cheapest meeting configuration within `max_workers` (see the module doc). `judge`
    simulates the configurations of one cost (all at once: it may run them side by side) and
    returns their candidates in the same order. With `slo` and `whole` (candidates simulated to
    their ends, `Judges.wholes`), a doubling that brings no cost level closer to `slo` stops
    the search (`Plan.stalled`)."""
    started = time.perf_counter()
    plan = Plan(best=None)

    def level_at(cost: int) -> list[Candidate]:
        found = judge(
            [(p, d, budget) for p, d in splits(cost, max_splits) for budget in chunk_budgets]
        )
        plan.tried.extend(found)
        return found

    redone: dict[str, Candidate] = {}  # cut configurations simulated again whole, by name

    def whole_level(level: list[Candidate]) -> list[Candidate]:
        assert whole is not None, "only a search given `whole` compares whole levels"
        missing = [c for c in level if c.cut_short is not None and c.name not in redone]
        for candidate in whole(missing) if missing else []:
            redone[candidate.name] = candidate
            plan.num_other_events += candidate.num_events
        return [redone.get(c.name, c) for c in level]

    def best_of(level: list[Candidate]) -> Candidate | None:
        meeting = sorted((c for c in level if c.meets), key=_rank)
        return meeting[0] if meeting else None

    low, cost = 1, 2  # low: the highest cost known to fail
    previous: list[Candidate] = []  # the level of cost `low`
    while cost <= max_workers:
        level = level_at(cost)
        best = best_of(level)
        if best is not None:
            plan.best = best
            break
        compare = slo is not None and whole is not None and cost > LINEAR_COSTS
        if compare and not _came_closer(previous, level, slo or {}, whole_level):
            plan.stalled = (
                f"the {cost}-worker configurations came no closer than the {low}-worker "
                "ones (simulated to their ends: no fewer errors, no more requests within "
                "the bounds, no missed percentile lower), so more workers do not help"
            )
            break
        previous, low = level, cost
        cost = cost + 1 if cost < LINEAR_COSTS else min(cost * 2, max(max_workers, cost + 1))
    if plan.best is not None:
        high = plan.best.cost
        while high - low > 1:
            middle = (low + high) // 2
            best = best_of(level_at(middle))
            if best is not None:
                plan.best, high = best, middle
            else:
                low = middle
    plan.real_s = time.perf_counter() - started
    return plan


def _came_closer(
    before: list[Candidate],
    after: list[Candidate],
    slo: dict[str, float],
    whole: Callable[[list[Candidate]], list[Candidate]],
) -> bool:
    """Whether the (costlier) level `after` came any closer to the objectives than `before`,
    over its best configurations. Cut short later is closer (a cheap answer); else both levels
    are simulated to their ends and compared: fewer errors, more requests within every bound,
    or a missed percentile lower (beyond rounding) is closer. Nothing of that, and adding
    workers did nothing for the objectives: what they need is not capacity."""
    cut_before = [c.cut_at_s for c in before if c.cut_at_s is not None]
    cut_after = [c.cut_at_s for c in after if c.cut_at_s is not None]
    all_cut = len(cut_before) == len(before) and len(cut_after) == len(after)
    if all_cut and max(cut_after) > max(cut_before):
        return True
    before, after = whole(before), whole(after)
    if _fewest_errors(after) < _fewest_errors(before) or _most_good(after) > _most_good(before):
        return True
    for key, target in slo.items():
        was, now = _lowest(before, key), _lowest(after, key)
        if was > target and now < was * (1 - 1e-9):
            return True
    return False


def _fewest_errors(level: list[Candidate]) -> int:
    return min(c.summary.num_errors for c in level)


def _most_good(level: list[Candidate]) -> int:
    """The most requests one configuration served within every bound."""
    return max(round((c.summary.goodput_rps or 0.0) * c.summary.wall_s) for c in level)


def _lowest(level: list[Candidate], key: str) -> float:
    figures = [getattr(c.summary, key) for c in level]
    return min((f for f in figures if f is not None), default=math.inf)
