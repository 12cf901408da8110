"""What a batch job costs the agents beside it: their time to first token with and without a job
of long prompts on the same cluster, in the simulator (the real scheduler core, simulated
workers from a measured profile), so the figures are exact for the profile and need no model.

Agents send long contexts (`--tokens`, past half the prefill window: "big" prompts, which a
prefill worker holds one of at a time) every `--every-s` seconds while the job's lines
(`--lines` of the same length, all at once) drain. The job should take only spare capacity:
the agents' TTFT beside it is compared with their TTFT alone.

    .venv/bin/python -m loadtest.bulk_beside_agents [--profile P] [--lines 30] [--agents 9]
        [--every-s 13] [--tokens 1100] [--prefill 1 --decode 1]
"""

from __future__ import annotations

import argparse
import statistics

from services.planner.profile import WorkerProfile
from services.planner.simulator import SimConfig, SimResult, Simulator
from services.planner.workload import SimRequest

DEFAULT_PROFILE = "loadtest/profiles/cpu-smollm2-2threads.json"
FIRST_AGENT_S = 2.0  # after the job's lines have arrived
MAX_TOKENS = 16


def workload(args: argparse.Namespace, with_job: bool) -> list[SimRequest]:
    lines = [
        SimRequest(0.0, args.tokens, MAX_TOKENS, tenant="batch", label="line", bulk=True)
        for _ in range(args.lines if with_job else 0)
    ]
    agents = [
        SimRequest(FIRST_AGENT_S + i * args.every_s, args.tokens, MAX_TOKENS, "agents", "agent")
        for i in range(args.agents)
    ]
    return lines + agents


def agents_ttft(result: SimResult) -> dict[str, float]:
    ttft = sorted(
        r.first_token_time - r.send_time
        for r in result.records
        if r.label == "agent" and r.first_token_time is not None
    )
    if not ttft:
        raise SystemExit("no agent had a first token")
    return {
        "p50": statistics.median(ttft),
        "p90": ttft[min(len(ttft) - 1, int(0.9 * len(ttft)))],
        "max": ttft[-1],
    }


def run(args: argparse.Namespace) -> dict[str, object]:
    profile = WorkerProfile.load(args.profile)
    config = SimConfig(args.prefill, args.decode)
    alone = Simulator(profile, config).run(workload(args, with_job=False))
    beside = Simulator(profile, config).run(workload(args, with_job=True))
    lines_done = [r.finish_time for r in beside.records if r.label == "line" and r.finish_time]
    return {
        "alone": agents_ttft(alone),
        "beside_the_job": agents_ttft(beside),
        "errors": sum(r.error is not None for r in beside.records),
        "job_done_s": max(lines_done, default=float("nan")),
        "last_agent_s": FIRST_AGENT_S + (args.agents - 1) * args.every_s,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--profile", default=DEFAULT_PROFILE)
    parser.add_argument("--lines", type=int, default=30, help="the job's lines")
    parser.add_argument("--agents", type=int, default=9, help="agents' requests")
    parser.add_argument("--every-s", type=float, default=13.0, help="between agents' requests")
    parser.add_argument("--tokens", type=int, default=1100, help="every prompt's length")
    parser.add_argument("--prefill", type=int, default=1)
    parser.add_argument("--decode", type=int, default=1)
    args = parser.parse_args(argv)
    for name in ("lines", "agents", "tokens", "prefill", "decode"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not 0 < args.every_s < float("inf"):
        parser.error(f"--every-s must be a positive number of seconds, got {args.every_s}")
    return args


def main(argv: list[str] | None = None) -> None:
    result = run(parse_args(argv))
    for key in ("alone", "beside_the_job"):
        ttft = result[key]
        assert isinstance(ttft, dict)
        shown = ", ".join(f"{name} {value:.2f} s" for name, value in ttft.items())
        print(f"agents' TTFT {key.replace('_', ' ')}: {shown}")
    print(f"errors: {result['errors']}; the job drained at {result['job_done_s']:.1f} s "
          f"(last agent at {result['last_agent_s']:.1f} s)")  # fmt: skip


if __name__ == "__main__":
    main()
