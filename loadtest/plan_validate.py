"""The simulator against the real cluster: simulated and measured TTFT and TPOT, side by side.

For each configuration (`--configs 1P1D,1P2D,2P1D`) it replays one workload (a `tandem bench`
JSONL file, arrivals honored) twice: through the simulator with a profile, and through a real
local cluster (`tandem up` with that many workers, `loadtest/served.py`). It prints, per
configuration, TTFT and TPOT p50/p90 simulated, measured and their relative difference (the
issue's bar: within 20%), and whether the two rank the configurations alike (by mean of the
four figures). Every worker of a local cluster shares this machine's cores, so the profile must
be measured under the same sharing: `--profile` per configuration (`1P1D=a.json,...`), or one
profile for all. Run it on a quiet machine.

Beside the gateway, the scheduler and the load client, a worker's steps run slower than in a
profile taken beside other profiles only. So the workers' own step counters are read from the
cluster's /metrics around the run (steps, time inside them, sequences per decode step) and set
against the profile's: the prefill workers' busy time against the simulation's, the decode
workers' mean step against the profile's step at the same mean batch. A second table simulates
with the profile slowed by those two factors: the configuration profiled as it runs.

    .venv/bin/python -m loadtest.plan_validate --workload loadtest/workloads/mixed64.jsonl \\
        --configs 1P1D,1P2D,2P1D  # the shipped shared-core profiles of this machine kind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

from loadtest.client import run_workload
from loadtest.metrics import Summary, summarize
from loadtest.plan_search import to_records
from loadtest.served import tandem_up
from loadtest.worker_metrics import WorkerCounters, worker_counters
from loadtest.workload import WorkloadRequest, read_workload
from services.planner.profile import ProfileError, WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import SimRequest

FIGURES = ("ttft_p50", "ttft_p90", "tpot_p50", "tpot_p90")
# Profiles measured on this machine kind as `tandem up`'s workers share it: one torch thread
# each, two (1P1D) or three (1P2D, 2P1D) profiles measured at once.
SHARED_PROFILES = (
    "1P1D=loadtest/profiles/cpu-smollm2-1thread-2shared.json,"
    "1P2D=loadtest/profiles/cpu-smollm2-1thread-3shared.json,"
    "2P1D=loadtest/profiles/cpu-smollm2-1thread-3shared.json"
)
TOLERANCE = 0.2


class ValidateError(ValueError):
    pass


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
    by_name = dict(part.split("=", 1) for part in text.split(","))
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

    @property
    def mean_step_s(self) -> float:
        return self.busy_s / self.steps if self.steps else 0.0

    @property
    def mean_batch(self) -> float:
        return self.sequences / self.steps if self.steps else 0.0


Run = tuple[Summary, dict[str, StepTimes]]  # the figures, and the steps by role


def simulated(profile: WorkerProfile, requests: list[WorkloadRequest], p: int, d: int) -> Run:
    sim_requests = [
        SimRequest(r.arrival_time, r.num_prompt_tokens or 1, r.max_tokens, label=r.label)
        for r in requests
    ]
    result = Simulator(profile, SimConfig(p, d)).run(sim_requests)
    steps = {
        role: StepTimes(
            sum(s.num_steps for s in stats.values()),
            sum(s.busy_s for s in stats.values()),
            sum(s.num_step_sequences for s in stats.values()),
        )
        for role, stats in (("prefill", result.prefill_stats), ("decode", result.decode_stats))
    }
    return summarize(to_records(result)), steps


def measured(requests: list[WorkloadRequest], p: int, d: int, extra: list[str]) -> Run:
    with tandem_up(p, d, extra) as cluster:
        before = worker_counters(httpx.get(cluster.url + "/metrics", timeout=30).text)
        result = asyncio.run(run_workload(cluster.url, "smollm2", requests, name=f"{p}P{d}D"))
        after = worker_counters(httpx.get(cluster.url + "/metrics", timeout=30).text)
    return result.summary, role_steps(before, after)


def role_steps(
    before: dict[str, WorkerCounters], after: dict[str, WorkerCounters]
) -> dict[str, StepTimes]:
    """What each role's workers did between two readings of their counters."""
    totals: dict[str, list[float]] = {}
    for peer, end in after.items():
        start = before.get(peer, WorkerCounters(end.role))
        total = totals.setdefault(end.role, [0.0, 0.0, 0.0])
        total[0] += end.steps - start.steps
        total[1] += end.busy_s - start.busy_s
        total[2] += end.batch_sequences - start.batch_sequences
    return {role: StepTimes(*total) for role, total in totals.items()}


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
    context = sum((r.num_prompt_tokens or 1) + r.max_tokens / 2 for r in requests) / len(requests)
    decode = real["decode"].mean_step_s / profile.decode_time(real["decode"].mean_batch, context)
    return prefill, decode


def steps_table(rows: dict[str, tuple[dict[str, StepTimes], dict[str, StepTimes]]]) -> str:
    lines = [f"{'config':<6} {'role':<8} {'steps sim/meas':>16} {'mean step ms sim/meas':>22}"
             f" {'busy s sim/meas':>16} {'mean batch sim/meas':>20}"]  # fmt: skip
    for name, (sim, real) in rows.items():
        for role in ("prefill", "decode"):
            s, m = sim[role], real.get(role, StepTimes(0, 0))
            lines.append(
                f"{name:<6} {role:<8} {s.steps:>7.0f} / {m.steps:<6.0f} "
                f"{s.mean_step_s * 1e3:>10.0f} / {m.mean_step_s * 1e3:<9.0f} "
                f"{s.busy_s:>7.1f} / {m.busy_s:<6.1f} {s.mean_batch:>9.1f} / {m.mean_batch:<8.1f}"
            )
    return "\n".join(lines)


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--workload", default="loadtest/workloads/mixed64.jsonl")
    parser.add_argument("--profile", default=SHARED_PROFILES)
    parser.add_argument("--configs", default="1P1D,1P2D,2P1D")
    parser.add_argument("--cluster-args", default="", help="extra `tandem up` flags, one string")
    parser.add_argument("--out", help="a JSON file for the table")
    args = parser.parse_args(argv)
    try:
        configs = parse_configs(args.configs)
        profiles = parse_profiles(args.profile, configs)
        requests = read_workload(args.workload)
    except (ValidateError, ProfileError, OSError, ValueError) as error:
        print(f"plan_validate: {error}", file=sys.stderr)
        return 2
    rows, steps, slowed_rows, factors = {}, {}, {}, {}
    for p, d in configs:
        name, profile = f"{p}P{d}D", profiles[(p, d)]
        real, real_steps = measured(requests, p, d, args.cluster_args.split())
        sim, sim_steps = simulated(profile, requests, p, d)
        factors[name] = slow_down(profile, real_steps, sim_steps, requests)
        slowed, _ = simulated(profile.slowed(*factors[name]), requests, p, d)
        rows[name], steps[name], slowed_rows[name] = (
            (sim, real),
            (sim_steps, real_steps),
            (
                slowed,
                real,
            ),
        )
        print(table(rows), steps_table(steps), sep="\n", flush=True)
    print(f"profile as measured: within {TOLERANCE:.0%}: {within(rows)}; "
          f"same ranking: {ranking(rows, 0) == ranking(rows, 1)}")  # fmt: skip
    shown = ", ".join(f"{n} prefill x{f[0]:.2f} decode x{f[1]:.2f}" for n, f in factors.items())
    print(f"\nslowed by the run's own step times ({shown}):")
    print(table(slowed_rows))
    print(f"profiled as it runs: within {TOLERANCE:.0%}: {within(slowed_rows)}; "
          f"same ranking: {ranking(slowed_rows, 0) == ranking(slowed_rows, 1)}")  # fmt: skip
    if args.out:
        data = {
            n: {
                "simulated": s.to_dict(),
                "measured": m.to_dict(),
                "simulated_slowed": slowed_rows[n][0].to_dict(),
                "slow_down": {"prefill": factors[n][0], "decode": factors[n][1]},
                "steps": {
                    side: {role: vars(t) for role, t in by_role.items()}
                    for side, by_role in zip(("simulated", "measured"), steps[n], strict=True)
                },
            }
            for n, (s, m) in rows.items()
        }
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
