"""A request decoding across a scheduler restart, on real sockets: the gateway's real cluster
link, the first scheduler played by the test (`FakeScheduler`), the second the real service
(turned over by the test's loop), the decode worker a DEALER the test plays. When that worker
then says GOODBYE, the new scheduler, which adopted the request from its heartbeat
(`services/scheduler/adopted.py`), tells the gateway it is lost, and the gateway resumes it from
the token its client has, where it used to wait out the request's hour."""

from __future__ import annotations

import asyncio
import contextlib
import time

import zmq
import zmq.asyncio

from services.gateway.cluster import ClusterClient
from services.scheduler.service import SchedulerConfig, SchedulerService
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit

STATUS_TIMEOUT_S = 0.4  # the gateway says HELLO again after this much of the status' silence


async def turn(service: SchedulerService) -> None:
    """The real scheduler's loop, in the test's: messages handled, ticks (the status) sent."""
    next_tick = 0.0
    while True:
        service._drain()
        if time.monotonic() >= next_tick:
            service._tick_guarded(time.monotonic())
            next_tick = time.monotonic() + service.config.heartbeat_interval_s / 2
        await asyncio.sleep(0.005)


async def reply_to(socket: zmq.asyncio.Socket, kind: type, seconds: float = 5.0) -> wire.Message:
    async with asyncio.timeout(seconds):
        while True:
            message = await wire.async_recv(socket)
            if isinstance(message, kind):
                return message


def decode_hello(tmp_path) -> wire.Hello:
    return wire.Hello(schema_version=wire.SCHEMA_VERSION, role="decode", peer_id="d",
                      model="m", address=f"ipc://{tmp_path}/d", num_kv_blocks=64,
                      block_size=16, max_num_seqs=8)  # fmt: skip


def decode_heartbeat(held: list[str]) -> wire.Heartbeat:
    return wire.Heartbeat(peer_id="d", num_waiting=0, num_running=len(held),
                          num_free_blocks=60, num_total_blocks=64, steps_completed=1,
                          sent_at=0.0, request_ids=held)  # fmt: skip


async def decoding_across_a_restart(
    tmp_path, cancel_first: bool = False
) -> tuple[wire.Submit, list[int]] | wire.Cancel:
    """The worker's GOODBYE after the new scheduler adopted "r": the attempt the gateway then
    submits, and the tokens the client had. `cancel_first`: the client leaves before the
    worker's listing reached the new scheduler; the CANCEL the worker is then sent."""
    context = zmq.asyncio.Context()
    address = f"ipc://{tmp_path}/scheduler"
    first = FakeScheduler(context, address)
    client = ClusterClient(address, f"ipc://{tmp_path}/stream", f"ipc://{tmp_path}/stream",
                           "g", "m", GatewayEvents(get_logger()),
                           status_timeout_s=STATUS_TIMEOUT_S)  # fmt: skip
    await client.start()
    service = loop = None
    worker = context.socket(zmq.DEALER)
    worker.setsockopt(zmq.LINGER, 0)
    try:
        # The first scheduler's life: "r" admitted, and its first token streamed.
        await first.expect(wire.Hello)
        await first.send(wire.ClusterStatus(num_prefill=1, num_decode=1, num_queued=0,
                                            num_in_flight=1, scheduler_epoch="first"))  # fmt: skip
        caller = asyncio.create_task(client.submit(submit("r")))
        await first.expect(wire.Submit)
        await first.reply("r")
        queue = await caller
        await first.send(delta("r", [7]))
        assert (await asyncio.wait_for(queue.get(), 5)).token_ids == [7]
        first.socket.close(linger=0)  # it stops; the next one binds the same address
        config = SchedulerConfig(address=address, model="m", heartbeat_interval_s=0.2)
        service = SchedulerService(config, context=zmq.Context())
        submits: list[wire.Submit] = []
        real_submit = service._submit

        def record(identity: bytes, message: wire.Submit, now: float):
            submits.append(message)
            return real_submit(identity, message, now)

        service._submit = record  # type: ignore[method-assign]
        loop = asyncio.create_task(turn(service))
        async with asyncio.timeout(5):  # the gateway hears the new one's HELLO answer
            while "g" not in service.core.gateways:
                await asyncio.sleep(0.01)
        if cancel_first:
            await client.cancel("r", "client gone")
            async with asyncio.timeout(5):
                while not service.core.adopted.num_cancels_ahead():
                    await asyncio.sleep(0.01)
        # The decode worker, asked to register again, lists what it holds: "r".
        worker.connect(address)
        await wire.async_send(worker, decode_hello(tmp_path))
        assert (await reply_to(worker, wire.HelloAck)).accepted
        await wire.async_send(worker, decode_heartbeat(["r"]))
        if cancel_first:
            return await reply_to(worker, wire.Cancel)
        await asyncio.sleep(0.1)
        await wire.async_send(worker, wire.Goodbye(peer_id="d"))  # and stops
        async with asyncio.timeout(5):
            while not submits:
                await asyncio.sleep(0.01)
        return submits[0], client._requests["r"].token_ids
    finally:
        if loop is not None:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        await client.close()
        worker.close(linger=0)
        if service is not None:
            service.socket.close(linger=0)
            service.security.stop()
            service.context.destroy(linger=0)
        first.socket.close(linger=0)
        context.term()


def test_a_request_decoding_across_a_restart_is_resumed_when_its_worker_leaves(tmp_path):
    result = asyncio.run(decoding_across_a_restart(tmp_path))
    assert isinstance(result, tuple)
    resumed, tokens = result
    assert resumed.request_id == "r~1" and resumed.output_token_ids == [7]
    assert resumed.resumed_from is not None and tokens == [7]


def test_a_client_leaving_before_its_worker_is_heard_again_stops_the_worker(tmp_path):
    """The gateway's CANCEL reaches the new scheduler before the decode worker's heartbeat:
    the worker, listing the request, is told to let it go (it used to decode on for nobody
    to max_tokens)."""
    cancel = asyncio.run(decoding_across_a_restart(tmp_path, cancel_first=True))
    assert cancel == wire.Cancel(request_id="r", reason="client gone")
