"""A cluster on IPv6, real sockets on ::1: the real scheduler bound to `tcp://[::1]`, the
gateway's cluster link and a worker's scheduler link registering with it, a worker's token
stream to a gateway, the RPC door and its client, the gateway's batch link. libzmq read every
tcp:// host as IPv4 unless a socket had its IPv6 option: the binds failed ("No such device")
and the connects never connected, silently."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time

import pytest
import zmq
import zmq.asyncio

from services.gateway.batch_link import BatchLink
from services.gateway.cluster import ClusterClient
from services.gateway.openai_protocol import ApiError
from services.scheduler.service import SchedulerConfig, SchedulerService
from services.worker.link import SchedulerLink
from services.worker.streams import GatewayStreams
from shared import wire
from shared.binding import bind
from shared.curve import Security
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_ipv6_endpoints import has_ipv6_loopback

pytestmark = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback")

ANY_PORT = "tcp://[::1]:*"  # (libzmq picks a free one; `last_endpoint` says which)


def bound_address(sock: zmq.Socket) -> str:
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


def free_address() -> str:
    """A tcp://[::1] address with a port free now (for one that must be told before binding)."""
    with socket.socket(socket.AF_INET6) as probe:
        probe.bind(("::1", 0))
        return f"tcp://[::1]:{probe.getsockname()[1]}"


async def turn(service: SchedulerService) -> None:
    """The real scheduler's loop, in the test's: messages handled, ticks sent."""
    while True:
        service._drain()
        service._tick_guarded(time.monotonic())
        await asyncio.sleep(0.005)


def worker_hello() -> wire.Hello:
    return wire.Hello(schema_version=wire.SCHEMA_VERSION, role="prefill", peer_id="p", model="m",
                      address=None, num_kv_blocks=64, block_size=16,
                      max_num_seqs=8)  # fmt: skip


async def register_both() -> tuple[bool, bool]:
    """(the gateway registered, the worker's handshake answered) with a scheduler on ::1."""
    context = zmq.Context()  # (destroyed at the end, whatever failed: a leaked one hung pytest)
    client = link = loop = None
    try:
        service = SchedulerService(SchedulerConfig(address=ANY_PORT, model="m"), context)
        scheduler_address = bound_address(service.socket)
        loop = asyncio.create_task(turn(service))
        stream = free_address()
        client = ClusterClient(scheduler_address, stream, stream, "g", "m",
                               GatewayEvents(get_logger()))  # fmt: skip
        await client.start()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                while "g" not in service.core.gateways:
                    await asyncio.sleep(0.01)
        link = SchedulerLink(context, scheduler_address, worker_hello(),
                             Security(None, get_logger()))  # fmt: skip
        answered = await asyncio.to_thread(link.handshake, 3.0)
        return "g" in service.core.gateways, answered
    finally:
        if link is not None:
            link.close()
        if loop is not None:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        if client is not None:
            await client.close()
        context.destroy(linger=0)


def test_a_gateway_and_a_worker_register_with_a_scheduler_on_ipv6():
    gateway_registered, worker_answered = asyncio.run(asyncio.wait_for(register_both(), 30))
    assert gateway_registered and worker_answered


def test_a_worker_streams_tokens_to_a_gateway_on_ipv6():
    """The worker's sockets to its peers (gateways' streams; decode workers' KV, the same
    `PeerSockets`) connect to the address a peer advertised: here an IPv6 one."""
    context = zmq.Context()
    gateway = context.socket(zmq.PULL)
    streams = GatewayStreams(context, Security(None, get_logger()), idle_s=60.0)
    try:
        bind(gateway, ANY_PORT, "stream_address")
        delta = wire.TokenDelta(request_id="r", token_ids=[7], index=0)
        streams.send({bound_address(gateway): [delta]})
        assert gateway.poll(3000), "no tokens reached the gateway"
        assert wire.recv(gateway).deltas[0].token_ids == [7]
    finally:
        streams.close()
        gateway.close(linger=0)
        context.term()


def test_an_rpc_client_calls_the_rpc_door_on_ipv6():
    """`--rpc-address tcp://[::1]:8001` (or `tandem up --host ::1 --rpc-port 8001`)."""
    from services.gateway.rpc import RpcServer
    from services.gateway.rpc_client import AsyncTandemClient, RpcError

    async def call() -> RpcError:
        door = RpcServer(generator=object(), address=ANY_PORT)  # type: ignore[arg-type]
        await door.start()
        try:
            async with AsyncTandemClient(bound_address(door.socket), timeout_s=3) as client:
                with pytest.raises(RpcError) as refused:  # (answered by the door's wire check)
                    await client.call("embeddings", {"model": "m", "input": "hi"})  # type: ignore[arg-type]
                return refused.value
        finally:
            await door.close()

    refused = asyncio.run(asyncio.wait_for(call(), 30))
    assert refused.status == 400 and "RpcRequest.kind" in refused.message


def test_the_gateways_batch_link_reaches_a_batch_service_on_ipv6():
    async def call() -> bool:
        context = zmq.asyncio.Context()
        service = context.socket(zmq.ROUTER)
        link = None
        try:
            bind(service, ANY_PORT, "address")
            link = BatchLink(bound_address(service), timeout_s=0.5)
            await link.start()
            await asyncio.sleep(0.2)  # (connected: the link sends to connected services only)
            with contextlib.suppress(ApiError):  # (nobody answers: a 503 in its time)
                await link.call("batch_list", "t", {})
            return bool(await service.poll(1000))
        finally:
            if link is not None:
                await link.close()
            context.destroy(linger=0)

    assert asyncio.run(asyncio.wait_for(call(), 30)), "the call never reached the service"
