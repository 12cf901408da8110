"""`tandem plan`: how many prefill and decode workers (and what chunk budget) meet your SLOs.

It replays a workload (a `tandem bench` JSONL file, or `poisson:rate=...,n=...`, see
`services/planner/workload.py`) through the discrete-event simulator, which drives the real
scheduler core with simulated workers timed by a measured profile (`tandem profile`), and
searches the worker counts and chunk budgets (`loadtest/plan_search.py`). It prints the cheapest
configuration meeting every objective with its predicted percentiles, the runners-up, the
simulator's speed, and writes a plot of goodput against cost; `--emit compose|k8s` prints a
compose override file with the chunk budget and the `docker compose --scale` command using it,
or a kustomize overlay with the replica counts, the budget and the autoscalers' bounds. When
nothing within `--max-workers` meets the objectives it says so, shows the closest, and exits 1;
so it does, sooner, when doubling the workers no longer brings any closer to them.
A configuration's simulation stops as soon as its objectives can no longer be met (its verdict
is the same, found sooner: `services/planner/slo_watch.py`); `--simulate-all` plays every one
to the end, for goodput figures of the failing ones too.

    tandem plan --workload poisson:rate=2,n=500 --slo ttft_p99=2s,tpot_p99=100ms --max-workers 8
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from loadtest.plan_search import (
    Candidate,
    Judges,
    Plan,
    PlanError,
    check_fits,
    check_measurable,
    parse_slo,
    search,
)
from services.planner.profile import ProfileError, WorkerProfile
from services.planner.workload import SimRequest, WorkloadError, load_workload
from services.scheduler.core import SchedulerLimits
from shared.config import env_name, usable_cores

DEFAULT_PROFILE = Path(__file__).parent / "profiles" / "cpu-smollm2-2threads.json"
EMITS = ("compose", "k8s")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--workload", required=True, help="a JSONL file or poisson:rate=R,n=N,...")
    parser.add_argument("--slo", required=True, help="e.g. ttft_p99=2s,tpot_p99=100ms")
    parser.add_argument("--max-workers", type=int, default=8, help="most workers in all")
    parser.add_argument("--profile", default=str(DEFAULT_PROFILE), help="a `tandem profile` file")
    parser.add_argument(
        "--chunk-budgets", default=None, help="prefill token budgets to try (default: profile's)"
    )
    parser.add_argument("--max-splits", type=int, default=8, help="P:D splits tried per cost")
    parser.add_argument("--max-queued-requests", type=int, default=1024, help="the scheduler's")
    parser.add_argument(
        "--jobs",
        type=int,
        default=usable_cores(),
        help="configurations simulated side by side, a process each (default: the usable cores)",
    )
    parser.add_argument(
        "--prefix-cache",
        choices=("auto", "on", "off"),
        default="auto",
        help="simulate the workers' prefix caches (auto: when the workload's prompts share "
        "tokens: a JSONL file with prompt_token_ids, or poisson:...,prefix=N)",
    )
    parser.add_argument(
        "--simulate-all",
        action="store_true",
        help="simulate every configuration to its end, not only until it cannot meet the SLOs",
    )
    parser.add_argument(
        "--emit", choices=EMITS, help="print a compose override and command, or a k8s overlay"
    )
    parser.add_argument("--out", help="folder for plan.json and goodput-vs-cost.png")


def run(args: argparse.Namespace) -> int:
    try:
        slo = parse_slo(args.slo)
        profile = WorkerProfile.load(args.profile)
        requests = load_workload(args.workload)
        check_measurable(slo, requests)
        check_fits(profile, requests)
        budgets = _budgets(args.chunk_budgets, profile.settings.max_num_batched_tokens)
        if args.out:
            _check_out(Path(args.out))
        for name in ("max_workers", "max_splits", "max_queued_requests", "jobs"):
            minimum = 2 if name in ("max_workers", "max_splits") else 1
            if getattr(args, name) < minimum:
                flag = "--" + name.replace("_", "-")
                raise PlanError(f"{flag} must be at least {minimum}, got {getattr(args, name)}")
    except (PlanError, ProfileError, WorkloadError) as error:
        print(f"tandem plan: {error}", file=sys.stderr)
        return 2
    limits = SchedulerLimits(max_queued_requests=args.max_queued_requests)
    # No more processes than one cost has configurations: each holds a simulation's memory.
    jobs = min(args.jobs, args.max_splits * len(budgets))
    prefix_cache = args.prefix_cache == "on" or (
        args.prefix_cache == "auto" and any(r.shares_tokens for r in requests)
    )
    note = context_note(profile, requests, min(budgets), prefix_cache)
    if note is not None:
        print(f"tandem plan: note: {note}", file=sys.stderr)
    cut_hopeless = not args.simulate_all
    with Judges(profile, requests, limits, slo, jobs, prefix_cache, cut_hopeless) as judges:
        plan = search(args.max_workers, budgets, judges, args.max_splits, slo, judges.wholes)
        closest = plan.runners_up(1)
        if plan.best is None and closest and closest[0].cut_short is not None:
            # A refusal should say how far off the best try is, not only when it gave up.
            plan.closest_whole = judges.whole(closest[0])
    print(report(plan, slo, args.max_workers, len(requests), jobs, prefix_cache))
    if args.out:
        _write(plan, Path(args.out))
    if plan.best is None:
        return 1
    if args.emit:
        print(emit(plan.best, args.emit))
    return 0


def context_note(
    profile: WorkerProfile, requests: list[SimRequest], budget: int, prefix_cache: bool
) -> str | None:
    """What a profile without a context cost gets wrong here, if anything: prompts read from a
    cache, or chunked (longer than a step's budget, or than one step within the time target),
    have chunks after context, timed as if alone."""
    if profile.prefill_s_per_context_pair > 0:
        return None
    target_s = profile.settings.step_time_target_s

    def chunked(num_tokens: int) -> bool:
        too_slow = target_s is not None and profile.prefill_time(num_tokens) > target_s
        return num_tokens > budget or too_slow

    if not (prefix_cache or any(chunked(r.num_prompt_tokens) for r in requests)):
        return None
    return (
        "the profile's prefill context cost is 0 (measured before `tandem profile` timed it, "
        "or timed as nothing on a busy machine): prompt chunks after a cached prefix or after "
        "their prompt's earlier chunks are timed as if alone, so prefills come out short; "
        "measure the profile again"
    )


def _check_out(out: Path) -> None:
    """Makes the `--out` folder and tries a file in it, or refuses it: a folder the plan cannot
    be written to was found only after the whole search, when the plan was written (a bare
    `[Errno 2]` for `/proc/x`)."""
    if out.exists() and not out.is_dir():
        raise PlanError(f"--out {out} is a file; it names the folder the plan goes in")
    existing = next(folder for folder in out.parents if folder.exists())
    if not existing.is_dir():
        raise PlanError(f"--out {out} is under {existing}, which is a file")
    try:
        out.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as error:
        raise PlanError(f"--out {out} cannot be written to: {error.strerror or error}") from None


def _budgets(text: str | None, default: int) -> list[int]:
    if text is None:
        return [default]
    try:
        budgets = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise PlanError(f"--chunk-budgets takes token counts like 256,512; got {text!r}") from None
    if not budgets or any(b < 16 for b in budgets):
        raise PlanError(f"--chunk-budgets must be token counts of at least 16; got {text!r}")
    # (A repeated budget was simulated twice, and the best listed as its own runner-up.)
    repeated = next((b for i, b in enumerate(budgets) if b in budgets[:i]), None)
    if repeated is not None:
        raise PlanError(f"--chunk-budgets names {repeated} twice")
    return budgets


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.0f}"


def _target_ms(seconds: float) -> str:
    """An objective's bound as given, not rounded to a whole ms (0.4 ms read as 0)."""
    return f"{seconds * 1e3:.6f}".rstrip("0").rstrip(".")


def describe(candidate: Candidate) -> str:
    if candidate.cut_short is not None:
        return (
            f"{candidate.name:<22} cost {candidate.cost:>4}  fails  cut short at "
            f"{candidate.cut_at_s:.1f} s simulated: {candidate.cut_short}"
        )
    s, u = candidate.summary, candidate.utilization
    goodput = f"{s.goodput_rps:.2f}" if s.goodput_rps is not None else "-"
    return (
        f"{candidate.name:<22} cost {candidate.cost:>4}  "
        f"{'meets' if candidate.meets else 'fails':<5}  "
        f"TTFT ms p50 {_ms(s.ttft_p50)} p99 {_ms(s.ttft_p99)}  "
        f"TPOT ms p50 {_ms(s.tpot_p50)} p99 {_ms(s.tpot_p99)}  "
        f"{s.output_tokens_per_s:.0f} tok/s  goodput {goodput} req/s  "
        f"util P {u['prefill']:.0%} D {u['decode']:.0%}  errors {s.num_errors}  "
        f"preemptions {candidate.num_preemptions}  max queued {candidate.max_queued}"
    )


def report(
    plan: Plan,
    slo: dict[str, float],
    max_workers: int,
    num_requests: int,
    jobs: int = 1,
    prefix_cache: bool = False,
) -> str:
    objectives = ", ".join(f"{k} <= {_target_ms(v)} ms" for k, v in slo.items())
    lines = []
    if plan.best is None:
        if plan.stalled is not None:  # (the search stopped short of max_workers)
            lines.append(
                f"no configuration meets {objectives} with every request served: "
                f"{plan.stalled}; the closest:"
            )
        else:
            lines.append(
                f"no configuration of at most {max_workers} workers meets {objectives} with "
                f"every request served; the closest:"
            )
        lines += [f"  {describe(c)}" for c in plan.runners_up()]
        if plan.closest_whole is not None:
            lines.append("the closest, simulated to its end:")
            lines.append(f"  {describe(plan.closest_whole)}")
    else:
        lines.append(f"cheapest configuration meeting {objectives}:")
        lines.append(f"  {describe(plan.best)}")
        lines.append("runners-up:")
        lines += [f"  {describe(c)}" for c in plan.runners_up()]
    lines.append(goodput_chart(plan))
    lines.append(
        f"simulated {len(plan.tried)} configurations x {num_requests} requests "
        f"({jobs} at a time, prefix caches {'on' if prefix_cache else 'off'}): "
        f"{plan.num_events} events in {plan.real_s:.1f} s = "
        f"{plan.events_per_s:,.0f} events/s"
    )
    return "\n".join(lines)


def goodput_chart(plan: Plan, width: int = 40) -> str:
    """Best goodput at each cost tried, as a text bar chart (of the configurations simulated
    to their end: a cost whose every configuration was cut short has none)."""
    by_cost: dict[int, float | None] = {}
    for c in plan.tried:
        known = by_cost.get(c.cost)
        if c.cut_short is None:
            by_cost[c.cost] = max(known or 0.0, c.summary.goodput_rps or 0.0)
        else:
            by_cost.setdefault(c.cost, None)
    top = max((g for g in by_cost.values() if g is not None), default=0.0) or 1.0
    rows = ["goodput (req/s each within every objective's bound) by cost (workers):"]
    cut: list[int] = []  # consecutive costs tried whose configurations were all cut short
    for cost in sorted(by_cost):
        goodput = by_cost[cost]
        if goodput is None:
            cut.append(cost)
            continue
        rows += _cut_row(cut)
        cut = []
        bar = "#" * round(width * goodput / top)
        rows.append(f"  {cost:>5} | {bar:<{width}} {goodput:.2f}")
    return "\n".join(rows + _cut_row(cut))


def _cut_row(costs: list[int]) -> list[str]:
    """One row for a run of costs whose every configuration was cut short."""
    if not costs:
        return []
    label = f"{costs[0]}" if len(costs) == 1 else f"{costs[0]}-{costs[-1]}"
    tried = f" ({len(costs)} costs tried)" if len(costs) > 1 else ""
    return [f"  {label:>5} | cut short: none can meet them{tried}"]


BUDGET_VARIABLE = env_name("max_num_batched_tokens")  # the prefill workers' chunk budget
COMPOSE_OVERRIDE = "compose/plan.yml"


def emit(best: Candidate, kind: str) -> str:
    """The plan as its deployment: for compose, an override file (docker-compose.yml sets no
    chunk budget: a worker's default applies, not the plan's) and the command that layers it
    with `-f`, as compose/gpu.yml is; for k8s, a kustomize overlay setting the Deployments'
    replicas, the prefill ConfigMap's budget and both HPAs' bounds (the base's maxReplicas
    would hold a larger plan down, its decode minReplicas a smaller one up)."""
    return emit_compose(best) if kind == "compose" else emit_k8s(best)


def emit_compose(best: Candidate) -> str:
    scale = f"--scale prefill={best.num_prefill} --scale decode={best.num_decode}"
    return "\n".join(
        [
            f"# {COMPOSE_OVERRIDE}: the plan's chunk budget for the prefill workers, which",
            "# docker-compose.yml leaves at the workers' default; save this file, then start:",
            f"#   docker compose -f docker-compose.yml -f {COMPOSE_OVERRIDE} up -d {scale}",
            f"# (on GPUs, add -f compose/gpu.yml before -f {COMPOSE_OVERRIDE})",
            "services:",
            "  prefill:",
            "    environment:",
            f'      {BUDGET_VARIABLE}: "{best.chunk_budget}"',
        ]
    )


def emit_k8s(best: Candidate) -> str:
    lines = [
        "# kustomization.yaml: an overlay on compose/k8s with the planned workers and chunk budget",
        "# (in a folder beside compose/k8s, e.g. compose/k8s-plan/: kubectl apply -k it). The HPAs",
        "# are held at the planned counts: raise maxReplicas for room beyond the planned load.",
        "# (Workers on GPUs: ../k8s-gpu in resources.)",
        "apiVersion: kustomize.config.k8s.io/v1beta1",
        "kind: Kustomization",
        "resources:",
        "  - ../k8s",
        "replicas:",
        "  - name: tandem-prefill",
        f"    count: {best.num_prefill}",
        "  - name: tandem-decode",
        f"    count: {best.num_decode}",
        "patches:",
        "  - patch: |-",
        "      apiVersion: v1",
        "      kind: ConfigMap",
        "      metadata:",
        "        name: tandem-prefill",
        "        namespace: tandem",
        "      data:",
        f'        {BUDGET_VARIABLE}: "{best.chunk_budget}"',
    ]
    for role, count in (("prefill", best.num_prefill), ("decode", best.num_decode)):
        lines += [
            "  - patch: |-",
            "      apiVersion: autoscaling/v2",
            "      kind: HorizontalPodAutoscaler",
            "      metadata:",
            f"        name: tandem-{role}",
            "        namespace: tandem",
            "      spec:",
            f"        minReplicas: {count}",
            f"        maxReplicas: {count}",
        ]
    return "\n".join(lines)


def _row(c: Candidate) -> dict:
    return {
        "num_prefill": c.num_prefill,
        "num_decode": c.num_decode,
        "chunk_budget": c.chunk_budget,
        "cost": c.cost,
        "meets": c.meets,
        "summary": c.summary.to_dict(),
        "utilization": c.utilization,
        "num_preemptions": c.num_preemptions,
        "cut_short": c.cut_short,
        "cut_at_s": c.cut_at_s,
    }


def _write(plan: Plan, folder: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    rows = [_row(c) for c in plan.tried]
    best = rows[plan.tried.index(plan.best)] if plan.best else None
    data = {"best": best, "tried": rows, "events_per_s": plan.events_per_s}
    if plan.stalled is not None:
        data["stalled"] = plan.stalled
    if plan.closest_whole is not None:
        data["closest_whole"] = _row(plan.closest_whole)
    (folder / "plan.json").write_text(json.dumps(data, indent=2) + "\n")
    figure, axis = plt.subplots(figsize=(6, 4))
    # Those simulated to their end: a cut one's goodput is a part's, no figure.
    whole = [c for c in plan.tried if c.cut_short is None]
    whole += [plan.closest_whole] if plan.closest_whole is not None else []
    for meets, marker in ((True, "o"), (False, "x")):
        points = [(c.cost, c.summary.goodput_rps or 0.0) for c in whole if c.meets is meets]
        if points:
            axis.scatter(
                *zip(*points, strict=True), marker=marker, label="meets" if meets else "fails"
            )
    axis.set_xlabel("cost (workers)")
    axis.set_ylabel("goodput (req/s within the SLOs)")
    if whole:
        axis.legend()
    figure.tight_layout()
    figure.savefig(folder / "goodput-vs-cost.png", dpi=110)
    plt.close(figure)
