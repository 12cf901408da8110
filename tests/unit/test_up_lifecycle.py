"""`tandem up`'s care of its children once the cluster is up: restarts and the stop.

The children here are small Python processes standing in for the services: real processes,
real signals, real exits, no model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from services.commands import cli, up

# A child that lives `argv[1]` seconds, then exits with 1 (as a crash).
SHORT_LIVED = "import sys, time; time.sleep(float(sys.argv[1])); sys.exit(1)"

# A child that notes each SIGTERM in a shared log, then drains `drain_s` and exits 0, or, when
# stubborn, goes on running (so only the SIGKILL ends it). It says "ready" once its handler is set.
NOTING = r"""
import os, signal, sys, time
name, log, drain_s, mode = sys.argv[1:]
def note(event):
    with open(log, "a") as file:
        file.write(f"{name} {event}\n")
def on_sigterm(*_):
    note("term")
    if mode == "stubborn":
        return
    time.sleep(float(drain_s))
    note("exit")
    os._exit(0)
signal.signal(signal.SIGTERM, on_sigterm)
print("ready", flush=True)
time.sleep(60)
"""


def _cluster(tmp_path: Path, **fields) -> up.LocalCluster:
    args = cli.build_parser(["up"]).parse_args(["up"])
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    return up.LocalCluster(args, run_dir=str(run_dir), echo_logs=False, **fields)


class _ShortLivedChildren:
    """Stands in for `LocalCluster._popen`: the n-th child it starts lives `lifetimes_s[n]`
    seconds (the last one for those past the list), then exits with 1."""

    def __init__(self, lifetimes_s: list[float]):
        self.lifetimes_s = lifetimes_s
        self.num_started = 0

    def __call__(self, argv: list[str], env: dict[str, str]) -> subprocess.Popen:
        lifetime_s = self.lifetimes_s[min(self.num_started, len(self.lifetimes_s) - 1)]
        self.num_started += 1
        return subprocess.Popen(
            [sys.executable, "-c", SHORT_LIVED, str(lifetime_s)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )


def _watch(cluster: up.LocalCluster, children: _ShortLivedChildren, num_starts: int) -> list[str]:
    """`tandem up`'s loop (`restart_dead`, polled) until a child is past its restarts, or
    `num_starts` children have been started; returns the broken children's names."""
    deadline = time.monotonic() + 60
    while children.num_started < num_starts and time.monotonic() < deadline:
        broken = cluster.restart_dead()
        if broken:
            return broken
        time.sleep(0.02)
    assert children.num_started >= num_starts, "the children were not started again in time"
    return []


def test_a_child_that_dies_now_and_then_never_stops_the_cluster(tmp_path, monkeypatch):
    """Its restarts were counted over the cluster's whole life: the tester's scheduler, killed
    once a minute, stopped the cluster at its sixth death ("scheduler kept exiting"), healthy
    workers and requests under way with it. A child that ran for `STABLE_RUN_S` is not looping."""
    monkeypatch.setattr(up, "STABLE_RUN_S", 0.2)
    children = _ShortLivedChildren([0.4])  # each one past the stable period
    monkeypatch.setattr(up.LocalCluster, "_popen", lambda self, argv, env: children(argv, env))
    cluster = _cluster(tmp_path)
    try:
        cluster._spawn("scheduler", ["scheduler"])
        assert _watch(cluster, children, num_starts=up.MAX_RESTARTS + 3) == []
        assert cluster.children[0].restarts == 1  # (the count began again at each death)
    finally:
        cluster.stop(grace_s=1)


def test_a_child_in_a_crash_loop_still_stops_the_cluster_after_a_stable_run(tmp_path, monkeypatch):
    """Deaths in quick succession count: `MAX_RESTARTS` of them, then a stable run (the count
    begins again), then `MAX_RESTARTS` quick ones more, and the next one stops the cluster."""
    monkeypatch.setattr(up, "STABLE_RUN_S", 2.0)
    quick = [0.0] * up.MAX_RESTARTS
    children = _ShortLivedChildren([*quick, 2.5, *quick, 0.0])
    monkeypatch.setattr(up.LocalCluster, "_popen", lambda self, argv, env: children(argv, env))
    cluster = _cluster(tmp_path)
    try:
        cluster._spawn("decode-0", ["decode"])
        assert _watch(cluster, children, num_starts=100) == ["decode-0"]
        # (The first start, `MAX_RESTARTS` restarts up to the stable run's death, as many after.)
        assert children.num_started == 1 + 2 * up.MAX_RESTARTS
    finally:
        cluster.stop(grace_s=1)


def test_a_worker_in_a_crash_loop_is_left_stopped_while_a_peer_of_its_role_serves(
    tmp_path, monkeypatch
):
    """One crash-looping worker of two stopped the whole cluster, its healthy peer with it."""
    children = _ShortLivedChildren([0.0])
    monkeypatch.setattr(up.LocalCluster, "_popen", lambda self, argv, env: children(argv, env))
    cluster = _cluster(tmp_path)
    peer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        cluster.children.append(up.Child("decode-1", ["decode"], peer))
        cluster._spawn("decode-0", ["decode"])
        assert _watch(cluster, children, num_starts=100) == ["decode-0"]
        assert cluster.leave_stopped(["decode-0"]) is None
        num_started = children.num_started
        time.sleep(0.1)
        assert cluster.restart_dead() == [] and children.num_started == num_started  # left be
        assert peer.poll() is None
        # The last of a role, or a service, stops the cluster (it would serve nothing).
        assert "no other decode worker" in cluster.leave_stopped(["decode-1"])
        assert cluster.leave_stopped(["scheduler"]) == "scheduler kept exiting"
    finally:
        cluster.stop(grace_s=1)


STOP_ORDER = ["gateway", "batch", "scheduler", "prefill-0", "decode-0"]


def _noting_children(cluster: up.LocalCluster, log: Path, modes: dict[str, tuple[float, str]]):
    """Children in the order `start` spawns them, each `NOTING` with its (drain_s, mode)."""
    children = []
    for name in ("scheduler", "prefill-0", "decode-0", "gateway", "batch"):
        drain_s, mode = modes.get(name, (0.0, "drains"))
        process = subprocess.Popen(
            [sys.executable, "-c", NOTING, name, str(log), str(drain_s), mode],
            stdout=subprocess.PIPE,
        )
        children.append(up.Child(name, [name], process))
    for child in children:
        assert child.process.stdout.readline() == b"ready\n"  # (its handler set)
    cluster.children += children


def _events(log: Path) -> list[str]:
    return log.read_text().splitlines()


def test_the_stop_lets_the_gateway_drain_before_the_rest_stop(tmp_path):
    """Every child got SIGTERM at once: the scheduler and workers were gone in 0.1 s while the
    gateway drained its `--shutdown-grace-s`, so no token came and every stream under way ended
    with "the request ran past its grace". The gateway goes first, then the batch service (the
    gateway relays its uploads), then the rest."""
    cluster = _cluster(tmp_path, stop_grace_s=10.0)
    log = tmp_path / "signals.log"
    _noting_children(cluster, log, {"gateway": (0.5, "drains"), "batch": (0.2, "drains")})
    cluster.stop()
    events = _events(log)
    assert events[:4] == ["gateway term", "gateway exit", "batch term", "batch exit"], events
    rest = [f"{name} {event}" for name in STOP_ORDER[2:] for event in ("term", "exit")]
    assert sorted(events[4:]) == sorted(rest)
    assert [c.process.returncode for c in cluster.children] == [0] * 5  # none killed
    assert not Path(cluster.run_dir).exists()


def test_a_gateway_that_will_not_stop_is_killed_after_the_grace_and_the_rest_then_stopped(
    tmp_path,
):
    cluster = _cluster(tmp_path, stop_grace_s=0.5)
    log = tmp_path / "signals.log"
    _noting_children(cluster, log, {"gateway": (0.0, "stubborn"), "decode-0": (0.0, "stubborn")})
    start = time.monotonic()
    cluster.stop()
    elapsed_s = time.monotonic() - start
    codes = {c.name: c.process.returncode for c in cluster.children}
    assert codes == {"scheduler": 0, "prefill-0": 0, "decode-0": -9, "gateway": -9, "batch": 0}
    assert _events(log)[:2] == ["gateway term", "batch term"]  # (after the gateway's kill)
    assert 1.0 <= elapsed_s < 5  # a grace for the gateway's stage, one for the rest's
    assert not Path(cluster.run_dir).exists()


def test_the_stop_leaves_children_already_dead_alone(tmp_path):
    """A child that died (and was not started again) is waited for, not signalled."""
    cluster = _cluster(tmp_path, stop_grace_s=0.5)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    cluster.children.append(up.Child("prefill-1", ["prefill"], dead))
    log = tmp_path / "signals.log"
    _noting_children(cluster, log, {})
    cluster.stop()
    assert dead.returncode == 3
    assert sorted(_events(log)) == sorted(f"{n} {e}" for n in STOP_ORDER for e in ("term", "exit"))


def test_a_stop_without_grace_kills_a_draining_gateway_at_once(tmp_path):
    cluster = _cluster(tmp_path)
    log = tmp_path / "signals.log"
    _noting_children(cluster, log, {"gateway": (5.0, "drains")})
    start = time.monotonic()
    cluster.stop(grace_s=0.0)
    assert time.monotonic() - start < 3
    assert {c.name: c.process.returncode for c in cluster.children}["gateway"] == -9


def test_a_start_removes_the_run_directories_of_dead_tandem_ups_only(tmp_path, monkeypatch):
    """A `tandem up` killed with SIGKILL left its run directory (sockets, the batch data it
    kept there) in /tmp for good."""
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()  # (its pid names no process now)
    for name, owner in (("tandem-dead", dead.pid), ("tandem-live", 1), ("tandem-self", None)):
        (tmp_path / name).mkdir()
        (tmp_path / name / up.OWNER_FILE).write_text(str(owner or os.getpid()))
    (tmp_path / "tandem-unowned").mkdir()  # not made by `make_run_dir`: not ours to judge
    (tmp_path / "other-dead").mkdir()
    (tmp_path / "other-dead" / up.OWNER_FILE).write_text(str(dead.pid))
    monkeypatch.setattr(up.tempfile, "tempdir", str(tmp_path))
    run_dir = Path(up.make_run_dir())
    assert run_dir.parent == tmp_path and run_dir.name.startswith(up.RUN_DIR_PREFIX)
    assert int((run_dir / up.OWNER_FILE).read_text()) == os.getpid()
    left = sorted(p.name for p in tmp_path.iterdir() if p != run_dir)
    assert left == ["other-dead", "tandem-live", "tandem-self", "tandem-unowned"]
