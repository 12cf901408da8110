"""The simulator against the real cluster: simulated and measured TTFT and TPOT, side by side.

For each configuration (`--configs 1P1D,1P2D,2P1D`) it replays one workload (a `tandem bench`
JSONL file, arrivals honored) twice: through the simulator with a profile, and through a real
local cluster (`tandem up` with that many workers, `loadtest/served.py`). It prints, per
configuration, TTFT and TPOT p50/p90 simulated, measured and their relative difference (the
issue's bar: within 20%), and whether the two rank the configurations alike (by mean of the
four figures). Every worker of a local cluster shares this machine's cores, so the profile must
be measured under the same sharing: `--profile` per configuration (`1P1D=a.json,...`), or one
profile for all, to be corrected by what the table shows. Run it on a quiet machine.

    .venv/bin/python -m loadtest.plan_validate --workload loadtest/workloads/mixed64.jsonl \\
        --configs 1P1D,1P2D,2P1D  # the shipped shared-core profiles of this machine kind
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import sys
from pathlib import Path

from loadtest.client import run_workload
from loadtest.metrics import Summary, summarize
from loadtest.plan_search import to_records
from loadtest.served import tandem_up
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


def simulated(profile: WorkerProfile, requests: list[WorkloadRequest], p: int, d: int) -> Summary:
    sim_requests = [
        SimRequest(r.arrival_time, r.num_prompt_tokens or 1, r.max_tokens, label=r.label)
        for r in requests
    ]
    return summarize(to_records(Simulator(profile, SimConfig(p, d)).run(sim_requests)))


def measured(requests: list[WorkloadRequest], p: int, d: int, extra: list[str]) -> Summary:
    with tandem_up(p, d, extra) as cluster:
        result = asyncio.run(run_workload(cluster.url, "smollm2", requests, name=f"{p}P{d}D"))
    return result.summary


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
    rows = {}
    for p, d in configs:
        sim = simulated(profiles[(p, d)], requests, p, d)
        real = measured(requests, p, d, args.cluster_args.split())
        rows[f"{p}P{d}D"] = (sim, real)
        print(table(rows), flush=True)
    same_ranking = ranking(rows, 0) == ranking(rows, 1)
    print(f"within {TOLERANCE:.0%}: {within(rows)}; same ranking: {same_ranking}")
    if args.out:
        data = {
            n: {"simulated": s.to_dict(), "measured": m.to_dict()} for n, (s, m) in rows.items()
        }
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
