"""The docker-compose cluster end to end, under a real Docker engine, through testcontainers'
DockerCompose: one compose project for the whole module, its gateway published on 127.0.0.1.

The tests run in order on that one project, as a user would drive it: build the image
(compose/build-image.sh: a Debian base and torch's CPU wheel, no image registry needed), `up`
(prepare, keys, scheduler, gateway, one prefill and one decode worker and the batch service, all
healthy), complete and stream through the `openai` package with greedy output equal to the
engine's, run a batch job through the batch service (its lines over the gateway's CurveZMQ RPC
door), scale to two prefill
and two decode workers that all serve, `docker kill` a decode worker under streaming load,
disconnect a worker from the compose network and connect it again, restart the scheduler under
load, and `down`. Every load is a fixed set of requests with a time limit.

An engine is found as `docker` finds it (DOCKER_HOST); `bash compose/docker-engine.sh
.venv/bin/python -m pytest tests/e2e/test_compose.py` starts a private one. Without an engine the
tests are skipped with the reason, except in CI (CI=true), where that is a failure.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from loadtest.served import free_port

if TYPE_CHECKING:
    from testcontainers.compose import DockerCompose

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
LONG_RUNNING = ("scheduler", "gateway", "prefill", "decode", "batch")
# Twice the default: four workers on two shared cores can stall a heartbeat for seconds.
HEARTBEAT_TIMEOUT_S = 20
SUBJECTS = ("The history of the printing press", "A recipe for bread:", "def fibonacci(n):",
            "Once upon a time in a small village")  # fmt: skip
# Sixteen concurrent streams: each subject in four framings.
PROMPTS = [f"{frame}{s}" for frame in ("", "Note: ", "Draft 2. ", "> ") for s in SUBJECTS]
MAX_TOKENS = 24
LOAD_TIMEOUT_S = 300.0  # a whole load, kill or partition included
PROJECT_PREFIX = "tandem-test-"  # the compose project's name is this and the test's pid


def _engine_problem() -> str | None:
    """Why this machine cannot run the cluster in containers, or None when it can."""
    docker = shutil.which("docker")
    if docker is None:
        return "no docker CLI on PATH"
    try:
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
        if info.returncode != 0:
            lines = (info.stderr or info.stdout).strip().splitlines() or ["no output"]
            return f"no Docker engine reachable (`docker info`: {lines[-1]})"
        compose = subprocess.run(
            [docker, "compose", "version"], capture_output=True, text=True, timeout=30
        )
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"`docker` did not answer: {error}"
    if compose.returncode != 0:
        return "the Docker engine answers, but the `docker compose` plugin is missing"
    return None


ENGINE_PROBLEM = _engine_problem()
IN_CI = os.environ.get("CI") == "true"
pytestmark = [pytest.mark.slow]
if not IN_CI:  # in CI a missing engine fails the fixture instead
    pytestmark.append(
        pytest.mark.skipif(
            ENGINE_PROBLEM is not None, reason=f"needs a Docker engine: {ENGINE_PROBLEM}"
        )
    )


def docker(*args: str, timeout_s: float = 120) -> str:
    done = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, f"docker {' '.join(args)}:\n{done.stdout}{done.stderr}"
    return done.stdout


@dataclass
class ComposeCluster:
    compose: DockerCompose
    project: str
    url: str
    log_lines: list[str] = field(default_factory=list)

    def ready_info(self) -> dict:
        return httpx.get(self.url + "/ready", timeout=5).json()

    def metrics(self) -> dict:
        """The gateway's /metrics: its own and every peer's samples, labelled `peer`."""
        return parse(httpx.get(self.url + "/metrics", timeout=20).text)

    def compose_run(self, *args: str, timeout_s: float = 600) -> str:
        """A `docker compose` command on this project (DockerCompose has no scaling call)."""
        command = [*self.compose.compose_command_property, *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"
        return done.stdout

    def containers(self, service: str) -> list:
        return [c for c in self.compose.get_containers() if c.Service == service]

    def logs_tail(self, num_chars: int = 6000) -> str:
        stdout, stderr = self.compose.get_logs()
        return (stdout + stderr)[-num_chars:]

    def wait(
        self, num_prefill: int, num_decode: int, timeout_s: float = 600.0, idle: bool = False
    ) -> dict:
        """Until /ready counts exactly these healthy workers and every long-running container
        is healthy; with `idle`, also nothing in flight and every KV block free."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                response = httpx.get(self.url + "/ready", timeout=5)
                body = last = response.json()
                healthy = [w for w in body["workers"] if w["healthy"]]
                counts = (sum(w["role"] == "prefill" for w in healthy),
                          sum(w["role"] == "decode" for w in healthy))  # fmt: skip
                settled = not idle or (body["in_flight"] == 0 and all(map(_idle, healthy)))
                if (
                    response.status_code == 200
                    and counts == (num_prefill, num_decode)
                    and len(body["workers"]) == num_prefill + num_decode
                    and settled
                    and self._all_healthy()
                ):
                    return body
            except (httpx.HTTPError, ValueError, KeyError) as error:
                last = error
            time.sleep(2)
        raise TimeoutError(f"cluster not ready ({last!r}):\n{self.logs_tail()}")

    def _all_healthy(self) -> bool:
        containers = [c for c in self.compose.get_containers() if c.Service in LONG_RUNNING]
        return bool(containers) and all(c.Health == "healthy" for c in containers)


def _idle(worker: dict) -> bool:
    busy = worker["running"] or worker["waiting"] or worker["swapped"]
    return not busy and worker["free_blocks"] == worker["total_blocks"]


def remove_leftovers() -> None:
    """Containers, volumes and networks of earlier runs of this module that never reached `down`
    (a killed run): their restart policy would bring them back with the engine, on our cores.
    A project whose test process still runs (its pid is in the name) is left alone."""
    for kind, listing in (("container", ("ps", "--all", "--format", "{{.Names}}")),
                          ("volume", ("volume", "ls", "--format", "{{.Name}}")),
                          ("network", ("network", "ls", "--format", "{{.Name}}"))):  # fmt: skip
        names = docker(*listing).split()
        orphans = [n for n in names if n.startswith(PROJECT_PREFIX) and not _project_alive(n)]
        if orphans:
            docker(kind, "rm", *(["--force"] if kind == "container" else []), *orphans)


def _project_alive(name: str) -> bool:
    pid = name.removeprefix(PROJECT_PREFIX).replace("_", "-").partition("-")[0]
    return pid.isdigit() and Path(f"/proc/{pid}").exists()


@pytest.fixture(scope="module")
def compose_cluster():
    if ENGINE_PROBLEM is not None:  # only in CI: elsewhere the module is skipped
        pytest.fail(f"CI=true and no Docker engine for the compose tests: {ENGINE_PROBLEM}")
    from testcontainers.compose import DockerCompose

    remove_leftovers()
    # The image as a user without an image registry builds it; cached layers make it quick.
    build = subprocess.run(
        ["bash", "compose/build-image.sh"], cwd=ROOT, capture_output=True, text=True, timeout=1800
    )
    assert build.returncode == 0, f"compose/build-image.sh:\n{build.stdout}{build.stderr[-6000:]}"
    project = f"{PROJECT_PREFIX}{os.getpid()}"
    http_port = free_port()
    env = {
        # Its own project and ports beside anything else on the engine, this host only, a small
        # KV pool, and one thread per worker: four of them share this machine's cores.
        "COMPOSE_PROJECT_NAME": project,
        "GATEWAY_BIND": "127.0.0.1",
        "GATEWAY_HTTP_PORT": str(http_port),
        "GATEWAY_RPC_PORT": str(free_port()),
        "TANDEM_KV_CACHE_BYTES": str(128 << 20),
        "TANDEM_THREADS": "1",
        "TANDEM_HEARTBEAT_TIMEOUT_S": str(HEARTBEAT_TIMEOUT_S),
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():  # `docker compose` runs with this process's environment
            patch.setenv(key, value)
        compose = DockerCompose(ROOT, compose_file_name="docker-compose.yml", wait=False)
        try:
            # Not `up --wait`: some compose versions fail it when the one-shot prepare exits.
            compose.start()
            cluster = ComposeCluster(compose, project, f"http://127.0.0.1:{http_port}")
            cluster.wait(num_prefill=1, num_decode=1)
            yield cluster
        finally:
            compose.stop()  # `down --volumes`: containers, network and the model cache


@pytest.fixture(scope="module")
def references(smollm2) -> dict[str, str]:
    """Greedy text of every prompt from the engine in this process, on the same model."""
    from shared.engine.engine import EngineConfig, LLMEngine
    from shared.engine.sampling_params import SamplingParams

    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([smollm2.tokenizer(p).input_ids for p in PROMPTS], params)
    return {
        p: smollm2.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        for p, o in zip(PROMPTS, outputs, strict=True)
    }


async def _stream(client: httpx.AsyncClient, prompt: str, chunks: list[float]) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    pieces = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200, await response.aread()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            pieces.append(event["choices"][0]["text"])
            chunks.append(time.monotonic())
    return "".join(pieces)


def stream_all(url: str, action: Callable[[], object] | None = None, after_chunks: int = 0) -> dict:
    """Streams every prompt at once; once `after_chunks` chunks have arrived, runs `action` (a
    kill, a partition) while they go on. Returns each prompt's text; bounded by LOAD_TIMEOUT_S."""

    async def run() -> dict[str, str]:
        chunks: list[float] = []
        async with httpx.AsyncClient(base_url=url, timeout=180, trust_env=False) as client:
            tasks = {p: asyncio.create_task(_stream(client, p, chunks)) for p in PROMPTS}
            if action is not None:
                while len(chunks) < after_chunks:
                    await asyncio.sleep(0.05)
                    assert not any(t.done() for t in tasks.values()), "finished before the action"
                await asyncio.to_thread(action)
            return {p: await t for p, t in tasks.items()}

    return asyncio.run(asyncio.wait_for(run(), LOAD_TIMEOUT_S))


def parse(text: str) -> dict[tuple[str, frozenset], float]:
    from prometheus_client.parser import text_string_to_metric_families

    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(metrics: dict, name: str, **labels: str) -> float:
    """Sum over peers (and any label not given) of one sample name."""
    wanted = set(labels.items())
    return sum(v for (n, lbls), v in metrics.items() if n == name and wanted <= lbls)


def served_by_peer(metrics: dict, name: str) -> dict[str, float]:
    peers = {dict(labels).get("peer") for (n, labels) in metrics if n == name}
    return {peer: total(metrics, name, peer=peer) for peer in peers if peer}


# -- the tests, in the order a user would go ------------------------------------------------------


def test_up_brings_every_service_to_health(compose_cluster):
    (prepare,) = [c for c in compose_cluster.compose.get_containers(include_all=True)
                  if c.Service == "prepare"]  # fmt: skip
    assert prepare.State == "exited" and prepare.ExitCode == 0
    info = compose_cluster.wait(num_prefill=1, num_decode=1)
    assert info["ready"] is True
    # Published on 127.0.0.1 only.
    (gateway,) = compose_cluster.containers("gateway")
    ports = json.loads(docker("inspect", "--format", "{{json .NetworkSettings.Ports}}", gateway.ID))
    bound = {binding["HostIp"] for bindings in ports.values() if bindings for binding in bindings}
    assert bound == {"127.0.0.1"}, ports
    # The scheduler compiled its C indexes in the container (else they say `python`).
    logs = compose_cluster.compose_run("logs", "scheduler")
    for index in ("queue_index", "decode_room", "prefill_room"):
        assert f'"{index}": "native"' in logs, index


def test_openai_client_completes_and_streams_the_engines_greedy_text(compose_cluster, references):
    from openai import OpenAI

    client = OpenAI(base_url=compose_cluster.url + "/v1", api_key="unused", timeout=300)
    prompt = PROMPTS[0]
    completion = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert completion.choices[0].text == references[prompt]
    assert completion.usage.completion_tokens == MAX_TOKENS
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0
    )
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=16, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed and streamed == whole.choices[0].message.content


def test_a_batch_job_runs_through_the_batch_service(compose_cluster, references):
    import io

    from openai import OpenAI

    client = OpenAI(base_url=compose_cluster.url + "/v1", api_key="unused", timeout=60)
    lines = [
        {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/completions",
         "body": {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "ignore_eos": True}}
        for i, prompt in enumerate(PROMPTS[:3])
    ]  # fmt: skip
    text = "".join(json.dumps(line) + "\n" for line in lines)
    upload = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    batch = client.batches.create(
        input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, (batch, compose_cluster.logs_tail())
        time.sleep(2)
        batch = client.batches.retrieve(batch.id)
    assert batch.status == "completed" and batch.request_counts.completed == 3, batch
    output = client.files.content(batch.output_file_id).text.splitlines()
    answers = {json.loads(x)["custom_id"]: json.loads(x)["response"]["body"] for x in output}
    assert sorted(answers) == ["line-0", "line-1", "line-2"]
    for i, prompt in enumerate(PROMPTS[:3]):
        assert answers[f"line-{i}"]["choices"][0]["text"] == references[prompt]


def test_scaled_to_two_prefill_and_two_decode_all_serve(compose_cluster, references):
    compose_cluster.compose_run(
        "up", "--detach", "--no-deps", "--no-recreate",
        "--scale", "prefill=2", "--scale", "decode=2", "prefill", "decode",
    )  # fmt: skip
    compose_cluster.wait(num_prefill=2, num_decode=2)
    before = compose_cluster.metrics()
    # The scheduler spreads concurrent requests over the least loaded workers; a few rounds
    # leave no doubt that each of the four took some.
    served: dict[str, set[str]] = {}
    for _ in range(3):
        assert stream_all(compose_cluster.url) == references
        after = compose_cluster.metrics()
        served = {
            role: {
                peer
                for peer, value in served_by_peer(after, name).items()
                if value > served_by_peer(before, name).get(peer, 0) and peer.startswith(role)
            }
            for role, name in (
                ("prefill", "tandem:prefill_tokens_total"),
                ("decode", "tandem:decode_generated_tokens_total"),
            )  # fmt: skip
        }
        if len(served["prefill"]) == 2 and len(served["decode"]) == 2:
            break
    assert {role: len(peers) for role, peers in served.items()} == {"prefill": 2, "decode": 2}, (
        served
    )


def test_a_killed_decode_container_loses_no_request_and_repeats_no_token(
    compose_cluster, references
):
    compose_cluster.wait(num_prefill=2, num_decode=2, idle=True)
    victim = compose_cluster.containers("decode")[0]
    texts = stream_all(
        compose_cluster.url, lambda: docker("kill", victim.ID), after_chunks=2 * len(PROMPTS)
    )
    assert texts == references  # every request completed, none with a repeated or missing token
    resumed = total(compose_cluster.metrics(), "tandem:requests_resumed_total")
    assert resumed >= 1  # the victim held some of them, which moved to the other decode worker
    # The survivor freed every block the moved requests held; the victim left rotation.
    compose_cluster.wait(num_prefill=2, num_decode=1, idle=True, timeout_s=4 * HEARTBEAT_TIMEOUT_S)
    docker("start", victim.ID)
    compose_cluster.wait(num_prefill=2, num_decode=2)


def test_a_partitioned_worker_leaves_rotation_and_rejoins(compose_cluster, references):
    compose_cluster.wait(num_prefill=2, num_decode=2, idle=True)
    network = f"{compose_cluster.project}_default"
    # A prefill worker: its peers reach it by the connections it opened. (A decode worker
    # advertises its address once, and a reconnected container may get another one.)
    victim = compose_cluster.containers("prefill")[0]
    disconnected_at: list[float] = []

    def disconnect() -> None:
        docker("network", "disconnect", network, victim.ID)
        disconnected_at.append(time.monotonic())

    try:
        texts = stream_all(compose_cluster.url, disconnect, after_chunks=1)
        assert texts == references  # the others served every request, the cut-off one's too
        info = compose_cluster.wait(num_prefill=1, num_decode=2, timeout_s=3 * HEARTBEAT_TIMEOUT_S)
        assert time.monotonic() - disconnected_at[0] < 3 * HEARTBEAT_TIMEOUT_S, info
        before = served_by_peer(compose_cluster.metrics(), "tandem:prefill_tokens_total")
    finally:  # a failure here must not leave the cluster short of a worker for the next tests
        if disconnected_at:
            docker("network", "connect", network, victim.ID)
    compose_cluster.wait(num_prefill=2, num_decode=2, timeout_s=6 * HEARTBEAT_TIMEOUT_S)
    rejoined: set[str] = set()
    for _ in range(3):
        assert stream_all(compose_cluster.url) == references
        after = served_by_peer(compose_cluster.metrics(), "tandem:prefill_tokens_total")
        rejoined = {p for p, v in after.items() if v > before.get(p, 0) and victim.ID[:12] in p}
        if rejoined:
            break
    assert rejoined, f"the reconnected prefill worker {victim.ID[:12]} served nothing: {after}"


def test_a_restarted_scheduler_recovers_without_help(compose_cluster, references):
    compose_cluster.wait(num_prefill=2, num_decode=2, idle=True)
    texts = stream_all(
        compose_cluster.url,
        lambda: compose_cluster.compose_run("restart", "scheduler", timeout_s=120),
        after_chunks=1,
    )
    assert texts == references
    compose_cluster.wait(num_prefill=2, num_decode=2, timeout_s=6 * HEARTBEAT_TIMEOUT_S)
    assert stream_all(compose_cluster.url) == references


def test_down_leaves_no_container(compose_cluster):
    compose_cluster.compose.stop()
    left = docker("ps", "--all", "--quiet", "--filter",
                  f"label=com.docker.compose.project={compose_cluster.project}")  # fmt: skip
    assert left.strip() == ""
    volumes = docker("volume", "ls", "--quiet", "--filter",
                     f"label=com.docker.compose.project={compose_cluster.project}")  # fmt: skip
    assert volumes.strip() == ""
