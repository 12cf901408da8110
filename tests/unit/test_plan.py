"""`tandem plan`: the search by simulation, its output, and its refusals."""

from __future__ import annotations

import copy
import dataclasses
import json
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from loadtest.metrics import summarize
from loadtest.plan import context_note, emit
from loadtest.plan_search import (
    Candidate,
    Judges,
    PlanError,
    evaluate,
    parse_slo,
    request_objectives,
    search,
    splits,
    to_records,
)
from services.commands import cli
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import load_workload
from services.scheduler.core import SchedulerLimits
from services.worker.config import WorkerConfig
from shared.config import config_from_args
from tests.unit.test_planner_sim import cpu_like_profile, within_seconds

ROOT = Path(__file__).resolve().parents[2]

WORKLOAD = "poisson:rate=3,n=60,prompt=8-512,output=4-64,seed=2"
BUSY = "poisson:rate=8,n=80,prompt=8-512,output=4-64,seed=2"  # 1P1D cannot keep up


@pytest.fixture(scope="module")
def profile_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("plan") / "profile.json"
    cpu_like_profile().save(path)
    return str(path)


def plan(profile_path, *flags: str) -> int:
    return cli.main(["plan", "--workload", WORKLOAD, "--profile", profile_path, *flags])


def test_parse_slo():
    assert parse_slo("ttft_p99=2s,tpot_p99=100ms") == {"ttft_p99": 2.0, "tpot_p99": 0.1}
    assert parse_slo("e2e_p50=1.5") == {"e2e_p50": 1.5}
    for text, message in [
        ("ttft=2s", "KEY=VALUE"),
        ("ttft_p99", "KEY=VALUE"),
        ("ttft_p99=fast", "positive time"),
        ("ttft_p99=0s", "positive time"),
        ("ttft_p99=2h", "positive time"),
        ("ttft_p99=2s,ttft_p99=1s", "names ttft_p99 twice"),
        ("ttft_p99=" + "9" * 400 + "s", "positive time"),  # (read as inf: no objective at all)
    ]:
        with pytest.raises(PlanError, match=message):
            parse_slo(text)


def test_splits_cover_or_spread():
    assert splits(4, 8) == [(1, 3), (2, 2), (3, 1)]
    spread = splits(1000, 5)
    assert len(spread) == 5 and spread[0] == (1, 999) and spread[-1] == (999, 1)


def test_goodput_counts_the_requests_within_every_objective_the_slo_names(profile_path, capsys):
    """A request is good when its own TTFT, TPOT and e2e are each within every bound the SLO
    names for them, whatever the percentile: an e2e objective counts, p90 objectives count (they
    gave no goodput at all: every cost charted 0.00), and two on one figure mean the tighter."""
    requests = load_workload(WORKLOAD)
    config = SimConfig(1, 1, SchedulerLimits())
    records = to_records(Simulator(cpu_like_profile(), config).run(requests))
    wall = summarize(records).wall_s

    def good(ttft: float = 1e9, tpot: float = 1e9, e2e: float = 1e9) -> float:
        within = [
            r
            for r in records
            if r.ok and r.ttft <= ttft and (r.tpot is None or r.tpot <= tpot) and r.e2e <= e2e
        ]
        assert 0 < len(within) < len(records), "each bound is meant to exclude some"
        return len(within) / wall

    def goodput(slo: str) -> float | None:
        return evaluate(cpu_like_profile(), requests, config, parse_slo(slo)).summary.goodput_rps

    assert goodput("ttft_p99=100s,e2e_p99=2.5s") == pytest.approx(good(e2e=2.5))
    assert goodput("ttft_p90=500ms,tpot_p90=160ms") == pytest.approx(good(ttft=0.5, tpot=0.16))
    assert goodput("e2e_p50=3s,e2e_p99=2s,tpot_p50=1s") == pytest.approx(good(e2e=2.0))
    assert request_objectives(parse_slo("tpot_p90=1s,ttft_p50=2s,ttft_p99=1s")) == (1, 1, None)
    # The search's chart and runners-up read it: the failing ones ranked by their goodput.
    flags = ["--workload", BUSY, "--profile", profile_path, "--slo", "ttft_p90=2s,tpot_p90=300ms"]
    assert cli.main(["plan", *flags, "--max-workers", "6", "--simulate-all"]) == 0
    out = capsys.readouterr().out
    chart = out.split("by cost (workers):\n")[1].splitlines()[:-1]
    assert len(chart) == 3 and all(float(row.split()[-1]) > 0 for row in chart), chart
    runners_up = out.split("runners-up:\n")[1].splitlines()[:3]
    goodputs = [float(row.split("goodput ")[1].split()[0]) for row in runners_up]
    assert goodputs == sorted(goodputs, reverse=True) and goodputs[-1] > 0, runners_up


def test_a_simulated_runs_span_reaches_its_last_failure():
    """Simulated records that failed carried their end as `finish_time` only, which the span
    of a summary ignores for a failure: a run whose last requests were cut unfinished read as
    ending at its last success, and its rates (goodput) over too short a span."""
    config = SimConfig(1, 1, SchedulerLimits(), drain_s=1.0)
    result = Simulator(cpu_like_profile(), config).run(load_workload(BUSY))
    records = to_records(result)
    assert any(not r.ok for r in records) and any(r.ok for r in records)
    last_success = max(r.finish_time for r in records if r.ok)
    last_end = max(r.finish_time or r.failure_time for r in records)
    assert last_end > last_success
    assert summarize(records).wall_s == pytest.approx(last_end - min(r.send_time for r in records))


def test_requests_not_streamed_are_judged_as_the_bench_judges_them(tmp_path):
    """A workload line with `"stream": false` (the bulk class of `generators mix`) is one the
    bench sends for one response: no first token before it, so no TTFT or TPOT, only e2e. The
    plan judged it by a TTFT the bench never measures; so judged, its TTFT objective counts the
    streamed requests alone, watched or simulated whole."""
    requests = load_workload(BUSY)
    path = tmp_path / "w.jsonl"
    lines = [
        {"num_prompt_tokens": r.num_prompt_tokens, "max_tokens": r.max_tokens,
         "arrival_time": r.arrival_time, **({"stream": False} if i % 2 else {})}
        for i, r in enumerate(requests)
    ]  # fmt: skip
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    mixed = load_workload(str(path))
    assert [r.stream for r in mixed[:4]] == [True, False, True, False]
    config = SimConfig(2, 2, SchedulerLimits())
    records = to_records(Simulator(cpu_like_profile(), config).run(mixed))
    assert all((r.ttft is None) is (not r.stream) for r in records if r.ok)
    whole = summarize(records)
    assert whole.ttft_n == whole.tpot_n == len(requests) // 2 and whole.e2e_n == len(requests)
    # A TTFT target half the requests miss: the streamed ones' p50 within it, the watch agreeing.
    target = whole.ttft_p50 * 1.01
    slo = {"ttft_p50": target}
    watched = evaluate(cpu_like_profile(), mixed, config, slo, cut_hopeless=True)
    unwatched = evaluate(cpu_like_profile(), mixed, config, slo)
    assert unwatched.meets and watched.meets and watched.summary == unwatched.summary


def test_plan_finds_a_configuration_that_meets_its_slos_when_resimulated(
    profile_path, tmp_path, capsys
):
    slo = "ttft_p99=2s,tpot_p99=300ms"
    flags = ["--workload", BUSY, "--profile", profile_path, "--slo", slo, "--max-workers", "6"]
    flags += ["--jobs", "2"]
    assert cli.main(["plan", *flags, "--emit", "compose", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "cheapest configuration meeting" in out and "runners-up:" in out
    assert "(2 at a time, prefix caches off)" in out and "events/s" in out and "goodput" in out
    capped = ["--jobs", "64", "--max-splits", "2", "--chunk-budgets", "256,512"]
    cli.main(["plan", *flags[:-2], *capped])  # meeting or not, it runs 4 at a time:
    capped_out = capsys.readouterr().out  # 2 splits x 2 budgets a cost
    assert "(4 at a time, prefix caches off)" in capped_out
    best = json.loads((tmp_path / "plan.json").read_text())["best"]
    assert f"--scale prefill={best['num_prefill']} --scale decode={best['num_decode']}" in out
    assert (tmp_path / "goodput-vs-cost.png").stat().st_size > 0
    # Cheaper configurations were tried and failed; the chosen one meets the SLOs anew.
    tried = json.loads((tmp_path / "plan.json").read_text())["tried"]
    assert best["cost"] > 2
    assert all(not t["meets"] for t in tried if t["cost"] < best["cost"])
    config = SimConfig(
        best["num_prefill"],
        best["num_decode"],
        SchedulerLimits(),
        max_num_batched_tokens=best["chunk_budget"],
    )
    again = evaluate(cpu_like_profile(), load_workload(BUSY), config, parse_slo(slo))
    assert again.meets and again.summary.ttft_p99 <= 2.0 and again.summary.tpot_p99 <= 0.3


def test_plan_emits_a_kustomize_replica_overlay(profile_path, capsys):
    flags = ["--slo", "ttft_p99=5s", "--max-workers", "4", "--emit", "k8s"]
    assert plan(profile_path, *flags, "--chunk-budgets", "256") == 0
    out = capsys.readouterr().out
    overlay = yaml.safe_load(out[out.index("# kustomization.yaml") :])
    assert overlay["kind"] == "Kustomization" and overlay["resources"] == ["../k8s"]
    assert [r["name"] for r in overlay["replicas"]] == ["tandem-prefill", "tandem-decode"]
    assert 'TANDEM_MAX_NUM_BATCHED_TOKENS: "256"' in out


def planned(num_prefill: int, num_decode: int, chunk_budget: int) -> Candidate:
    """A plan's pick, for its deployment alone."""
    return Candidate(num_prefill, num_decode, chunk_budget, summarize([]), True, {}, 0, 0, 0, 0.0)


def test_the_compose_emit_carries_the_chunk_budget_in_an_override_file():
    """docker-compose.yml sets no chunk budget (the workers' default, 512, would run): the plan
    comes as an override file for the prefill service, layered with `-f`, and its command."""
    out = emit(planned(12, 3, 1024), "compose")
    assert yaml.safe_load(out) == {
        "services": {"prefill": {"environment": {"TANDEM_MAX_NUM_BATCHED_TOKENS": "1024"}}}
    }
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert isinstance(compose["services"]["prefill"]["environment"], dict)  # so they merge
    assert "TANDEM_MAX_NUM_BATCHED_TOKENS" not in compose["services"]["prefill"]["environment"]
    environ = {"TANDEM_MAX_NUM_BATCHED_TOKENS": "1024"}
    assert config_from_args(WorkerConfig, None, environ).max_num_batched_tokens == 1024
    (command,) = [line for line in out.splitlines() if "docker compose" in line]
    assert shlex.split(command.lstrip("# ")) == [
        *("docker", "compose", "-f", "docker-compose.yml", "-f", "compose/plan.yml"),
        *("up", "-d", "--scale", "prefill=12", "--scale", "decode=3"),
    ]
    assert out.splitlines()[0].startswith("# compose/plan.yml:")


def test_the_k8s_emit_patches_the_budget_and_the_autoscalers_bounds():
    """A 12P3D plan: the base's prefill HPA (at most 8) would scale it down to 8 prefill pods,
    and the decode one (at least 2) a 12P1D plan up to 2; the overlay holds both at the plan,
    and sets the prefill ConfigMap's budget (the base's 512)."""
    overlay = yaml.safe_load(emit(planned(12, 3, 1024), "k8s"))
    counts = {r["name"]: r["count"] for r in overlay["replicas"]}
    assert counts == {"tandem-prefill": 12, "tandem-decode": 3}
    patches = {
        (p["kind"], p["metadata"]["name"]): p
        for p in (yaml.safe_load(patch["patch"]) for patch in overlay["patches"])
    }
    budget = patches["ConfigMap", "tandem-prefill"]["data"]
    assert budget == {"TANDEM_MAX_NUM_BATCHED_TOKENS": "1024"}
    for name, count in (("tandem-prefill", 12), ("tandem-decode", 3)):
        spec = patches["HorizontalPodAutoscaler", name]["spec"]
        assert spec == {"minReplicas": count, "maxReplicas": count}
    small = yaml.safe_load(emit(planned(12, 1, 512), "k8s"))["patches"][-1]["patch"]
    assert yaml.safe_load(small)["spec"] == {"minReplicas": 1, "maxReplicas": 1}


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (with kustomize) not found")
def test_the_k8s_emit_builds_on_the_base_into_the_planned_cluster(tmp_path):
    """kustomize builds the overlay, put beside a copy of compose/k8s: the Deployments, the
    prefill ConfigMap and both HPAs say the plan; everything else is the base's."""
    shutil.copytree(ROOT / "compose" / "k8s", tmp_path / "k8s")
    (tmp_path / "plan").mkdir()
    (tmp_path / "plan" / "kustomization.yaml").write_text(emit(planned(12, 3, 1024), "k8s"))

    def build(folder: str) -> dict[tuple[str, str], dict]:
        text = subprocess.run(
            ["kubectl", "kustomize", str(tmp_path / folder)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        docs = [d for d in yaml.safe_load_all(text) if d]
        return {(d["kind"], d["metadata"]["name"]): d for d in docs}

    base, built = build("k8s"), build("plan")
    assert built.keys() == base.keys()
    expected = copy.deepcopy(base)
    expected["Deployment", "tandem-prefill"]["spec"]["replicas"] = 12
    expected["Deployment", "tandem-decode"]["spec"]["replicas"] = 3
    expected["ConfigMap", "tandem-prefill"]["data"]["TANDEM_MAX_NUM_BATCHED_TOKENS"] = "1024"
    for name, count in (("tandem-prefill", 12), ("tandem-decode", 3)):
        expected["HorizontalPodAutoscaler", name]["spec"].update(
            minReplicas=count, maxReplicas=count
        )
    assert built == expected


def test_side_by_side_judges_answer_as_one_process_does():
    """Configurations simulated in two forked processes give the plan one process gives: the
    same candidates, in the same order, the same cheapest."""
    slo = parse_slo("ttft_p99=2s,tpot_p99=300ms")
    requests = load_workload(BUSY)
    plans = []
    for jobs in (1, 2):
        with Judges(cpu_like_profile(), requests, SchedulerLimits(), slo, jobs) as judges:
            plans.append(search(6, [256, 512], judges, max_splits=3))
    alone, side_by_side = plans
    assert len(alone.tried) > 4 and alone.best is not None
    assert [c.name for c in side_by_side.tried] == [c.name for c in alone.tried]
    assert [c.summary for c in side_by_side.tried] == [c.summary for c in alone.tried]
    assert [c.num_events for c in side_by_side.tried] == [c.num_events for c in alone.tried]
    assert side_by_side.best.name == alone.best.name
    with pytest.raises(PlanError, match="jobs must be at least 1"):
        Judges(cpu_like_profile(), requests, SchedulerLimits(), slo, 0)


def test_cutting_hopeless_simulations_short_changes_no_verdict():
    """Stopping each simulation once its objectives can no longer be met tries the same
    configurations, judges each the same and picks the same cheapest, with the same figures,
    in fewer events; the cut ones say why, and rank after the failures simulated whole."""
    slo = parse_slo("ttft_p99=2s,tpot_p99=300ms")
    requests = load_workload(BUSY)
    plans = []
    for cut in (False, True):
        with Judges(cpu_like_profile(), requests, SchedulerLimits(), slo, 1, False, cut) as judge:
            plans.append(search(6, [256, 512], judge, max_splits=3))
    whole, cut = plans
    assert [c.name for c in cut.tried] == [c.name for c in whole.tried]
    assert [c.meets for c in cut.tried] == [c.meets for c in whole.tried]
    assert cut.best.name == whole.best.name and cut.best.summary == whole.best.summary
    assert all(c.cut_short is None for c in whole.tried)
    cut_short = [c for c in cut.tried if c.cut_short is not None]
    assert cut_short and all(not c.meets for c in cut_short)
    assert all("can no longer be within" in c.cut_short for c in cut_short)
    assert cut.num_events < 0.7 * whole.num_events
    assert cut.runners_up(len(cut.tried))[-1].cut_short is not None


def test_plan_refuses_when_nothing_within_the_limits_meets(profile_path, tmp_path, capsys):
    flags = ["--slo", "ttft_p99=10ms", "--max-workers", "3"]
    assert plan(profile_path, *flags, "--out", str(tmp_path)) == 1
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["best"] is None and saved["closest_whole"]["cut_short"] is None
    assert all(t["cut_short"] is not None for t in saved["tried"])
    out = capsys.readouterr().out
    assert "no configuration of at most 3 workers meets ttft_p99 <= 10 ms" in out
    assert "the closest" in out and "cut short at" in out
    assert "    2-3 | cut short: none can meet them (2 costs tried)" in out.splitlines()
    closest = out.split("the closest, simulated to its end:\n")[1].splitlines()[0]
    assert "fails  TTFT ms p50" in closest and "goodput" in closest
    assert plan(profile_path, "--slo", "ttft_p99=10ms", "--max-workers", "3", "--simulate-all") == 1
    whole = capsys.readouterr().out
    assert "cut short" not in whole and "TTFT ms p50" in whole


def test_a_plan_nothing_can_meet_stops_where_more_workers_stop_helping(
    profile_path, tmp_path, capsys
):
    # A TTFT of 10 ms is below any prefill's time: every cost to --max-workers failed, the
    # doubling simulating clusters of 32, 64, ... 65,536 and 100,000 workers (minutes).
    flags = ["--slo", "ttft_p99=10ms", "--max-workers", "100000", "--jobs", "1"]
    with within_seconds(30):
        assert plan(profile_path, *flags, "--out", str(tmp_path)) == 1
    out = capsys.readouterr().out
    assert "no configuration meets ttft_p99 <= 10 ms with every request served: the" in out
    assert "so more workers do not help; the closest:" in out
    assert "the closest, simulated to its end:" in out
    saved = json.loads((tmp_path / "plan.json").read_text())
    assert saved["best"] is None and max(t["cost"] for t in saved["tried"]) <= 128
    assert "more workers do not help" in saved["stalled"]


def level_candidate(num_prefill, num_decode, budget, ttft_p99, cut_at_s, meets=False):
    """A made-up judged configuration: its TTFT p99 (whole), or where its run was cut."""
    summary = dataclasses.replace(summarize([]), ttft_p99=ttft_p99, num_requests=10)
    return Candidate(
        num_prefill, num_decode, budget, summary, meets, {"prefill": 0.0, "decode": 0.0},
        0, 0, 10, 0.0, None if cut_at_s is None else "ttft_p99 can no longer be within",
        cut_at_s,
    )  # fmt: skip


@pytest.mark.parametrize(
    "ttft_by_cost, best, stalled",
    [
        # Every level cut at the same time, but whole the 32s are closer: on, met at 64.
        ({16: 5.0, 32: 4.0}, "1P63D chunk 512", False),
        # No closer at 32 (to rounding): stopped there, not doubled on to 4,096.
        ({16: 5.0, 32: 5.0 * (1 - 1e-12)}, None, True),
    ],
)
def test_the_doubling_stops_where_a_level_comes_no_closer(ttft_by_cost, best, stalled):
    slo = {"ttft_p99": 2.0}
    judged, wholes = [], []

    def ttft(cost):
        return ttft_by_cost.get(cost, 6.0 if cost < 64 else 1.0)

    def judge(configurations):
        judged.extend(configurations)
        return [
            level_candidate(p, d, b, None, 1.0, meets=ttft(p + d) <= 2.0)
            if ttft(p + d) > 2.0
            else level_candidate(p, d, b, ttft(p + d), None, meets=True)
            for p, d, b in configurations
        ]

    def whole(candidates):
        wholes.extend(candidates)
        return [
            level_candidate(c.num_prefill, c.num_decode, 512, ttft(c.cost), None)
            for c in candidates
        ]

    plan = search(4096, [512], judge, 2, slo, whole)
    assert (plan.best.name if plan.best else None) == best
    assert (plan.stalled is not None) == stalled
    assert max(p + d for p, d, _ in judged) == (32 if stalled else 64)
    assert {c.cost for c in wholes} == {16, 32}  # the levels compared
    if not stalled:  # (the stop changes no plan it lets through)
        assert search(4096, [512], judge, 2).best.name == best


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--slo", "speed=fast"], "--slo entry"),
        (["--slo", "ttft_p99=2s", "--max-workers", "1"], "--max-workers must be at least 2"),
        (["--slo", "ttft_p99=2s", "--chunk-budgets", "8"], "at least 16"),
        (["--slo", "ttft_p99=2s", "--chunk-budgets", "lots"], "token counts like"),
        (["--slo", "ttft_p99=2s", "--max-splits", "0"], "--max-splits"),
        (["--slo", "ttft_p99=2s", "--jobs", "0"], "--jobs must be at least 1"),
        (["--slo", "ttft_p99=2s", "--out", __file__], "is a file"),
        # (found only after the whole search, a bare `[Errno 2]`: procfs makes no folder)
        (["--slo", "ttft_p99=2s", "--out", "/proc/tandem-plan"], "cannot be written to"),
    ],
)
def test_wrong_flag_values_exit_2(profile_path, capsys, flags, message):
    assert plan(profile_path, *flags) == 2
    assert message in capsys.readouterr().err


def test_wrong_profile_or_workload_exit_2(profile_path, tmp_path, capsys):
    missing = str(tmp_path / "none.json")
    assert (
        cli.main(["plan", "--workload", WORKLOAD, "--slo", "ttft_p99=1s", "--profile", missing])
        == 2
    )
    assert "cannot read profile" in capsys.readouterr().err
    flags = ["plan", "--workload", "poisson:rate=-1", "--slo", "ttft_p99=1s"]
    assert cli.main([*flags, "--profile", profile_path]) == 2
    assert "positive" in capsys.readouterr().err
    for wrong_choice in (["--emit", "helm"], ["--prefix-cache", "maybe"]):
        with pytest.raises(SystemExit) as exit_info:
            plan(profile_path, "--slo", "ttft_p99=1s", *wrong_choice)
        assert exit_info.value.code == 2


def test_a_shared_prefix_is_planned_with_the_workers_caches(profile_path, capsys):
    """Prompts starting with their tenant's 512-token system prompt: with the caches simulated
    (auto: the workload shares tokens) the system prompt is computed once per prefill worker,
    and fewer prefill workers meet the objective than when every prompt is computed whole."""
    shared = "poisson:rate=2,n=60,prompt=600-1200,output=4-16,prefix=512,tenants=2,seed=1"
    flags = ["--workload", shared, "--profile", profile_path, "--max-workers", "6"]
    flags += ["--slo", "ttft_p99=8s,tpot_p99=500ms", "--jobs", "1"]
    assert cli.main(["plan", *flags]) == 0
    cached = capsys.readouterr().out
    assert "prefix caches on" in cached and cached.splitlines()[1].split()[0] == "3P1D"
    assert cli.main(["plan", *flags, "--prefix-cache", "off"]) == 0
    whole = capsys.readouterr().out
    assert "prefix caches off" in whole and whole.splitlines()[1].split()[0] == "5P1D"


def test_a_profile_without_a_context_cost_is_noted_where_it_matters(profile_path, capsys):
    """The shared prefix above read from the caches: its chunks come after context, which a
    profile measured before the context cost times as if alone; said on stderr, once."""
    shared = "poisson:rate=2,n=20,prompt=600-1200,output=4-16,prefix=512,tenants=2,seed=1"
    flags = ["--workload", shared, "--slo", "ttft_p99=60s,tpot_p99=5s", "--jobs", "1"]
    assert cli.main(["plan", *flags, "--profile", profile_path, "--max-workers", "2"]) == 0
    assert capsys.readouterr().err.count("prefill context cost is 0") == 1
    profile = cpu_like_profile()
    requests = load_workload(shared)
    assert context_note(profile, requests, 512, prefix_cache=True) is not None
    assert context_note(profile, requests, 512, prefix_cache=False) is not None  # chunked
    # A budget that holds every prompt, but steps capped to 0.2 s: chunked all the same.
    assert context_note(profile, requests, 2048, prefix_cache=False) is not None
    uncapped = cpu_like_profile(step_time_target_s=None)
    assert context_note(uncapped, requests, 2048, prefix_cache=False) is None  # none chunked
    measured = dataclasses.replace(profile, prefill_s_per_context_pair=1e-6)
    assert context_note(measured, requests, 512, prefix_cache=True) is None
