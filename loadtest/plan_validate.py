"""The simulator against the real cluster: simulated and measured TTFT and TPOT, side by side.

For each configuration (`--configs 1P1D,1P2D,2P1D`) it replays one workload (a `tandem bench`
JSONL file, arrivals honored) twice: through the simulator with a profile, and through a real
local cluster (`tandem up` with that many workers, `loadtest/served.py`). It prints, per
configuration, TTFT and TPOT p50/p90 simulated, measured and their relative difference (the
issue's bar: within 20%), and whether the two rank the configurations alike (by mean of the
four figures). Every worker of a local cluster shares this machine's cores, so the profile must
be measured under the same sharing: `--profile` per configuration (`1P1D=a.json,...`), or one
profile for all, or `measure`: each configuration profiled here just before its runs, as many
`tandem profile --threads 1` at once as it has workers, their median (`profile_at_once.py`;
a shared machine's speed moves within hours by more than the bar). Run it on a quiet
machine; `--repeats 3` compares the medians of three measured runs per configuration (one
run's figures spread by tens of percent).

Each run is simulated three ways, each with its table of figures, of the workers' steps (read
from the cluster's /metrics around the run: steps, time inside them, their p50/p90 duration,
sequences per decode step) beside the simulation's, and its verdict:

- `profile`: the configuration's profile, measured with as many profiles running at once as
  the cluster has workers (every step as if all were busy);
- `shared cores`: each step timed by the profile measured with as many workers busy as are when
  it starts (`--shared-cores`: profiles measured alone, with two, with three at once), since a
  local cluster's workers share the machine's cores only while they are all busy;
- `slowed`: the profile slowed by the run's own step times (the prefill workers' busy time
  against the simulation's, the decode workers' mean step against the profile's at their mean
  batch): the configuration profiled as it runs, which also takes in the gateway's, the
  scheduler's and the client's share of the cores;
- `fitted`: as `slowed`, but the decode step time fitted per batch size (the decode workers
  count their steps, seconds, sequences and the context those attended per batch size range;
  each range is fitted at its own context): where the cores are shared with a busy prefill
  worker, big batches slow down more than small ones.

With `--prefix-cache on` (the default, as `tandem up`'s workers) the cluster's workers keep
prefix caches and so do the simulated ones (`services/planner/caches.py`), the workload's token
ids given to both; `off` turns both off.

It also prints where the cores went during each measured run (`loadtest/process_cpu.py`): the
workers' CPU seconds, the gateway's, the scheduler's, the load client's, and the rest's share
of the machine and CPU per output token.

    .venv/bin/python -m loadtest.plan_validate --workload loadtest/workloads/mixed64.jsonl \\
        --configs 1P1D,1P2D,2P1D  # the shipped shared-core profiles of this machine kind
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import re
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.client import run_workload
from loadtest.metrics import Summary, summarize
from loadtest.plan_search import to_records
from loadtest.process_cpu import CLIENT, cpu_seconds_by_role, difference
from loadtest.profile_at_once import brief, measure_at_once
from loadtest.served import environment, tandem_up
from loadtest.worker_metrics import BatchRange, WorkerCounters, worker_counters
from loadtest.workload import WorkloadRequest, read_workload
from services.planner.profile import ProfileError, SharedCores, WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import CHARS_PER_TOKEN, SimRequest
from shared.config import parse_value
from shared.metrics import STEP_BUCKETS

FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
# The workers' setting (`--prefix-cache` sets it for the clusters it starts).
PREFIX_CACHING_ENV = "TANDEM_ENABLE_PREFIX_CACHING"
# Profiles measured on this machine kind as `tandem up`'s workers share it: one torch thread
# each, two (1P1D) or three (1P2D, 2P1D) profiles measured at once.
SHARED_PROFILES = (
    "1P1D=loadtest/profiles/cpu-smollm2-1thread-2shared.json,"
    "1P2D=loadtest/profiles/cpu-smollm2-1thread-3shared.json,"
    "2P1D=loadtest/profiles/cpu-smollm2-1thread-3shared.json"
)
# The same machine kind measured with one, two and three `tandem profile --threads 1` at once.
SHARED_CORES = (
    "loadtest/profiles/cpu-smollm2-1thread.json,"
    "loadtest/profiles/cpu-smollm2-1thread-2shared.json,"
    "loadtest/profiles/cpu-smollm2-1thread-3shared.json"
)
TOLERANCE = 0.2
# `--profile measure`, `--shared-cores measure`: profiled here, minutes before the runs.
MEASURE = "measure"


class ValidateError(ValueError):
    pass


def caching_default() -> str:
    """`--prefix-cache`'s default: the workers' own setting from the environment, read as they
    read it, else on (as `tandem up`)."""
    raw = os.environ.get(PREFIX_CACHING_ENV)
    return "on" if raw is None or parse_value(raw, bool) else "off"


def parse_configs(text: str) -> list[tuple[int, int]]:
    configs = []
    for part in text.split(","):
        match = re.fullmatch(r"([1-9][0-9]*)P([1-9][0-9]*)D", part.strip())
        if match is None:
            raise ValidateError(f"--configs entries look like 1P2D; got {part!r}")
        configs.append((int(match[1]), int(match[2])))
    return configs


def parse_profiles(
    text: str, configs: list[tuple[int, int]]
) -> dict[tuple[int, int], WorkerProfile]:
    """One profile file for all, or NAME=file per configuration."""
    if "=" not in text:
        profile = WorkerProfile.load(text)
        return {config: profile for config in configs}
    by_name = {}
    for part in text.split(","):
        name, sep, path = part.strip().partition("=")
        if not sep:
            raise ValidateError(f"--profile entries look like 1P2D=FILE; got {part!r}")
        by_name[name] = path
    profiles = {}
    for p, d in configs:
        name = f"{p}P{d}D"
        if name not in by_name:
            raise ValidateError(f"--profile names no file for {name}")
        profiles[(p, d)] = WorkerProfile.load(by_name[name])
    return profiles


@dataclass(frozen=True)
class StepTimes:
    """One role's engine steps over a run, all its workers together."""

    steps: float
    busy_s: float
    sequences: float = 0.0  # decode: sequences summed over its steps
    # Steps by duration: [i] in (STEP_BUCKETS[i-1], STEP_BUCKETS[i]], the last beyond them all.
    step_counts: tuple[float, ...] = ()
    # Decode: per batch size range, (steps, seconds, sequences, context tokens).
    by_batch: dict[str, BatchRange] = dataclasses.field(default_factory=dict)
    # Each worker's steps, most first: how the core spread the work (a run where one of two
    # decode workers took every request reads as (687, 0)).
    worker_steps: tuple[float, ...] = ()

    @property
    def mean_step_s(self) -> float:
        return self.busy_s / self.steps if self.steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0

    def step_quantile(self, q: float) -> float | None:
        """The q-quantile of the step durations, linear within its bucket (as Prometheus'
        histogram_quantile); None without steps."""
        total = sum(self.step_counts)
        if not total:
            return None
        rank, seen = q * total, 0.0
        for i, count in enumerate(self.step_counts):
            if count and seen + count >= rank:
                if i == len(STEP_BUCKETS):
                    return STEP_BUCKETS[-1]  # beyond the last bound: that bound, at least
                lower = STEP_BUCKETS[i - 1] if i else 0.0
                return lower + (STEP_BUCKETS[i] - lower) * (rank - seen) / count
            seen += count
        return STEP_BUCKETS[-1]


Run = tuple[Summary, dict[str, StepTimes]]  # the figures, and the steps by role


def simulated(
    profile: WorkerProfile,
    requests: list[WorkloadRequest],
    p: int,
    d: int,
    shared: SharedCores | None = None,
    prefix_cache: bool = False,
) -> Run:
    sim_requests = [
        SimRequest(
            r.arrival_time,
            # (Text alone: counted as `tandem plan` reads such a line, not as one token.)
            r.num_prompt_tokens or max(1, len(r.prompt) // CHARS_PER_TOKEN),
            r.max_tokens,
            label=r.label,
            prompt_token_ids=tuple(r.prompt_token_ids) if r.prompt_token_ids else None,
            stream=r.stream,
        )
        for r in requests
    ]
    config = SimConfig(p, d, prefix_cache=prefix_cache)
    result = Simulator(profile, config, shared).run(sim_requests)
    steps = {
        role: StepTimes(
            sum(s.num_steps for s in stats.values()),
            sum(s.busy_s for s in stats.values()),
            sum(s.num_step_sequences for s in stats.values()),
            tuple(map(sum, zip(*(s.step_counts for s in stats.values()), strict=True))),
            _summed_ranges([s.by_batch for s in stats.values()]),
            most_first(s.num_steps for s in stats.values()),
        )
        for role, stats in (("prefill", result.prefill_stats), ("decode", result.decode_stats))
    }
    return summarize(to_records(result)), steps


def most_first(worker_steps: Iterable[float]) -> tuple[float, ...]:
    return tuple(sorted(worker_steps, reverse=True))


def _summed_ranges(per_worker: list[dict[str, list[float]]]) -> dict[str, BatchRange]:
    summed: dict[str, list[float]] = {}
    for ranges in per_worker:
        _add_ranges(summed, ranges)
    return {label: tuple(counts) for label, counts in summed.items()}


def _add_ranges(
    into: dict[str, list[float]],
    ranges: Mapping[str, Sequence[float]],
    earlier: Mapping[str, Sequence[float]] | None = None,
) -> None:
    """Adds each batch range's counts (less `earlier`'s, a previous reading) into `into`."""
    for label, counts in ranges.items():
        before = (earlier or {}).get(label, (0.0,) * len(counts))
        kept = into.setdefault(label, [0.0] * len(counts))
        for i, count in enumerate(counts):
            kept[i] += count - before[i]


def measured(
    requests: list[WorkloadRequest], p: int, d: int, extra: list[str], caches: bool
) -> tuple[Run, dict[str, float]]:
    """The run's figures and steps, and the CPU seconds each role's processes (and the load
    client) used during it."""
    settings = {PREFIX_CACHING_ENV: "true" if caches else "false"}
    with environment(settings), tandem_up(p, d, extra) as cluster:
        before = worker_counters(httpx.get(cluster.url + "/metrics", timeout=30).text)
        cpu_before = cpu_seconds_by_role(cluster.process.pid)
        result = asyncio.run(run_workload(cluster.url, "smollm2", requests, name=f"{p}P{d}D"))
        cpu = difference(cpu_before, cpu_seconds_by_role(cluster.process.pid))
        after = worker_counters(httpx.get(cluster.url + "/metrics", timeout=30).text)
    return (result.summary, role_steps(before, after)), cpu


WORKER_ROLES = ("prefill", "decode")


def cpu_table(rows: dict[str, tuple[Summary, dict[str, float]]], num_cores: int) -> str:
    """Where the machine's cores went during each measured run: the workers, and the rest (the
    gateway, the scheduler, the batch service, `tandem up`, the load client), as core-seconds,
    as a share of all cores over the run, and per output token streamed."""
    lines = [
        f"{'config':<6} {'wall s':>7} {'workers':>8} {'gateway':>8} {'sched.':>7} "
        f"{'client':>7} {'others':>7} {'rest/cores':>11} {'rest ms/token':>14}"
    ]
    for name, (summary, cpu) in rows.items():
        workers = sum(cpu.get(role, 0.0) for role in WORKER_ROLES)
        gateway, scheduler, client = (cpu.get(r, 0.0) for r in ("gateway", "scheduler", CLIENT))
        rest = sum(cpu.values()) - workers
        others = rest - gateway - scheduler - client
        share = rest / (summary.wall_s * num_cores) if summary.wall_s else 0.0
        per_token = rest * 1e3 / summary.output_tokens if summary.output_tokens else 0.0
        lines.append(
            f"{name:<6} {summary.wall_s:>7.1f} {workers:>8.1f} {gateway:>8.1f} {scheduler:>7.1f} "
            f"{client:>7.1f} {others:>7.1f} {share:>11.0%} {per_token:>14.2f}"
        )
    return "\n".join(lines)


def median_run(runs: list[Run]) -> Run:
    """Several measured runs of one configuration as one: each figure the median over the runs
    that have it; the other fields and the steps those of the first run."""
    first = runs[0][0]
    medians = {}
    for figure in FIGURES:
        values = [getattr(summary, figure) for summary, _ in runs]
        present = [v for v in values if v is not None]
        medians[figure] = statistics.median(present) if present else None
    return dataclasses.replace(first, **medians), runs[0][1]


def role_steps(
    before: dict[str, WorkerCounters], after: dict[str, WorkerCounters]
) -> dict[str, StepTimes]:
    """What each role's workers did between two readings of their counters."""
    totals: dict[str, list] = {}
    for peer, end in after.items():
        start = before.get(peer, WorkerCounters(end.role))
        total = totals.setdefault(end.role, [0.0, 0.0, 0.0, [0.0] * len(end.step_buckets), {}, []])
        total[0] += end.steps - start.steps
        total[1] += end.busy_s - start.busy_s
        total[2] += end.batch_sequences - start.batch_sequences
        cumulated = [b - a for a, b in zip(start.step_buckets, end.step_buckets, strict=True)]
        for i, count in enumerate(cumulated):  # back to counts per bucket
            total[3][i] += count - (cumulated[i - 1] if i else 0.0)
        _add_ranges(total[4], end.by_batch, start.by_batch)
        total[5].append(end.steps - start.steps)
    return {
        role: StepTimes(
            steps,
            busy,
            sequences,
            tuple(counts),
            {k: tuple(v) for k, v in by_batch.items()},
            most_first(per_worker),
        )
        for role, (steps, busy, sequences, counts, by_batch, per_worker) in totals.items()
    }


def slow_down(
    profile: WorkerProfile,
    real: dict[str, StepTimes],
    sim: dict[str, StepTimes],
    requests: list[WorkloadRequest],
) -> tuple[float, float]:
    """(prefill, decode) factors by which the run's steps were slower than the profile's: the
    prefill workers' busy time against the simulation's (the same prompts, chunked alike), the
    decode workers' mean step against the profile's at their mean batch and the workload's mean
    context (prompt and half the output)."""
    prefill = real["prefill"].busy_s / sim["prefill"].busy_s
    context = _mean_context(requests)
    decode = real["decode"].mean_step_s / profile.decode_time(real["decode"].mean_batch, context)
    return prefill, decode


MIN_STEPS_PER_BATCH_RANGE = 5  # fewer steps in a batch size range: too few to fit it by


def batch_factors(
    profile: WorkerProfile, real: StepTimes, requests: list[WorkloadRequest]
) -> list[tuple[float, float]]:
    """(mean batch, factor) per batch size range the decode workers stepped in: their mean step
    there against the profile's at that batch and the range's own mean context per sequence
    (the workload's, as `slow_down`, from workers that do not count it). Ranges with too few
    steps are left out."""
    factors = []
    for steps, seconds, sequences, context_tokens in real.by_batch.values():
        if steps >= MIN_STEPS_PER_BATCH_RANGE:
            batch = sequences / steps
            context = context_tokens / sequences if context_tokens else _mean_context(requests)
            factors.append((batch, seconds / steps / profile.decode_time(batch, context)))
    return factors


def _mean_context(requests: list[WorkloadRequest]) -> float:
    return sum((r.num_prompt_tokens or 1) + r.max_tokens / 2 for r in requests) / len(requests)


def steps_table(rows: dict[str, tuple[dict[str, StepTimes], dict[str, StepTimes]]]) -> str:
    header = (
        "steps sim/meas",
        "mean step ms",
        "step p50 ms",
        "step p90 ms",
        "busy s",
        "batch",
        "steps per worker",
    )
    widths = (15, 14, 13, 13, 13, 11, 17)
    lines = [f"{'config':<6} {'role':<8} " + " ".join(
        f"{h:>{w}}" for h, w in zip(header, widths, strict=True)
    )]  # fmt: skip
    for name, (sim, real) in rows.items():
        for role in ("prefill", "decode"):
            s, m = sim[role], real.get(role, StepTimes(0, 0))
            cells = [
                (s.steps, m.steps, "{:.0f}"),
                (s.mean_step_s * 1e3, m.mean_step_s * 1e3, "{:.0f}"),
                (_ms_or_none(s.step_quantile(0.5)), _ms_or_none(m.step_quantile(0.5)), "{}"),
                (_ms_or_none(s.step_quantile(0.9)), _ms_or_none(m.step_quantile(0.9)), "{}"),
                (s.busy_s, m.busy_s, "{:.1f}"),
                (s.mean_batch, m.mean_batch, "{:.1f}"),
                (_per_worker(s.worker_steps), _per_worker(m.worker_steps), "{}"),
            ]
            shown = [f"{fmt.format(a)} / {fmt.format(b)}" for a, b, fmt in cells]
            lines.append(
                f"{name:<6} {role:<8} "
                + " ".join(f"{c:>{w}}" for c, w in zip(shown, widths, strict=True))
            )
    return "\n".join(lines)


def _per_worker(worker_steps: tuple[float, ...]) -> str:
    return "+".join(f"{steps:.0f}" for steps in worker_steps) or "-"


def batch_table(rows: dict[str, tuple[dict[str, StepTimes], dict[str, StepTimes]]]) -> str:
    """Decode steps by batch size range, simulated against measured: how many, how long, at
    what context per sequence (a range whose steps are longer, or more, than simulated is where
    the TPOT goes missing)."""
    header = ("steps sim/meas", "mean step ms", "context/seq")
    widths = (15, 15, 13)
    lines = [f"{'config':<6} {'batch':<7} " + " ".join(
        f"{h:>{w}}" for h, w in zip(header, widths, strict=True)
    )]  # fmt: skip
    for name, (sim, real) in rows.items():
        s, m = sim["decode"].by_batch, real.get("decode", StepTimes(0, 0)).by_batch
        for label in sorted(s.keys() | m.keys(), key=float):
            cells = [_range_cells(s.get(label)), _range_cells(m.get(label))]
            shown = [f"{a} / {b}" for a, b in zip(*cells, strict=True)]
            lines.append(
                f"{name:<6} {label:<7} "
                + " ".join(f"{c:>{w}}" for c, w in zip(shown, widths, strict=True))
            )
    return "\n".join(lines)


def _range_cells(counts: BatchRange | None) -> tuple[str, str, str]:
    if not counts or not counts[0]:
        return "0", "-", "-"
    steps, seconds, sequences, context_tokens = counts
    context = f"{context_tokens / sequences:.0f}" if context_tokens else "-"
    return f"{steps:.0f}", f"{seconds / steps * 1e3:.0f}", context


def _ms_or_none(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def relative(simulated_s: float | None, measured_s: float | None) -> float | None:
    if simulated_s is None or not measured_s:
        return None
    return (simulated_s - measured_s) / measured_s


def table(rows: dict[str, tuple[Summary, Summary]]) -> str:
    header = f"{'config':<6}" + "".join(f" {f + ' sim/meas ms (diff)':>30}" for f in FIGURES)
    lines = [header]
    for name, (sim, real) in rows.items():
        cells = []
        for figure in FIGURES:
            s, m = getattr(sim, figure), getattr(real, figure)
            diff = relative(s, m)
            shown = "-" if diff is None else f"{diff:+.0%}"
            cells.append(f" {_ms(s):>10} / {_ms(m):>8} ({shown:>5})")
        lines.append(f"{name:<6}" + "".join(cells))
    return "\n".join(lines)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def ranking(rows: dict[str, tuple[Summary, Summary]], which: int) -> list[str]:
    def score(name: str) -> float:
        summary = rows[name][which]
        return sum(getattr(summary, f) or 0.0 for f in FIGURES)

    return sorted(rows, key=score)


def within(rows: dict[str, tuple[Summary, Summary]]) -> bool:
    return all(
        (diff := relative(getattr(sim, f), getattr(real, f))) is not None and abs(diff) <= TOLERANCE
        for sim, real in rows.values()
        for f in FIGURES
    )


# The models a run is simulated with, in the order they are printed.
MODELS = {
    "profile": "the configuration's profile, as measured",
    "shared cores": "shared cores: each step timed by the profile measured with as many busy",
    "slowed": "the profile slowed by the run's own step times",
    "fitted": "the profile fitted to the run's own steps: prefill as slowed, decode per batch size",
}


def main(argv: list[str] | None = None) -> int:
    try:
        default_caching = caching_default()
    except ValueError as error:
        print(f"plan_validate: {PREFIX_CACHING_ENV}: {error}", file=sys.stderr)
        return 2
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="loadtest/workloads/mixed64.jsonl")
    parser.add_argument(
        "--profile",
        default=SHARED_PROFILES,
        help="one profile file, NAME=file per configuration, or `measure`: each configuration "
        "profiled here just before its runs, as many at once as it has workers",
    )
    parser.add_argument(
        "--shared-cores",
        default=SHARED_CORES,
        help="profiles measured with 1, 2, ... workers busy at once, comma-separated, for the "
        "shared-cores model ('' for none; `measure`: profiled here before the first run)",
    )
    parser.add_argument(
        "--profile-repeats", type=int, default=5, help="with `measure`: timed runs per point"
    )
    parser.add_argument(
        "--profile-args", default="", help="with `measure`: extra `tandem profile` flags"
    )
    parser.add_argument("--configs", default="1P1D,1P2D,2P1D")
    parser.add_argument("--cluster-args", default="", help="extra `tandem up` flags, one string")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="measured runs per configuration; their medians are compared (the real cluster's "
        "figures spread by tens of percent between runs of one workload)",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=("on", "off"),
        default=default_caching,
        help=f"the workers' prefix caches, in the cluster and in the simulation alike (default: "
        f"{PREFIX_CACHING_ENV}, else on, as `tandem up`)",
    )
    parser.add_argument("--out", help="a JSON file for the tables")
    args = parser.parse_args(argv)
    caches = args.prefix_cache == "on"
    try:
        for name in ("repeats", "profile_repeats"):
            if getattr(args, name) < 1:
                flag = "--" + name.replace("_", "-")
                raise ValidateError(f"{flag} must be at least 1, got {getattr(args, name)}")
        configs = parse_configs(args.configs)
        measure = args.profile == MEASURE
        profiles = {} if measure else parse_profiles(args.profile, configs)
        shared = None
        if args.shared_cores and args.shared_cores != MEASURE:
            files = args.shared_cores.split(",")
            shared = SharedCores(tuple(WorkerProfile.load(f) for f in files))
        requests = read_workload(args.workload)
    except (ValidateError, ProfileError, OSError, ValueError) as error:
        print(f"plan_validate: {error}", file=sys.stderr)
        return 2
    try:
        if args.shared_cores == MEASURE:
            most = max(p + d for p, d in configs)
            shared = SharedCores(tuple(measured_profile(n, args) for n in range(1, most + 1)))
    except ProfileError as error:
        print(f"plan_validate: {error}", file=sys.stderr)
        return 1
    results = {model: {} for model in MODELS if model != "shared cores" or shared is not None}
    factors = {}
    cpu: dict[str, tuple[Summary, dict[str, float]]] = {}
    by_batch: dict[str, list[tuple[float, float]]] = {}
    for p, d in configs:
        name = f"{p}P{d}D"
        if measure:
            try:
                profiles[(p, d)] = measured_profile(p + d, args)
            except ProfileError as error:
                print(f"plan_validate: {error}", file=sys.stderr)
                return 1
        profile = profiles[(p, d)]
        measurements = [
            measured(requests, p, d, args.cluster_args.split(), caches) for _ in range(args.repeats)
        ]
        runs = [run for run, _ in measurements]
        cpu[name] = (runs[0][0], measurements[0][1])  # the first run's
        real = median_run(runs)
        results["profile"][name] = (simulated(profile, requests, p, d, None, caches), real)
        if shared is not None:
            shared_run = simulated(shared.profiles[0], requests, p, d, shared, caches)
            results["shared cores"][name] = (shared_run, real)
        factors[name] = slow_down(profile, real[1], results["profile"][name][0][1], requests)
        slowed_profile = profile.slowed(*factors[name])
        results["slowed"][name] = (simulated(slowed_profile, requests, p, d, None, caches), real)
        by_batch[name] = batch_factors(profile, real[1]["decode"], requests)
        if by_batch[name]:
            fitted_profile = profile.slowed(prefill=factors[name][0]).slowed_by_batch(
                by_batch[name]
            )
            fitted_run = simulated(fitted_profile, requests, p, d, None, caches)
            results["fitted"][name] = (fitted_run, real)
        print(report("profile", results["profile"]), flush=True)
    for model, runs in results.items():
        if not runs:  # "fitted" without per-batch counters (a cluster older than them)
            continue
        print(f"\n{MODELS[model]}:")
        if model == "slowed":
            print(", ".join(f"{n}: prefill x{f[0]:.2f}, decode x{f[1]:.2f}"
                            for n, f in factors.items()))  # fmt: skip
        if model == "fitted":
            for n, points in by_batch.items():
                shown = ", ".join(f"{b:.1f}: x{f:.2f}" for b, f in sorted(points))
                print(f"{n} decode by mean batch: {shown}")
        print(report(model, runs))
    print(f"\nCPU during the first measured run of each ({os.cpu_count()} cores):")
    print(cpu_table(cpu, os.cpu_count() or 1))
    if args.out:
        data = {
            model: {name: {"simulated": run_dict(sim), "measured": run_dict(real)}
                    for name, (sim, real) in runs.items()}
            for model, runs in results.items()
        }  # fmt: skip
        data["slow_down"] = {n: {"prefill": f[0], "decode": f[1]} for n, f in factors.items()}
        data["cpu_seconds"] = {name: by_role for name, (_, by_role) in cpu.items()}
        data["decode_factors_by_batch"] = by_batch
        if measure:
            data["measured_profiles"] = {f"{p}P{d}D": f.to_dict() for (p, d), f in profiles.items()}
        if args.shared_cores == MEASURE and shared is not None:
            data["measured_shared_cores"] = [f.to_dict() for f in shared.profiles]
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    return 0


def measured_profile(num_at_once: int, args: argparse.Namespace) -> WorkerProfile:
    profile = measure_at_once(num_at_once, args.profile_repeats, args.profile_args.split())
    print(f"profiled, {num_at_once} at once: {brief(profile)}", flush=True)
    return profile


def report(model: str, runs: dict[str, tuple[Run, Run]]) -> str:
    """The figures' table, the steps' table and the verdict of one model's simulations."""
    rows = {name: (sim[0], real[0]) for name, (sim, real) in runs.items()}
    steps = {name: (sim[1], real[1]) for name, (sim, real) in runs.items()}
    verdict = (
        f"{model}: within {TOLERANCE:.0%}: {within(rows)}; "
        f"same ranking: {ranking(rows, 0) == ranking(rows, 1)}"
    )
    return "\n".join((table(rows), steps_table(steps), batch_table(steps), verdict))


def run_dict(run: Run) -> dict:
    summary, steps = run
    quantiles = {role: {"step_p50_s": t.step_quantile(0.5), "step_p90_s": t.step_quantile(0.9)}
                 for role, t in steps.items()}  # fmt: skip
    return {
        **summary.to_dict(),
        "steps": {role: {**vars(t), **quantiles[role]} for role, t in steps.items()},
    }


if __name__ == "__main__":
    sys.exit(main())
