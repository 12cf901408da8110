"""The docker-compose cluster end to end, through testcontainers' DockerCompose.

Builds the image, brings up the prepare step, scheduler, gateway, one prefill and one decode
worker, completes through the `openai` package, then scales decode to two replicas and checks
that both serve. It needs a Docker engine with the compose plugin and is skipped, with the reason,
where none is reachable (the development machines have the docker CLI but no engine). The first
build downloads torch's CPU wheel and takes minutes; later ones reuse the layer cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest

from loadtest.served import free_port

if TYPE_CHECKING:
    from testcontainers.compose import DockerCompose

ROOT = Path(__file__).resolve().parents[2]
MODEL = "smollm2"
LONG_RUNNING = ("scheduler", "gateway", "prefill", "decode")


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
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        ENGINE_PROBLEM is not None, reason=f"needs a Docker engine: {ENGINE_PROBLEM}"
    ),
]


@dataclass
class ComposeCluster:
    compose: DockerCompose
    url: str

    def ready_info(self) -> dict:
        return httpx.get(self.url + "/ready", timeout=5).json()

    def decode_steps(self) -> dict[str, int]:
        workers = self.ready_info()["workers"]
        return {w["peer_id"]: w["steps_completed"] for w in workers if w["role"] == "decode"}

    def compose_run(self, *args: str) -> None:
        """A `docker compose` command on this project (DockerCompose has no scaling call)."""
        command = [*self.compose.compose_command_property, *args]
        done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout}{done.stderr}"

    def logs_tail(self, num_chars: int = 6000) -> str:
        stdout, stderr = self.compose.get_logs()
        return (stdout + stderr)[-num_chars:]

    def wait(self, num_decode: int, timeout_s: float = 600.0) -> dict:
        """Until /ready counts the workers and every long-running container is healthy."""
        deadline = time.monotonic() + timeout_s
        last: object = None
        while time.monotonic() < deadline:
            try:
                response = httpx.get(self.url + "/ready", timeout=5)
                body = response.json()
                last = body
                joined = body["prefill_workers"] >= 1 and body["decode_workers"] == num_decode
                if response.status_code == 200 and joined and self._all_healthy():
                    return body
            except (httpx.HTTPError, ValueError, KeyError) as error:
                last = error
            time.sleep(2)
        raise TimeoutError(f"cluster not ready ({last!r}):\n{self.logs_tail()}")

    def _all_healthy(self) -> bool:
        containers = [c for c in self.compose.get_containers() if c.Service in LONG_RUNNING]
        return bool(containers) and all(c.Health == "healthy" for c in containers)


@pytest.fixture(scope="module")
def compose_cluster():
    from testcontainers.compose import DockerCompose

    http_port = free_port()
    env = {
        # Its own project, ports and a small KV pool, beside anything else on the engine.
        "COMPOSE_PROJECT_NAME": f"tandem-test-{os.getpid()}",
        "GATEWAY_HTTP_PORT": str(http_port),
        "GATEWAY_RPC_PORT": str(free_port()),
        "TANDEM_KV_CACHE_BYTES": str(128 << 20),
    }
    with pytest.MonkeyPatch.context() as patch:
        for key, value in env.items():  # `docker compose` runs with this process's environment
            patch.setenv(key, value)
        compose = DockerCompose(
            ROOT, compose_file_name="docker-compose.yml", build=True, wait=False
        )
        try:
            # Not `up --wait`: some compose versions fail it when the one-shot prepare exits.
            compose.start()
            cluster = ComposeCluster(compose, f"http://127.0.0.1:{http_port}")
            cluster.wait(num_decode=1)
            yield cluster
        finally:
            compose.stop()  # `down --volumes`: containers, network and the model cache


def test_prepare_exited_successfully(compose_cluster):
    prepare = compose_cluster.compose.get_container("prepare", include_all=True)
    assert prepare.State == "exited" and prepare.ExitCode == 0


def test_completions_through_openai(compose_cluster):
    from openai import OpenAI

    client = OpenAI(base_url=compose_cluster.url + "/v1", api_key="unused", timeout=300)
    completion = client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    assert completion.choices[0].text
    assert 1 <= completion.usage.completion_tokens <= 8
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=8,
        stream=True,
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text


def test_scaled_decode_workers_both_serve(compose_cluster):
    from openai import OpenAI

    compose_cluster.compose_run(
        "up", "--detach", "--no-deps", "--no-recreate", "--scale", "decode=2", "decode"
    )
    compose_cluster.wait(num_decode=2)
    before = compose_cluster.decode_steps()
    assert len(before) == 2, before

    client = OpenAI(base_url=compose_cluster.url + "/v1", api_key="unused", timeout=300)

    def complete(index: int) -> int:
        completion = client.completions.create(
            model=MODEL, prompt=f"Count to ten, attempt {index}:", max_tokens=16, temperature=0
        )
        return completion.usage.completion_tokens

    # The scheduler reserves on the decode worker with the most free blocks, so concurrent
    # requests alternate between the two; a few rounds leave no doubt.
    served: set[str] = set()
    for _ in range(3):
        with ThreadPoolExecutor(max_workers=8) as pool:
            assert all(tokens >= 1 for tokens in pool.map(complete, range(8)))
        deadline = time.monotonic() + 10  # steps arrive with the workers' heartbeats
        while time.monotonic() < deadline and len(served) < 2:
            after = compose_cluster.decode_steps()
            served = {peer for peer, steps in after.items() if steps > before.get(peer, 0)}
            time.sleep(0.5)
        if len(served) == 2:
            break
    assert len(served) == 2, f"decode workers that served: {served} of {sorted(before)}"
