"""A scheduler just started (restarted under a running cluster) holds the SUBMITs that come
before its workers say HELLO again, and admits them once they have, where it refused each with
a 503 ("no prefill or no decode worker") while the workers were half a second from rejoining.
The real process, on real sockets: the gateway and the two workers are DEALERs the test plays."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from shared import wire
from tests.helpers import scheduler_process, wait_for_line
from tests.integration.test_scheduler_restart_adoption import reply_to
from tests.unit.test_scheduler_core import hello, submit

INTERVAL_S = 0.5  # the rejoin grace is three of these


async def submit_before_the_workers(address: str) -> tuple[bool, wire.SubmitReply]:
    """Whether an answer came before the workers' HELLOs, and the answer after them."""
    context = zmq.asyncio.Context()
    sockets = {name: context.socket(zmq.DEALER) for name in ("g", "p", "d")}
    try:
        for socket in sockets.values():
            socket.setsockopt(zmq.LINGER, 0)
            socket.connect(address)
        gateway = sockets["g"]
        await wire.async_send(gateway, hello("g", "gateway", address=f"{address}-g"))
        assert (await reply_to(gateway, wire.HelloAck, seconds=30)).accepted
        await wire.async_send(gateway, submit("a"))
        try:
            early = await reply_to(gateway, wire.SubmitReply, seconds=0.3)
        except TimeoutError:
            early = None
        for name, role in (("p", "prefill"), ("d", "decode")):
            await wire.async_send(sockets[name], hello(name, role, address=f"{address}-{name}"))
            assert (await reply_to(sockets[name], wire.HelloAck, seconds=30)).accepted
        reply = early or await reply_to(gateway, wire.SubmitReply, seconds=30)
        return early is not None, reply  # type: ignore[return-value]
    finally:
        for socket in sockets.values():
            socket.close(linger=0)
        context.term()


def test_a_scheduler_just_started_admits_what_came_before_its_workers(tmp_path):
    address = f"ipc://{tmp_path}/scheduler"
    process = scheduler_process(address, "--heartbeat-interval-s", str(INTERVAL_S))
    try:
        wait_for_line(process, b"scheduler listening", "the scheduler")
        answered_early, reply = asyncio.run(submit_before_the_workers(address))
    finally:
        process.terminate()
        output = process.communicate(timeout=30)[0].decode()
    assert not answered_early and reply.accepted, (reply, output[-3000:])
    assert '"request awaits workers"' in output and '"request queued"' in output
