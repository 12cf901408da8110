"""The gateway's shutdown on SIGTERM, with a real gateway process and a scheduler played by the
test (`test_gateway_resume.FakeScheduler`) whose request never ends: the gateway stops taking
connections at once, gives the stream its grace (`shutdown_grace_s`), then ends it as OpenAI's
clients read an end (an error event, `data: [DONE]`, the chunked body closed), cancels its
cluster request, and exits. Without a bound, uvicorn waited for the stream forever: the
orchestrator's SIGKILL tore it (docker's 10 s, Kubernetes' 30 s, `tandem up`'s 10 s).

No request reaches the draining gateway, not even a probe over a connection kept alive from
before: uvicorn closes idle ones at SIGTERM (busy ones after their answer, a pipelined request
dropped). So /ready cannot announce the drain; Kubernetes' preStop sleep (compose/k8s/gateway.yaml)
takes the pod out of the Service's endpoints before the SIGTERM instead."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
import zmq.asyncio

from services.gateway.drain import Drain, until_drained
from services.gateway.openai_protocol import ApiError
from services.gateway.service import GatewayConfig
from shared import wire
from shared.config import ConfigError
from shared.engine.model_files import resolve_model_dir
from tests.helpers import TINY_LLAMA, free_port
from tests.integration.test_gateway_resume import FakeScheduler, delta

GRACE_S = 1.0
EXIT_MARGIN_S = 5.0  # ending the streams, closing the cluster link, the interpreter's exit
ROOT = Path(__file__).resolve().parents[2]


def tokenizer_dir(tmp_path) -> Path:
    """The real tokenizer and a tiny model's config: all a gateway loads (the default model's
    GGUF took it a minute to start on a busy machine)."""
    from transformers import AutoConfig

    directory = tmp_path / "model"
    AutoConfig.for_model("llama", **TINY_LLAMA).save_pretrained(directory)
    real_dir, _ = resolve_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_dir / name, directory / name)
    return directory


def start_gateway(tmp_path, port: str) -> subprocess.Popen:
    env = {**os.environ, "TANDEM_SHUTDOWN_GRACE_S": str(GRACE_S)}
    return subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "gateway", "--port", port,
         "--model", str(tokenizer_dir(tmp_path)),
         "--scheduler-address", f"ipc://{tmp_path}/scheduler",
         "--stream-address", f"ipc://{tmp_path}/stream"],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip


async def accepting(port: str) -> None:
    """Until the gateway's HTTP port takes connections (its lifespan runs before the bind)."""
    async with asyncio.timeout(60):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", int(port))
            except ConnectionRefusedError:
                await asyncio.sleep(0.1)
                continue
            writer.close()
            return


async def refuses_connections(port: str) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", int(port))
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def status_on(connection: Connection, path: str) -> int | None:
    """The status of GET `path` over an open keep-alive connection, its body read; None if the
    server closed the connection instead."""
    reader, writer = connection
    writer.write(f"GET {path} HTTP/1.1\r\nHost: gateway\r\n\r\n".encode())
    try:
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
    except (ConnectionError, asyncio.IncompleteReadError):
        return None
    status_line, *header_lines = head.decode().split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in header_lines if line)
    await reader.readexactly(int(headers["content-length"]))
    return int(status_line.split()[1])


async def play_endless_requests(scheduler: FakeScheduler, num_requests: int) -> set[str]:
    """Accepts the gateway's requests and sends each one token, then nothing more (400 tokens
    to come from a slow worker): their ids."""
    request_ids = set()
    for _ in range(num_requests):
        submit = await scheduler.expect(wire.Submit)
        await scheduler.reply(submit.request_id)
        await scheduler.send(delta(submit.request_id, [100]))
        request_ids.add(submit.request_id)
    return request_ids


async def stopped_mid_stream(tmp_path) -> dict:
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    port = free_port()
    gateway = start_gateway(tmp_path, port)
    seen: dict = {}
    try:
        async with asyncio.timeout(60):
            await scheduler.expect(wire.Hello)
        await accepting(port)
        kept_alive = await asyncio.open_connection("127.0.0.1", int(port))
        seen["ready before the drain"] = await status_on(kept_alive, "/ready")
        played = asyncio.create_task(play_endless_requests(scheduler, 2))
        body = {"model": "model", "prompt": "Hello", "max_tokens": 400, "stream": True}
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with (
            httpx.AsyncClient(timeout=30) as client,
            client.stream("POST", url, json=body) as response,
        ):
            # A whole answer waited for, beside the stream: a 503 at the grace's end.
            whole = asyncio.create_task(client.post(url, json={**body, "stream": False}))
            lines = response.aiter_lines()
            assert (await anext(lines)).startswith("data: {")
            request_ids = await played
            gateway.send_signal(signal.SIGTERM)
            signalled_at = time.monotonic()
            await asyncio.sleep(0.3)
            seen["refused during the drain"] = await refuses_connections(port)
            seen["ready during the drain"] = await status_on(kept_alive, "/ready")
            try:  # torn (no last chunk): httpx.RemoteProtocolError
                async with asyncio.timeout(GRACE_S + EXIT_MARGIN_S):
                    seen["rest"] = [line async for line in lines if line]
            except TimeoutError:
                seen["rest"] = ["still streaming"]
            seen["stream ended after s"] = time.monotonic() - signalled_at
            seen["whole answer"] = (await whole).status_code
        async with asyncio.timeout(5):
            cancels = [await scheduler.expect(wire.Cancel) for _ in request_ids]
        seen["cancelled"] = {cancel.request_id for cancel in cancels} == request_ids
        deadline = signalled_at + GRACE_S + EXIT_MARGIN_S
        try:
            await asyncio.to_thread(gateway.wait, max(0.1, deadline - time.monotonic()))
            seen["exited after s"] = time.monotonic() - signalled_at
        except subprocess.TimeoutExpired:
            seen["exited after s"] = None
        return seen
    finally:
        if gateway.poll() is None:
            gateway.kill()
        gateway.wait()
        scheduler.socket.close(linger=0)
        context.term()


def test_sigterm_ends_an_endless_stream_cleanly_after_the_grace_and_exits(tmp_path):
    seen = asyncio.run(stopped_mid_stream(tmp_path))
    assert seen["refused during the drain"]
    assert seen["ready before the drain"] in (200, 503)  # (503: the fake cluster has no workers)
    assert seen["ready during the drain"] is None  # its kept-alive connection closed
    *events, last = seen["rest"]
    assert last == "data: [DONE]"
    error = json.loads(events[-1].removeprefix("data: "))["error"]
    assert error["code"] == 503 or "shutting down" in error["message"]
    assert GRACE_S - 0.2 <= seen["stream ended after s"] <= GRACE_S + 1.0  # it had its grace
    assert seen["whole answer"] == 503
    assert seen["cancelled"]  # the workers stop generating for nobody
    assert seen["exited after s"] is not None


@pytest.mark.parametrize("grace", [-1.0, 0.0, float("inf"), float("nan")])
def test_a_grace_that_is_not_positive_and_finite_is_refused(grace):
    with pytest.raises(ConfigError, match="shutdown_grace_s"):
        GatewayConfig(shutdown_grace_s=grace)


async def endless() -> AsyncIterator[int]:
    yield 1
    await asyncio.Event().wait()
    yield 2  # (never)


async def drained_in_process() -> dict:
    drain = Drain()
    seen: dict = {}
    events = until_drained(endless(), drain)
    seen["first"] = await anext(events)
    drain.begin(0.05)
    try:
        await anext(events)
    except ApiError as error:
        seen["status"] = error.status
    try:  # after the deadline a wait is refused at once, its work never run
        await drain.within(asyncio.sleep(10))
    except ApiError as error:
        seen["late"] = error.status
    return seen


def test_the_drain_ends_a_wait_under_way_and_refuses_a_late_one():
    assert asyncio.run(drained_in_process()) == {"first": 1, "status": 503, "late": 503}


async def cancelled_by_someone_else() -> bool:
    drain = Drain()
    drain.begin(60.0)
    waiting = asyncio.create_task(drain.within(asyncio.sleep(10)))
    await asyncio.sleep(0.01)
    waiting.cancel()  # a client gone, or uvicorn's own bound: not the drain's 503
    try:
        await waiting
    except asyncio.CancelledError:
        return True
    return False


def test_a_cancel_not_the_drains_stays_a_cancel():
    assert asyncio.run(cancelled_by_someone_else())
