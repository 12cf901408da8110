"""A brief TCP reconnect between the scheduler and a gateway or a worker, neither restarted: the
real scheduler service (turned by the test's loop), the gateway's real cluster link and a
worker's real scheduler link, each connected through a TCP forwarder the test cuts (every
connection reset, new ones refused) and opens again. What the scheduler sends meanwhile, and
after, must reach the peer at once: it used to go to the peer's old ROUTER identity, dropped,
until the gateway said HELLO again (after seconds of the status' silence; the "lost" word of a
request, dropped, left it waiting out its hour) or the worker its next heartbeat. And a word
the dying connection swallowed (sent before the cut was seen) must not leave a decoding request
waiting out its hour either."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest
import zmq
import zmq.asyncio

from services.gateway.cluster import ClusterClient
from services.scheduler.service import SchedulerConfig, SchedulerService, Undelivered
from services.worker.link import SchedulerLink
from shared import wire
from shared.curve import CurveKeys, Security
from shared.endpoints import routing_id
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.helpers import free_port
from tests.integration.test_gateway_resume import delta, submit
from tests.integration.test_scheduler_restart_adoption import reply_to, turn

GAP_S = 0.4  # how long the forwarder refuses connections after a cut
PROMPTLY_S = 1.5  # a message sent to a peer across the gap reaches it within this, once back


class Forwarder:
    """Forwards TCP connections on 127.0.0.1 to a port. `cut` resets every connection it holds
    and refuses new ones until `reopen`: a network blip, neither end restarted."""

    def __init__(self, target_port: int):
        self.target_port = target_port
        self.open = True
        self.swallowing = False  # what the scheduler sends is read and dropped (until a cut)
        self._writers: set[asyncio.StreamWriter] = set()
        self._pumps: set[asyncio.Task] = set()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._forward, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self.open:
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self._writers |= {writer, up_writer}
        for source, sink, toward_peer in ((reader, up_writer, False), (up_reader, writer, True)):
            pump = asyncio.create_task(self._pump(source, sink, toward_peer))
            self._pumps.add(pump)
            pump.add_done_callback(self._pumps.discard)

    async def _pump(
        self, source: asyncio.StreamReader, sink: asyncio.StreamWriter, toward_peer: bool
    ) -> None:
        with contextlib.suppress(ConnectionError):
            while data := await source.read(65536):
                if toward_peer and self.swallowing:
                    continue  # (a link dying: what the scheduler sends goes nowhere)
                sink.write(data)
                await sink.drain()
        sink.transport.abort()

    def cut(self) -> None:
        self.open = self.swallowing = False
        for writer in self._writers:
            writer.transport.abort()  # a reset, both ways
        self._writers.clear()

    def reopen(self) -> None:
        self.open = True

    async def close(self) -> None:
        self.cut()
        self.server.close()
        for pump in list(self._pumps):
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)


def worker_hello(role: str, peer_id: str, address: str | None) -> wire.Hello:
    return wire.Hello(schema_version=wire.SCHEMA_VERSION, role=role, peer_id=peer_id, model="m",
                      address=address, num_kv_blocks=64, block_size=16,
                      max_num_seqs=8)  # fmt: skip


async def until(condition, seconds: float) -> float:
    """Waits for `condition()`; the seconds it took. TimeoutError past `seconds`."""
    began = time.monotonic()
    async with asyncio.timeout(seconds):
        while not condition():
            await asyncio.sleep(0.01)
    return time.monotonic() - began


@dataclass
class Cluster:
    """The real scheduler on 127.0.0.1, turned by the test's loop, with a forwarder before it."""

    service: SchedulerService
    address: str  # the scheduler's own
    forwarded: str  # the forwarder's, which peers whose link is cut connect to
    forwarder: Forwarder
    context: zmq.asyncio.Context  # for the sockets the test plays peers with
    keys: CurveKeys | None  # CurveZMQ's, every socket's; None: plain


@contextlib.asynccontextmanager
async def scheduler_behind_a_forwarder(curve: bool = False) -> AsyncIterator[Cluster]:
    port = int(free_port())
    address = f"tcp://127.0.0.1:{port}"
    secret = zmq.curve_keypair()[1].decode() if curve else None
    keys = CurveKeys.from_secret(secret) if secret else None
    config = SchedulerConfig(address=address, model="m", heartbeat_interval_s=0.2,
                             curve_secret_key=secret)  # fmt: skip
    service = SchedulerService(config, context=zmq.Context())
    loop = asyncio.create_task(turn(service))
    forwarder = Forwarder(port)
    forwarded = f"tcp://127.0.0.1:{await forwarder.start()}"
    context = zmq.asyncio.Context()
    try:
        yield Cluster(service, address, forwarded, forwarder, context, keys)
    finally:
        loop.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await loop
        await forwarder.close()
        service.socket.close(linger=0)
        service.security.stop()
        service.context.destroy(linger=0)
        context.destroy(linger=0)


async def played(cluster: Cluster, hello: wire.Hello) -> zmq.asyncio.Socket:
    """A peer the test plays, connected straight to the scheduler, that said HELLO and was
    welcomed (closed with the cluster's context)."""
    socket = Security(cluster.keys, get_logger()).client(cluster.context.socket(zmq.DEALER))
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(cluster.address)
    await wire.async_send(socket, hello)
    assert (await reply_to(socket, wire.HelloAck)).accepted
    return socket


# -- the gateway ------------------------------------------------------------------------------


@dataclass
class Gateway:
    """The gateway's real link (through the forwarder) with request "r" placed: its prefill
    job sent, its decode worker's reservation taken (a loss of either worker is told to the
    gateway)."""

    cluster: Cluster
    client: ClusterClient
    queue: asyncio.Queue  # "r"'s
    decode: zmq.asyncio.Socket  # "r"'s decode worker, played by the test


@contextlib.asynccontextmanager
async def gateway_with_r_placed(
    tmp_path, curve: bool = False, **client_args
) -> AsyncIterator[Gateway]:
    async with contextlib.AsyncExitStack() as stack:
        cluster = await stack.enter_async_context(scheduler_behind_a_forwarder(curve))
        prefill = await played(cluster, worker_hello("prefill", "p", None))
        decode = await played(cluster, worker_hello("decode", "d", f"ipc://{tmp_path}/d"))
        client = ClusterClient(cluster.forwarded, f"ipc://{tmp_path}/stream",
                               f"ipc://{tmp_path}/stream", "g", "m",
                               GatewayEvents(get_logger()), keys=cluster.keys,
                               **client_args)  # fmt: skip
        await client.start()
        stack.push_async_callback(client.close)
        await until(lambda: "g" in cluster.service.core.gateways, 5)
        queue = await client.submit(submit("r"))
        reserve = await reply_to(decode, wire.Reserve)
        await wire.async_send(decode, wire.ReserveReply(
            request_id="r", peer_id="d", ok=True, num_free_blocks=60,
            attempt=reserve.attempt))  # fmt: skip
        await reply_to(prefill, wire.PrefillJob)
        yield Gateway(cluster, client, queue, decode)


async def a_loss_across_a_gateway_reconnect(tmp_path, curve: bool) -> tuple[float, float]:
    """The gateway's link cut, and "r"'s decode worker leaving during the gap (the scheduler
    tells the gateway "r" is lost). The seconds after the link opens again until the gateway
    hears the scheduler's status, and until it resumes "r"."""
    async with gateway_with_r_placed(tmp_path, curve) as gateway:
        cluster, client, decode = gateway.cluster, gateway.client, gateway.decode
        cluster.forwarder.cut()
        await asyncio.sleep(GAP_S / 2)  # (the scheduler has seen the connection go)
        await wire.async_send(decode, wire.Goodbye(peer_id="d"))
        await asyncio.sleep(GAP_S / 2)
        cluster.forwarder.reopen()
        cut_at = client.view.received_at
        began = time.monotonic()
        status_s = await until(lambda: client.view.received_at > cut_at, 4)
        await until(lambda: client._requests["r"].attempt_id != "r", 4)
        return status_s, time.monotonic() - began


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_loss_told_while_the_gateway_reconnects_reaches_it_at_once(tmp_path, curve):
    """The scheduler's status, and the "lost" word it sent during the gap, reach the gateway
    as soon as its link is back: it used to hear neither until it said HELLO again (some 3 s
    of the status' silence), and the word never, "r" waiting out its time limit."""
    status_s, resumed_s = asyncio.run(a_loss_across_a_gateway_reconnect(tmp_path, curve))
    assert status_s < PROMPTLY_S
    assert resumed_s < PROMPTLY_S


ORPHAN_SILENCE_S = 1.0


async def a_loss_swallowed_by_the_dying_link(tmp_path) -> float:
    """Request "r" decoding (its first token streamed), and its "lost" word swallowed by the
    gateway's link as it dies (sent before the cut was seen: no one knew to hold it). The
    seconds after the link opens again until the gateway resumes "r"."""
    async with gateway_with_r_placed(tmp_path, orphan_silence_s=ORPHAN_SILENCE_S) as gateway:
        cluster, client, decode = gateway.cluster, gateway.client, gateway.decode
        stream = cluster.context.socket(zmq.PUSH)
        stream.setsockopt(zmq.LINGER, 0)
        stream.connect(f"ipc://{tmp_path}/stream")
        await wire.async_send(stream, delta("r", [7]))
        assert (await asyncio.wait_for(gateway.queue.get(), 5)).token_ids == [7]
        stream.close(linger=0)
        cluster.forwarder.swallowing = True
        await wire.async_send(decode, wire.Goodbye(peer_id="d"))
        await until(lambda: "d" not in cluster.service.core.registry.workers, 5)
        await asyncio.sleep(0.1)  # (the scheduler's word in the swallowing link)
        cluster.forwarder.cut()
        await asyncio.sleep(GAP_S)
        cluster.forwarder.reopen()
        began = time.monotonic()
        await until(lambda: client._requests["r"].attempt_id != "r", 4)
        assert client._requests["r"].token_ids == [7]
        return time.monotonic() - began


def test_a_decoding_request_whose_loss_the_dying_link_swallowed_is_resumed(tmp_path):
    """Watched as an orphan once the link is back, "r" is resumed when its tokens stop: it
    used to wait out its time limit."""
    resumed_s = asyncio.run(a_loss_swallowed_by_the_dying_link(tmp_path))
    assert resumed_s < 2 * ORPHAN_SILENCE_S + PROMPTLY_S


# -- a worker ---------------------------------------------------------------------------------


async def a_reservation_across_a_worker_reconnect(tmp_path, curve: bool) -> float:
    """A decode worker's real link cut, and a request placed on that worker during the gap.
    The seconds after the link opens again until the worker has the RESERVE (no heartbeat in
    between: the worker's pace is the test's)."""
    async with scheduler_behind_a_forwarder(curve) as cluster:
        hello = worker_hello("decode", "d", f"ipc://{tmp_path}/d")
        security = Security(cluster.keys, get_logger())
        link = SchedulerLink(zmq.Context(), cluster.forwarded, hello, security)
        try:
            assert await asyncio.to_thread(link.handshake, 5.0)
            await played(cluster, worker_hello("prefill", "p", None))
            gateway_hello = wire.Hello(schema_version=wire.SCHEMA_VERSION, role="gateway",
                                       peer_id="g", model="m", address=f"ipc://{tmp_path}/g",
                                       num_kv_blocks=0, block_size=0,
                                       max_num_seqs=0)  # fmt: skip
            gateway = await played(cluster, gateway_hello)
            cluster.forwarder.cut()
            await asyncio.sleep(GAP_S / 2)  # (the scheduler has seen the connection go)
            await wire.async_send(gateway, submit("r"))
            reply = await reply_to(gateway, wire.SubmitReply)
            assert reply.accepted, reply
            await asyncio.sleep(GAP_S / 2)
            cluster.forwarder.reopen()
            began = time.monotonic()
            reserve = await asyncio.to_thread(receive, link.socket, wire.Reserve, 4.0)
            assert reserve.request_id == "r"
            return time.monotonic() - began
        finally:
            link.close()
            link.socket.context.destroy(linger=0)


def receive(socket: zmq.Socket, kind: type, seconds: float) -> wire.Message:
    deadline = time.monotonic() + seconds
    while socket.poll(max(1, round((deadline - time.monotonic()) * 1000))):
        message = wire.recv(socket)
        if isinstance(message, kind):
            return message
    raise TimeoutError(f"no {kind.__name__} within {seconds} s")


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_reservation_sent_while_a_worker_reconnects_reaches_it_at_once(tmp_path, curve):
    """The RESERVE sent during the gap reaches the decode worker once its link is back: it was
    dropped (sent to the worker's old ROUTER identity), and the request waited out the
    reservation's timeout."""
    assert asyncio.run(a_reservation_across_a_worker_reconnect(tmp_path, curve)) < PROMPTLY_S


# -- the pieces ---------------------------------------------------------------------------------


def test_messages_held_for_a_peer_away_are_bounded_in_number_and_age():
    held = Undelivered(keep_s=10.0, max_per_peer=2)
    for number in range(3):
        held.hold(b"gone", wire.Cancel(request_id=f"r{number}", reason="x"), now=float(number))
    held.hold(b"back", wire.Cancel(request_id="b", reason="x"), now=5.0)
    assert held.first(b"gone") == wire.Cancel(request_id="r1", reason="x")  # the oldest went
    assert held.expire(now=11.5) == [(b"gone", 2)]  # its oldest held waited past 10 s
    assert held.peers() == [b"back"] and held.num_dropped == 3
    held.pop(b"back")
    assert not held.holds(b"back")


def test_a_routing_id_is_each_processs_own_and_one_a_router_takes():
    first, second = routing_id("decode-0"), routing_id("decode-0")
    assert first != second and first.startswith(b"tandem:decode-0:")
    long = routing_id("é" * 300)  # (a multi-byte character cut in two is left out)
    assert len(long) <= 255 and long.decode()
