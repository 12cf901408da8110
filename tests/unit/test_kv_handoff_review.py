"""Review of the KV hand-off from prefill to decode workers, on real sockets: a real decode
worker (the tiny model, `tests/integration/conftest.py`) behind its KV ROUTER with a DEALER
playing the prefill worker, or a real prefill worker with a ROUTER playing the decode worker;
the integration tests' fake scheduler and gateway sockets around them."""

from __future__ import annotations

import dataclasses

import pytest
import zmq

from services.decode.service import DecodeWorker
from shared import wire
from shared.engine.sampling_params import SamplingParams
from tests.integration.conftest import FakeScheduler, tiny_model_dir  # noqa: F401  (a fixture)
from tests.integration.test_decode_worker import (  # noqa: F401  (setup: a fixture)
    decode_config,
    prefilled_transfer,
    setup,
)
from tests.integration.test_worker_peer_sockets import (  # noqa: F401  (cluster: a fixture)
    cluster,
    prefill_job,
    turn_until,
)

RESERVE_TOKENS = 19  # the transfer's prompt and its first token


def reserve(scheduler, request_id: str) -> None:
    scheduler.send(wire.Reserve(request_id=request_id, num_tokens=RESERVE_TOKENS, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok


def ack_for(peer) -> wire.KvAck:
    assert peer.poll(10_000), "the KV transfer went unanswered"
    return wire.recv(peer)


@pytest.mark.parametrize("max_tokens", [0, -3])
def test_transfer_with_sampling_the_engine_refuses_is_refused_by_name(setup, max_tokens):  # noqa: F811
    """A KV_TRANSFER whose sampling no engine would take (max_tokens under 1) is refused, the
    field named, and its reservation freed; it was taken for a request already at max_tokens,
    acknowledged as admitted, and its stream ended "length" as if served."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    transfer, _ = prefilled_transfer(model_dir, "bad", gateway_address, SamplingParams())
    sampling = dataclasses.replace(transfer.sampling, max_tokens=max_tokens)
    free_before = worker.num_available_blocks()
    reserve(scheduler, "bad")
    wire.send(peer, dataclasses.replace(transfer, sampling=sampling))
    ack = ack_for(peer)
    assert not ack.ok and "max_tokens" in ack.error, ack
    assert not gateway.poll(300), "a refused transfer streamed to its gateway"
    assert worker.num_available_blocks() == free_before


def _take(worker, sock, timeout_ms: int = 10_000) -> None:
    """What arrived on one of the worker's sockets, handled (its loop is not run: no step)."""
    assert sock.poll(timeout_ms), "nothing arrived"
    worker._drain(sock)


def test_kv_reserved_before_the_worker_registered_again_is_of_the_earlier_registration(
    tmp_path,
    tiny_model_dir,  # noqa: F811
):
    """A reservation made for the scheduler before a restart whose KV arrives after the worker
    registered again holds a request of the earlier registration: handed back for recompute, its
    gateway is told directly (the new scheduler drops the report on an id not yet listed to it).
    It was counted as the new registration's, and the gateway waited for its orphan watch."""
    context = zmq.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/s.sock")
    gateway = context.socket(zmq.PULL)
    gateway_address = f"ipc://{tmp_path}/g.sock"
    gateway.bind(gateway_address)
    config = decode_config(tmp_path, tiny_model_dir)
    worker = DecodeWorker(config, context)  # (its loop not run: the test turns it)
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(config.address)
    try:
        worker.link.send(worker.link.hello)
        scheduler.expect(wire.Hello)  # (welcomed)
        _take(worker, worker.link.socket)
        reserve_here = wire.Reserve(request_id="r", num_tokens=RESERVE_TOKENS, lease_s=30)
        scheduler.send(reserve_here)
        _take(worker, worker.link.socket)
        assert scheduler.expect(wire.ReserveReply).ok
        # The scheduler restarts: it answers a heartbeat so, and the worker registers again.
        scheduler.send(
            wire.HelloAck(
                schema_version=wire.SCHEMA_VERSION,
                accepted=False,
                error=wire.UNKNOWN_PEER,
                heartbeat_interval_s=0.0,
            )  # fmt: skip
        )
        _take(worker, worker.link.socket)
        assert worker._registration == 1
        params = SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True)
        transfer, _ = prefilled_transfer(tiny_model_dir, "r", gateway_address, params)
        wire.send(peer, transfer)
        _take(worker, worker.kv_socket)
        assert ack_for(peer).ok
        worker._hand_back("r")  # (as a step that preempted it for recompute would)
        assert gateway.poll(5_000), "its gateway was not told"
        (told,) = wire.recv(gateway).deltas
        assert (told.request_id, told.finish_reason) == ("r", "preempted")
    finally:
        worker.close()
        peer.close()
        gateway.close()
        scheduler.socket.close()
        context.term()


def test_an_ack_that_came_while_the_step_ran_counts_before_its_transfer_is_given_up(
    cluster,  # noqa: F811
):
    """A real prefill worker (the tiny model, its loop turned by hand) whose KV_ACK came in
    while its step ran past the transfer's deadline: the loop runs its timers before it reads
    its sockets again, and the transfer was reported failed with its ack unread. The
    scheduler then took the request from the decode worker that had admitted it, and its
    gateway resumed it elsewhere: the work done and the KV shipped were thrown away."""
    worker, sockets, addresses = cluster
    decode = sockets["decode"]
    worker._handle(prefill_job("r", addresses["gateway0"], addresses["decode"]), None)
    [frames] = turn_until(worker, decode, 1)
    wire.send_to(decode, frames[0].bytes, wire.KvAck(request_id="r", ok=True, error=None))
    assert worker.decode_sockets[addresses["decode"]].poll(5_000)  # arrived, not read yet
    worker._on_timers(worker.transfers["r"].deadline + 1)  # (as after a step that long)
    scheduler = sockets["scheduler"]
    while True:
        assert scheduler.poll(5_000), "no report"
        done = wire.decode(scheduler.recv_multipart()[1:])
        if isinstance(done, wire.RequestDone):
            break
    assert (done.request_id, done.phase, done.finish_reason) == ("r", "prefill", None)
