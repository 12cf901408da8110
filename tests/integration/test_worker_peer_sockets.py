"""A real prefill worker (the tiny model) closes its sockets to gateways and decode workers once
no request has used them for `peer_socket_idle_s`, never a decode socket a KV_ACK is awaited on,
and opens them again for the next job that names the address: a worker outliving many peers
(each restart a new address) does not gather their sockets until it runs out of descriptors."""

from __future__ import annotations

import time

import pytest
import zmq

from services.prefill.service import PrefillWorker
from services.worker.config import WorkerConfig
from shared import wire

IDLE_S = 0.3
PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 3, 99, 41]


@pytest.fixture
def cluster(tmp_path, tiny_model_dir):
    """The worker, and the sockets it talks to: the scheduler's, three gateways', and a decode
    worker's KV socket (played by the test)."""
    context = zmq.Context()
    bound = {"scheduler": zmq.ROUTER, "decode": zmq.ROUTER}
    bound |= {f"gateway{i}": zmq.PULL for i in range(3)}
    sockets, addresses = {}, {}
    for name, kind in bound.items():
        addresses[name] = f"ipc://{tmp_path}/{name}"
        sockets[name] = context.socket(kind)
        sockets[name].setsockopt(zmq.LINGER, 0)
        sockets[name].bind(addresses[name])
    config = WorkerConfig(
        scheduler_address=addresses["scheduler"],
        peer_id="p",
        model=str(tiny_model_dir),
        dtype="float32",
        kv_cache_bytes=1 << 20,
        block_size=4,
        peer_socket_idle_s=IDLE_S,
    )
    worker = PrefillWorker(config, context)
    worker.link.heartbeat_interval_s = 1e-3  # a heartbeat (and a look for idle sockets) each turn
    yield worker, sockets, addresses
    worker.close()
    context.destroy(linger=0)


def prefill_job(request_id: str, gateway: str, decode: str) -> wire.PrefillJob:
    return wire.PrefillJob(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True),
        gateway_address=gateway,
        decode_peer_id="d",
        decode_address=decode,
    )


def turn_until(worker: PrefillWorker, sock: zmq.Socket, count: int) -> list[list[zmq.Frame]]:
    """Turns the worker's loop until `sock` has received `count` messages; returns them."""
    received: list[list[zmq.Frame]] = []
    deadline = time.monotonic() + 20
    while len(received) < count:
        assert time.monotonic() < deadline, f"{len(received)} of {count} messages"
        worker.run_once()
        while sock.poll(0):
            received.append(sock.recv_multipart(copy=False))
    return received


def prefill_reports(worker: PrefillWorker, scheduler: zmq.Socket, count: int) -> list[str]:
    """The requests of the next `count` prefill reports (heartbeats skipped)."""
    done: list[str] = []
    deadline = time.monotonic() + 20
    while len(done) < count:
        assert time.monotonic() < deadline, f"{done} reported"
        for frames in turn_until(worker, scheduler, 1):
            message = wire.decode(frames[1:])
            if isinstance(message, wire.RequestDone):
                done.append(message.request_id)
    return done


def idle_turns(worker: PrefillWorker) -> None:
    time.sleep(IDLE_S * 1.5)
    for _ in range(3):
        worker.run_once()


def test_idle_peer_sockets_close_but_not_while_an_ack_is_awaited_and_open_again(cluster):
    worker, sockets, addresses = cluster
    decode = sockets["decode"]
    for i in range(3):
        worker._handle(prefill_job(f"r{i}", addresses[f"gateway{i}"], addresses["decode"]), None)
    received = turn_until(worker, decode, 3)
    assert sorted(wire.decode(frames[1:]).request_id for frames in received) == ["r0", "r1", "r2"]
    identity = received[0][0].bytes  # the worker's one socket to this decode worker
    for i in range(3):  # each gateway had its first token
        assert wire.decode(sockets[f"gateway{i}"].recv_multipart()).deltas[0].request_id == f"r{i}"
    assert len(worker.streams) == 3 and len(worker.decode_sockets) == 1

    # Two of the three transfers acknowledged; r2's ack stays awaited.
    for request_id in ("r0", "r1"):
        wire.send_to(decode, identity, wire.KvAck(request_id=request_id, ok=True, error=None))
    assert sorted(prefill_reports(worker, sockets["scheduler"], 2)) == ["r0", "r1"]
    idle_turns(worker)
    assert len(worker.streams) == 0  # idle gateway streams close whatever names them
    assert len(worker.decode_sockets) == 1  # r2's ack comes back on it
    closing = worker.decode_sockets[addresses["decode"]]
    assert worker.decode_sockets.address_of(closing) == addresses["decode"]
    wire.send_to(decode, identity, wire.KvAck(request_id="r2", ok=True, error=None))
    assert prefill_reports(worker, sockets["scheduler"], 1) == ["r2"]
    idle_turns(worker)
    assert len(worker.decode_sockets) == 0
    assert worker.decode_sockets.address_of(closing) is None  # (closed: forgotten both ways)
    assert [sock for sock, _ in worker.poller.sockets] == [worker.link.socket]

    # The next job naming the same peers opens their sockets again, acks included.
    worker._handle(prefill_job("r3", addresses["gateway0"], addresses["decode"]), None)
    [frames] = turn_until(worker, decode, 1)
    assert wire.decode(frames[1:]).request_id == "r3"
    assert wire.decode(sockets["gateway0"].recv_multipart()).deltas[0].request_id == "r3"
    wire.send_to(decode, frames[0].bytes, wire.KvAck(request_id="r3", ok=True, error=None))
    assert prefill_reports(worker, sockets["scheduler"], 1) == ["r3"]
