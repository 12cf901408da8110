"""The simulator's own speed at scale: how long one simulation of many workers and requests takes.

It runs one simulation (`services/planner`: the real scheduler core, simulated workers) and prints
the events played, the process's CPU seconds, events and requests per CPU second, simulated
seconds per CPU second, and the peak resident memory. The issue's scale is the default: a
thousand prefill and a thousand decode workers, Poisson arrivals at 500 requests a second.

    .venv/bin/python -m loadtest.sim_scale [--prefill 1000 --decode 1000]
        [--workload poisson:rate=500,n=20000,prompt=8-512,output=1-64,tenants=1000]
        [--profile loadtest/profiles/cpu-smollm2-2threads.json] [--indexes auto|native|python]
"""

from __future__ import annotations

import argparse
import resource
import sys
import time

from loadtest.plan import DEFAULT_PROFILE
from services.planner.profile import WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import load_workload
from services.scheduler.core import SchedulerLimits
from services.scheduler.native_indexes import INDEXES

DEFAULT_WORKLOAD = "poisson:rate=500,n=20000,prompt=8-512,output=1-64,tenants=1000"


def measure(
    profile: WorkerProfile,
    num_prefill: int,
    num_decode: int,
    workload: str,
    indexes: str = "auto",
) -> dict[str, str]:
    """One simulation, timed in this process's CPU time: the figures, formatted."""
    requests = load_workload(workload)
    limits = SchedulerLimits(indexes=indexes)
    simulator = Simulator(profile, SimConfig(num_prefill, num_decode, limits=limits))
    started = time.process_time()
    result = simulator.run(requests)
    cpu_s = max(time.process_time() - started, 1e-9)
    served = sum(r.error is None for r in result.records)
    return {
        "workers": f"{num_prefill} P + {num_decode} D",
        "indexes": simulator.core.registry.decode_room_kind,
        "requests": f"{len(requests):,} ({served:,} served)",
        "events": f"{result.num_events:,}",
        "cpu_s": f"{cpu_s:.1f}",
        "events_per_cpu_s": f"{result.num_events / cpu_s:,.0f}",
        "requests_per_cpu_s": f"{len(requests) / cpu_s:,.0f}",
        "simulated_s": f"{simulator.now:,.1f}",
        "simulated_s_per_cpu_s": f"{simulator.now / cpu_s:.2f}",
        "peak_rss_mib": f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:,.0f}",
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill", type=int, default=1000)
    parser.add_argument("--decode", type=int, default=1000)
    parser.add_argument("--workload", default=DEFAULT_WORKLOAD)
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE))
    parser.add_argument(
        "--indexes", choices=INDEXES, default="auto", help="the scheduler core's (C or Python)"
    )
    args = parser.parse_args(argv)
    try:
        profile = WorkerProfile.load(args.profile)
        figures = measure(profile, args.prefill, args.decode, args.workload, args.indexes)
    except ValueError as error:  # ProfileError and WorkloadError are ValueErrors, as SimConfig's
        print(f"sim_scale: {error}", file=sys.stderr)
        return 2
    width = max(map(len, figures))
    for name, value in figures.items():
        print(f"{name:>{width}}: {value}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
