"""The compiled scheduler and simulator (`services/compiled.py`): built by mypyc from the same
source, they must decide exactly as the Python. Each check runs a fresh interpreter with
`TANDEM_COMPILED` set, since the choice acts when a package is first imported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from services import compiled
from shared import wire

ROOT = Path(__file__).resolve().parents[2]

# The simulator's scenarios (the real core under simulated workers): every record, every
# worker's figures and the queue's timeline, hashed.
SCENARIOS = r"""
import dataclasses, hashlib, json, random, sys
from loadtest.plan import DEFAULT_PROFILE
from services.planner.profile import WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import load_workload
import services.planner.simulator as simulator
import services.scheduler.core as core

profile = WorkerProfile.load(str(DEFAULT_PROFILE))

def tied():  # same-time arrivals, shuffled: ties broken by the core's order alone
    requests = load_workload("poisson:rate=4,n=300,prompt=8-512,output=1-64,tenants=7,seed=3")
    requests = [dataclasses.replace(r, arrival_time=float(round(r.arrival_time))) for r in requests]
    random.Random(1).shuffle(requests)
    return requests

scenarios = {
    "overload": (SimConfig(2, 1), "poisson:rate=5,n=400,prompt=8-1500,output=1-200,tenants=5"),
    "many": (SimConfig(50, 50), "poisson:rate=40,n=1500,prompt=8-512,output=1-64,tenants=300"),
    "latency": (SimConfig(3, 2, network_latency_s=0.003),
                "poisson:rate=1,n=200,prompt=8-512,output=1-64,tenants=4"),
    "tied": (SimConfig(4, 2), None),
    "prefix_cache": (SimConfig(3, 2, prefix_cache=True),
                     "poisson:rate=2,n=300,prompt=600-1200,output=4-64,prefix=512,tenants=3"),
}
out = {"files": [core.__file__, simulator.__file__]}
for name, (config, workload) in scenarios.items():
    result = Simulator(profile, config).run(tied() if workload is None else load_workload(workload))
    facts = [[dataclasses.asdict(r) for r in result.records],
             {p: dataclasses.asdict(s) for p, s in result.decode_stats.items()},
             {p: dataclasses.asdict(s) for p, s in result.prefill_stats.items()},
             result.queue_timeline]
    text = json.dumps(facts, sort_keys=True, default=str)
    out[name] = hashlib.sha256(text.encode()).hexdigest()
print(json.dumps(out))
"""

# Tests that hand the compiled classes what their annotations refuse, on purpose: a worker with
# an int for a name (the C rooms' wrong-input tests) and the reference scheduler's own worker
# class (the scan the indexed core is compared with). Compiled, those fail at the door.
FOREIGN_TYPES = "not (room_native and wrong_input) and not decides_as_the_scanning_one"
# And tests that make one request's handling raise by replacing a core method for it: a
# compiled class's methods cannot be replaced (they run in Python, against the same source).
INJECTED = "not past_one_that_raises and not placement_raises"
POLICY_TESTS = [
    "tests/unit/test_scheduler_core.py",
    "tests/unit/test_scheduler_fair_dispatch.py",
    "tests/unit/test_scheduler_indexes.py",
    "tests/unit/test_scheduler_adoption.py",
    "tests/unit/test_scheduler_decode_pools.py",
    "tests/unit/test_fair_share.py",
    "tests/unit/test_fair_share_bulk.py",
    "tests/unit/test_wait_forecast.py",
    "tests/unit/test_prefix_routing.py",
    "tests/unit/test_queue_index_native.py",
    "tests/unit/test_decode_room_native.py",
    "tests/unit/test_prefill_room_native.py",
    "tests/unit/test_planner_sim.py",
    "tests/unit/test_planner_caches.py",
    "tests/unit/test_plan.py",
    "tests/unit/test_plan_shards.py",
    "tests/unit/test_plan_validate.py",
    "tests/unit/test_sim_scale.py",
]


def run(code: list[str], choice: str, timeout: float = 900) -> subprocess.CompletedProcess:
    env = {**os.environ, compiled.ENV: choice}
    return subprocess.run(
        [sys.executable, *code], cwd=ROOT, env=env, capture_output=True, text=True,
        timeout=timeout, check=False,
    )  # fmt: skip


@pytest.fixture(scope="module")
def build() -> Path:
    """The compiled modules, built once (minutes) or found in the cache."""
    result = run(["-m", "services.compiled"], "off", timeout=compiled.BUILD_TIMEOUT_S)
    assert result.returncode == 0, result.stdout + result.stderr
    return Path(result.stdout.strip().splitlines()[-1])


def test_compiled_the_simulator_and_the_scheduler_play_exactly_as_the_python(build):
    by_choice = {}
    for choice in ("off", "on"):
        result = run(["-c", SCENARIOS], choice)
        assert result.returncode == 0, result.stderr[-3000:]
        by_choice[choice] = json.loads(result.stdout.strip().splitlines()[-1])
    python, native = by_choice["off"].pop("files"), by_choice["on"].pop("files")
    assert [Path(f).name for f in python] == ["core.py", "simulator.py"]
    # (A module first imported by another compiled one is named under the build's `lib/`.)
    assert all(f.startswith(str(build)) and f.endswith(".so") for f in native), native
    assert by_choice["on"] == by_choice["off"]


def test_the_policy_and_simulator_tests_pass_compiled(build):
    check = "import services.scheduler.fair_share as f, services.planner.profile as p\n"
    check += "for function in (f._earliest, p._interpolate):\n"
    check += "    assert type(function).__name__ == 'builtin_function_or_method', function"
    assert run(["-c", check], "on").returncode == 0  # the tests below run compiled code
    result = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", "-k",
                  f"{FOREIGN_TYPES} and {INJECTED}", *POLICY_TESTS], "on")  # fmt: skip
    assert result.returncode == 0, result.stdout[-5000:]
    assert " passed" in result.stdout and "skipped" not in result.stdout


def test_off_imports_the_python_source():
    result = run(["-c", "import services.scheduler.core as c; print(c.__file__)"], "off")
    assert result.returncode == 0 and result.stdout.strip().endswith("services/scheduler/core.py")


def test_a_wrong_choice_fails_the_import_with_a_clear_error():
    result = run(["-c", "import services.scheduler.core"], "sometimes")
    assert result.returncode != 0
    assert "TANDEM_COMPILED must be one of off, on, got 'sometimes'" in result.stderr


def test_a_build_without_mypy_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setattr(compiled, "_mypy_version", lambda: "none")
    with pytest.raises(
        compiled.CompiledUnavailable, match=r"pip install 'tandem-serve\[compiled\]'"
    ):
        compiled.build_modules(tmp_path / "build")
    assert not (tmp_path / "build").exists()


def test_a_failed_build_names_the_error_and_leaves_nothing(monkeypatch, tmp_path):
    package = tmp_path / "services" / "broken"
    package.mkdir(parents=True)
    (tmp_path / "services" / "__init__.py").write_text("")
    (package / "__init__.py").write_text("")
    (package / "bad.py").write_text("def f(x: int) -> str:\n    return x\n")
    monkeypatch.setattr(compiled, "SERVICES", tmp_path / "services")
    monkeypatch.setattr(compiled, "PACKAGES", {"broken": ("bad",)})
    build = tmp_path / "cache" / "build"
    with pytest.raises(compiled.CompiledUnavailable, match=r"bad\.py:2: error: Incompatible"):
        compiled.build_modules(build)
    assert not build.exists() and list(build.parent.iterdir()) == []


def test_an_edited_source_gets_a_build_of_its_own(monkeypatch, tmp_path):
    before = compiled.build_dir()
    copy = tmp_path / "services"
    copy.mkdir()
    (copy / "__init__.py").symlink_to(ROOT / "services" / "__init__.py")
    for package in compiled.PACKAGES:
        (copy / package).symlink_to(ROOT / "services" / package)
    monkeypatch.setattr(compiled, "SERVICES", copy)
    assert compiled.build_dir() == before  # the same sources: the same build
    edited = tmp_path / "edited"
    edited.mkdir()
    shutil.copy(ROOT / "services" / "__init__.py", edited)
    for package in compiled.PACKAGES:
        shutil.copytree(ROOT / "services" / package, edited / package)
    core = edited / "scheduler" / "core.py"
    core.write_text(core.read_text() + "\n# an edit\n")
    monkeypatch.setattr(compiled, "SERVICES", edited)
    assert compiled.build_dir() != before


def next_but_statuses(socket: zmq.Socket) -> wire.Message:
    """The next message that is no cluster status (one comes with the HELLO's answer, then
    one each tick, as to any gateway)."""
    while True:
        assert socket.poll(10_000)
        message = wire.recv(socket)
        if not isinstance(message, wire.ClusterStatus):
            return message


@pytest.mark.parametrize("choice", ["on", "off"])
def test_the_scheduler_service_runs_the_chosen_core_and_says_which(build, tmp_path, choice):
    address = f"ipc://{tmp_path}/scheduler.sock"
    log = tmp_path / "scheduler.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "scheduler", "--address", address],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
        env={**os.environ, compiled.ENV: choice, "TANDEM_LOG_FORMAT": "json"},
    )  # fmt: skip
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    try:
        deadline = time.monotonic() + 60
        while "scheduler listening" not in log.read_text():
            assert process.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        socket.connect(address)
        wire.send(socket, wire.Hello(schema_version=wire.SCHEMA_VERSION, role="gateway",
                                     peer_id="g", model="smollm2", address="ipc:///g",
                                     num_kv_blocks=0, block_size=0, max_num_seqs=0))  # fmt: skip
        assert socket.poll(10_000) and wire.recv(socket).accepted
        submit = wire.Submit(request_id="r", prompt_token_ids=[1, 2, 3],
                             sampling=wire.SamplingSpec(max_tokens=4), tenant="t", priority=0,
                             gateway_peer_id="g", arrival_time=0.0)  # fmt: skip
        wire.send(socket, submit)
        reply = next_but_statuses(socket)  # no worker yet: refused, by the core's admission
        assert isinstance(reply, wire.SubmitReply) and reply.status_code == 503, reply
        expected = "compiled" if choice == "on" else "python"
        assert f'"core": "{expected}"' in log.read_text()
    finally:
        socket.close()
        context.term()
        process.terminate()
        process.wait(10)


def test_an_edit_of_the_types_it_reads_gets_a_build_of_its_own(monkeypatch, tmp_path):
    """`shared`'s annotations are what the compiled code checks its calls' answers against."""
    before = compiled.build_dir()
    for tree in compiled.TYPED_TREES:
        shutil.copytree(ROOT / tree, tmp_path / tree, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(compiled, "ROOT", tmp_path)
    assert compiled.build_dir() == before
    wire_base = tmp_path / "shared" / "wire_base.py"
    wire_base.write_text(wire_base.read_text() + "\n# an edit\n")
    assert compiled.build_dir() != before


def test_a_killed_builds_scratch_folder_is_removed_by_the_next_build(tmp_path):
    """A build killed midway leaves its temporary folder (~120 MB); the next build removes
    those older than any live build can be, and leaves a recent one (a build in progress)."""
    now = time.time()
    abandoned, in_progress = tmp_path / "building-abc", tmp_path / "building-def"
    for folder in (abandoned, in_progress):
        (folder / "services").mkdir(parents=True)
        (folder / "services" / "core.py").write_text("")
    old = now - 2 * compiled.BUILD_TIMEOUT_S - 60
    os.utime(abandoned, (old, old))
    finished = tmp_path / "0123456789abcdef"  # a finished build, however old, stays
    finished.mkdir()
    os.utime(finished, (old, old))
    compiled.remove_abandoned_builds(tmp_path, now)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0123456789abcdef", "building-def"]
