"""A cluster spread over four "hosts": Linux network namespaces on a private bridge, all over
tcp://. The scheduler and gateway live on one host, a prefill worker on a second, a decode
worker on each of two more. Requests complete across hosts, token for token. Then a decode
host's link is cut while streams are in flight: the scheduler takes that worker out of rotation
within its heartbeat timeout, and the streams it held are re-routed (resumed on the other decode
host from the tokens their clients have: none fails, none hangs). With the link back, the worker
rejoins and serves again.

It needs root and iproute2 (CI runs as root); elsewhere it skips, saying why.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
SUBNET = "10.77.{}"
HEARTBEAT_TIMEOUT_S = 3.0
PROMPTS = ["Across the network,", "The lighthouse keeper", "def merge(a, b):", "In 1850,"]


def _ip(*argv: str) -> None:
    subprocess.run(["ip", *argv], check=True, capture_output=True, text=True)


def namespaces_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    probe = f"tdm-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as error:
        return f"`ip netns add` failed: {error.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


@dataclass
class Hosts:
    """Namespaces `<tag>-hN` with 10.77.<n>.N/24 on a bridge in namespace `<tag>-sw`, plus a
    veth from this (the test's) namespace at .254, so the test reaches the gateway."""

    tag: str
    net: str
    names: list[str] = field(default_factory=list)

    def ns(self, host: int) -> str:
        return f"{self.tag}-h{host}"

    def address(self, host: int) -> str:
        return f"{self.net}.{host}"

    def link(self, host: int) -> str:
        return f"{self.tag}v{host}"

    def create(self, num_hosts: int) -> None:
        switch = f"{self.tag}-sw"
        _ip("netns", "add", switch)
        self.names.append(switch)
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for host in range(1, num_hosts + 1):
            _ip("netns", "add", self.ns(host))
            self.names.append(self.ns(host))
            self._wire(self.link(host), self.ns(host), self.address(host))
        self._wire(f"{self.tag}vt", None, f"{self.net}.254")

    def _wire(self, name: str, ns: str | None, address: str) -> None:
        switch, port = f"{self.tag}-sw", f"{name}p"
        target = ["netns", ns] if ns is not None else []
        _ip("link", "add", name, *target, "type", "veth", "peer", "name", port, "netns", switch)
        inside = ["-n", ns] if ns is not None else []
        _ip(*inside, "addr", "add", f"{address}/24", "dev", name)
        _ip(*inside, "link", "set", name, "up")
        if ns is not None:
            _ip(*inside, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "set", port, "master", "br0")
        _ip("-n", switch, "link", "set", port, "up")

    def set_link(self, host: int, up: bool) -> None:
        _ip("-n", self.ns(host), "link", "set", self.link(host), "up" if up else "down")

    def destroy(self) -> None:
        subprocess.run(["ip", "link", "del", f"{self.tag}vt"], capture_output=True)
        for name in reversed(self.names):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass
class Spread:
    hosts: Hosts
    url: str
    processes: dict[str, subprocess.Popen]
    logs: Path

    def ready(self) -> dict:
        return httpx.get(self.url + "/ready", timeout=5, trust_env=False).json()

    def wait_for(self, num_decode: int, timeout_s: float) -> float:
        """Seconds until /ready shows `num_decode` decode workers (and one prefill worker)."""
        start = time.monotonic()
        while time.monotonic() - start < timeout_s:
            dead = [name for name, p in self.processes.items() if p.poll() is not None]
            assert not dead, f"{dead} exited:\n{self.log_tail()}"
            try:
                info = self.ready()
                if info["decode_workers"] == num_decode and info["prefill_workers"] == 1:
                    return time.monotonic() - start
            except (httpx.HTTPError, ValueError, KeyError):
                pass
            time.sleep(0.2)
        pytest.fail(f"not {num_decode} decode workers within {timeout_s} s:\n{self.log_tail()}")

    def log_tail(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-1500:]}" for p in self.logs.iterdir())


def start(hosts: Hosts, host: int, name: str, argv: list[str], logs: Path) -> subprocess.Popen:
    log = (logs / f"{name}.log").open("wb")
    return subprocess.Popen(
        [
            "ip",
            "netns",
            "exec",
            hosts.ns(host),
            sys.executable,
            "-m",
            "services.commands.cli",
            *argv,
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, TANDEM_LOG_FORMAT="json"),
    )


@pytest.fixture(scope="module")
def spread(tmp_path_factory) -> Iterator[Spread]:
    reason = namespaces_unavailable()
    if reason is not None:
        pytest.skip(f"multi-host test: {reason}")
    tag = f"tdm{os.getpid() % 10000}"
    hosts = Hosts(tag, SUBNET.format(os.getpid() % 200 + 20))
    logs = tmp_path_factory.mktemp("multi-host")
    processes: dict[str, subprocess.Popen] = {}
    try:
        hosts.create(num_hosts=4)
        processes.update(start_services(hosts, logs))
        cluster = Spread(hosts, f"http://{hosts.address(1)}:8000", processes, logs)
        cluster.wait_for(num_decode=2, timeout_s=300)
        yield cluster
    finally:
        for process in processes.values():
            process.send_signal(signal.SIGTERM)
        for process in processes.values():
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
        hosts.destroy()


def start_services(hosts: Hosts, logs: Path) -> dict[str, subprocess.Popen]:
    one = hosts.address(1)
    scheduler = f"tcp://{one}:5555"
    worker = ["--scheduler-address", scheduler, "--kv-cache-bytes", str(64 << 20),
              "--threads", "1", "--metrics-port", "0"]  # fmt: skip
    return {
        "scheduler": start(hosts, 1, "scheduler", [
            "scheduler", "--address", scheduler, "--heartbeat-timeout-s", str(HEARTBEAT_TIMEOUT_S),
            "--metrics-port", "0", "--metrics-host", one,
        ], logs),
        "gateway": start(hosts, 1, "gateway", [
            "gateway", "--host", one, "--port", "8000", "--scheduler-address", scheduler,
            "--stream-address", f"tcp://{one}:5600",
        ], logs),
        "prefill": start(hosts, 2, "prefill", [
            "prefill", "--peer-id", "prefill-h2", "--metrics-host", hosts.address(2), *worker,
        ], logs),
        **{
            f"decode-h{h}": start(hosts, h, f"decode-h{h}", [
                "decode", "--peer-id", f"decode-h{h}", "--address",
                f"tcp://{hosts.address(h)}:5601", "--metrics-host", hosts.address(h), *worker,
            ], logs)
            for h in (3, 4)
        },
    }  # fmt: skip


@pytest.fixture(scope="module")
def expected(smollm2) -> dict[str, str]:
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    outputs = engine.generate([smollm2.tokenizer(p).input_ids for p in PROMPTS], params)
    return {
        p: smollm2.tokenizer.decode(o.token_ids, skip_special_tokens=True)
        for p, o in zip(PROMPTS, outputs, strict=True)
    }


async def stream(client: httpx.AsyncClient, prompt: str, chunks: list[float]) -> str:
    body = {"model": "smollm2", "prompt": prompt, "max_tokens": 48, "temperature": 0,
            "ignore_eos": True, "stream": True}  # fmt: skip
    text = []
    async with client.stream("POST", "/v1/completions", json=body) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                text.append(event["choices"][0]["text"])
                chunks.append(time.monotonic())
    return "".join(text)


async def all_streams(url: str, cut=None) -> dict[str, str]:
    """Every prompt streamed at once; `cut()` runs once they are all under way."""
    chunks: list[float] = []
    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False) as client:
        tasks = {p: asyncio.create_task(stream(client, p, chunks)) for p in PROMPTS}
        if cut is not None:
            while len(chunks) < 3 * len(PROMPTS):
                await asyncio.sleep(0.05)
            cut()
        return {p: await asyncio.wait_for(t, 180) for p, t in tasks.items()}


def decode_steps(cluster: Spread) -> dict[str, int]:
    return {
        w["peer_id"]: w["steps_completed"]
        for w in cluster.ready()["workers"]
        if w["role"] == "decode"
    }


def test_requests_complete_across_hosts(spread, expected):
    before = decode_steps(spread)
    assert asyncio.run(all_streams(spread.url)) == expected
    after = decode_steps(spread)
    assert all(after[peer] > before[peer] for peer in before), (before, after)
    metrics = httpx.get(spread.url + "/metrics", timeout=10, trust_env=False).text
    assert 'peer="decode-h3"' in metrics and 'peer="prefill-h2"' in metrics  # scraped across


def busiest_decode_host(cluster: Spread, timeout_s: float = 5.0) -> int:
    """The host of the decode worker running the most sequences (`decode-hN` -> N), once a
    heartbeat has reported some (the view is up to a heartbeat old)."""
    deadline = time.monotonic() + timeout_s
    while True:
        workers = [w for w in cluster.ready()["workers"] if w["role"] == "decode"]
        busiest = max(workers, key=lambda w: w["running"])
        if busiest["running"] > 0:
            return int(busiest["peer_id"].removeprefix("decode-h"))
        assert time.monotonic() < deadline, f"no decode worker reported a sequence: {workers}"
        time.sleep(0.1)


def test_a_cut_link_reroutes_its_streams_and_the_worker_rejoins(spread, expected):
    cut_host: list[int] = []
    cut_at: list[float] = []

    def cut() -> None:
        cut_host.append(busiest_decode_host(spread))
        spread.hosts.set_link(cut_host[0], up=False)
        cut_at.append(time.monotonic())

    try:
        texts = asyncio.run(all_streams(spread.url, cut))
        # Out of rotation within the heartbeat timeout (plus a status tick or two).
        assert spread.wait_for(num_decode=1, timeout_s=HEARTBEAT_TIMEOUT_S + 2) >= 0
        assert texts == expected  # re-routed, not failed: resumed on the other host, exact
        assert time.monotonic() - cut_at[0] < 120  # and none hung
    finally:
        if cut_host:
            spread.hosts.set_link(cut_host[0], up=True)
    victim = f"decode-h{cut_host[0]}"
    log = (spread.logs / "gateway.log").read_text()
    assert "request resumed" in log and f"{victim} stopped responding" in log
    rejoin_s = spread.wait_for(num_decode=2, timeout_s=60)
    deadline = time.monotonic() + 60
    before = decode_steps(spread)[victim]
    while decode_steps(spread)[victim] == before:  # it serves again
        assert time.monotonic() < deadline, f"{victim} rejoined but got no work"
        asyncio.run(all_streams(spread.url))
    joins = (spread.logs / "scheduler.log").read_text().count(f'"peer_id": "{victim}", "role"')
    assert joins == 2, f"{victim} registered {joins} times: once at start, once after the cut"
    print(f"{victim} rejoined {rejoin_s:.1f} s after its link came back")
