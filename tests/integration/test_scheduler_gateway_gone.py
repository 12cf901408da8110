"""The scheduler service calls off a dead gateway's requests: a gateway unreachable for a
heartbeat timeout (its process died: the ROUTER, ROUTER_MANDATORY, has no connection to it) is
gone, and the workers are told to let its requests go. Until 2026-12-07 they were prefilled and
decoded to `max_tokens` for nobody. A gateway that stays connected is kept however long it
sends nothing (it need not: the status goes to it); one back under its peer id (it was cut
off, not dead) is told its requests were lost, and resumes them."""

from __future__ import annotations

import asyncio
import contextlib

import zmq
import zmq.asyncio

from services.scheduler.service import SchedulerConfig, SchedulerService
from shared import wire
from tests.integration.test_scheduler_restart_adoption import reply_to, turn
from tests.unit.test_scheduler_core import heartbeat, hello, submit

HEARTBEAT_TIMEOUT_S = 0.6


async def a_gateway_dies_while_its_request_reserves(tmp_path) -> tuple[wire.Cancel, dict]:
    """Gateways "g" and "h" say HELLO, "g" submits "r", which reserves on decode worker "d";
    then "g"'s process dies (its socket closes). What "d" is told, and the core's state then."""
    address = f"ipc://{tmp_path}/scheduler"
    config = SchedulerConfig(address=address, model="m", heartbeat_interval_s=0.1,
                             heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)  # fmt: skip
    service = SchedulerService(config, context=zmq.Context())
    context = zmq.asyncio.Context()
    peers = {name: context.socket(zmq.DEALER) for name in ("g", "h", "p", "d")}
    loop = asyncio.create_task(turn(service))
    beating = None
    try:
        for name, role in (("g", "gateway"), ("h", "gateway"), ("p", "prefill"), ("d", "decode")):
            peers[name].setsockopt(zmq.LINGER, 0)
            peers[name].connect(address)
            await wire.async_send(
                peers[name], hello(name, role, address=f"ipc://{tmp_path}/{name}")
            )
            assert (await reply_to(peers[name], wire.HelloAck)).accepted

        async def beat() -> None:
            while True:
                for name in ("p", "d"):
                    await wire.async_send(peers[name], heartbeat(name))
                await asyncio.sleep(0.1)

        beating = asyncio.create_task(beat())
        await wire.async_send(peers["g"], submit("r"))
        assert (await reply_to(peers["g"], wire.SubmitReply)).accepted
        assert (await reply_to(peers["d"], wire.Reserve)).request_id == "r"
        peers["g"].close(linger=0)  # the gateway's process dies
        cancel = await reply_to(peers["d"], wire.Cancel, seconds=10 * HEARTBEAT_TIMEOUT_S)
        await asyncio.sleep(2 * HEARTBEAT_TIMEOUT_S)  # ("h", silent but connected, stays)
        state = {"gateways": sorted(service.core.gateways), "requests": list(service.core.requests)}
        # Not dead after all (a cut): back under its peer id, it hears that "r" was lost.
        peers["g"] = context.socket(zmq.DEALER)
        peers["g"].setsockopt(zmq.LINGER, 0)
        peers["g"].connect(address)
        await wire.async_send(peers["g"], hello("g", "gateway", address=f"ipc://{tmp_path}/g"))
        told = await reply_to(peers["g"], wire.Tokens)
        state["told"] = [(d.request_id, d.finish_reason) for d in told.deltas]
        return cancel, state
    finally:
        for task in (loop, beating):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for sock in peers.values():
            sock.close(linger=0)
        service.socket.close(linger=0)
        service.security.stop()
        service.context.destroy(linger=0)
        context.term()


def test_a_dead_gateways_requests_are_called_off_on_their_workers(tmp_path):
    cancel, state = asyncio.run(a_gateway_dies_while_its_request_reserves(tmp_path))
    assert cancel == wire.Cancel(request_id="r", reason="its gateway is gone")
    assert state == {"gateways": ["h"], "requests": [], "told": [("r", "lost")]}
