"""A prefill worker hears a decode worker in every KV_ACK read on that worker's socket, one for a
transfer already given up on (late) included. A late ack was dropped unheard, so a slow but
alive decode worker whose acks all came past their deadlines had its socket dropped as silent
at each timeout, with the KV queued in it. The late ack revives nothing: its transfer stays
given up (the scheduler re-routed it). A real prefill worker (the tiny model, its loop turned by
hand, its timers driven by the test) and ROUTERs playing the decode workers, on real sockets."""

from __future__ import annotations

import zmq

from services.prefill.service import PrefillWorker
from shared import wire
from tests.integration.conftest import tiny_model_dir  # noqa: F401  (a fixture)
from tests.integration.test_worker_peer_sockets import (  # noqa: F401  (cluster: a fixture)
    cluster,
    prefill_job,
    turn_until,
)


def ship(setup: tuple, request_id: str, decode: zmq.Socket, address: str) -> bytes:
    """Hands the worker a job whose KV goes to `address` and turns its loop until the KV
    reaches `decode` (bound there); the identity of the worker's socket to it."""
    worker, _, addresses = setup  # (the cluster fixture's)
    worker._handle(prefill_job(request_id, addresses["gateway0"], address), None)
    [frames] = turn_until(worker, decode, 1)
    assert wire.decode(frames[1:]).request_id == request_id
    return frames[0].bytes


def ack(decode: zmq.Socket, identity: bytes, request_id: str) -> None:
    wire.send_to(decode, identity, wire.KvAck(request_id=request_id, ok=True, error=None))


def read_replies(worker: PrefillWorker, address: str) -> None:
    """Turns the worker's loop once what the decode worker at `address` sent has arrived."""
    assert worker.decode_sockets[address].poll(5_000), "nothing arrived"
    worker.run_once()
    assert not worker.decode_sockets[address].poll(0), "left unread"


def time_out(worker: PrefillWorker, request_id: str) -> None:
    """Runs the worker's timers just past the transfer's deadline (none sent later is due)."""
    worker._on_timers(worker.transfers[request_id].deadline + 1e-6)
    assert request_id not in worker.transfers


def reports(scheduler: zmq.Socket) -> list[tuple[str, str | None]]:
    """The prefill reports the scheduler has had (heartbeats skipped)."""
    done = []
    while scheduler.poll(200):
        message = wire.decode(scheduler.recv_multipart()[1:])
        if isinstance(message, wire.RequestDone):
            done.append((message.request_id, message.finish_reason))
    return done


def test_a_late_ack_keeps_a_slow_decode_workers_socket(cluster):  # noqa: F811
    worker, sockets, addresses = cluster
    decode, address = sockets["decode"], addresses["decode"]
    identity = ship(cluster, "ok", decode, address)
    ship(cluster, "late", decode, address)
    ack(decode, identity, "ok")
    read_replies(worker, address)
    ship(cluster, "next", decode, address)
    time_out(worker, "late")  # heard since it was sent (ok's ack): the socket stays
    assert address in worker.decode_sockets
    ack(decode, identity, "late")  # past its deadline: the worker is slow, not gone
    read_replies(worker, address)
    time_out(worker, "next")  # sent before the late ack came: the worker was heard since
    assert address in worker.decode_sockets
    # The late ack revived nothing: its transfer stayed given up, reported once.
    assert reports(sockets["scheduler"]) == [("ok", None), ("late", "error"), ("next", "error")]
    assert worker.held_request_ids() == []


def test_a_socket_silent_since_its_transfer_is_still_dropped(cluster):  # noqa: F811
    """Heard before the transfer went (a late ack), sent junk since, or a stranger's ack on
    another decode worker's socket: none of it is an ack on this socket since, which goes."""
    worker, sockets, addresses = cluster
    decode, address = sockets["decode"], addresses["decode"]
    other = worker.context.socket(zmq.ROUTER)  # another decode worker (the fixture closes it)
    other.bind(other_address := address + "-other")
    identity = ship(cluster, "ok", decode, address)
    ship(cluster, "late", decode, address)
    ack(decode, identity, "ok")
    read_replies(worker, address)
    time_out(worker, "late")
    ack(decode, identity, "late")
    read_replies(worker, address)  # heard, late
    ship(cluster, "last", decode, address)  # sent after the worker was last heard
    decode.send_multipart([identity, b"\x00junk"])  # not an ack: dropped as malformed
    read_replies(worker, address)
    other_identity = ship(cluster, "elsewhere", other, other_address)
    ack(other, other_identity, "stranger")  # an ack for no transfer, from the other worker
    read_replies(worker, other_address)
    time_out(worker, "last")
    assert address not in worker.decode_sockets  # silent since "last" went
    time_out(worker, "elsewhere")
    assert other_address in worker.decode_sockets  # heard since (the stranger's ack)
    assert worker.held_request_ids() == []
    assert reports(sockets["scheduler"]) == [
        ("ok", None),
        ("late", "error"),
        ("last", "error"),
        ("elsewhere", "error"),
    ]
