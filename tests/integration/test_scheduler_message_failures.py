"""A message whose handling raises costs that message, not the scheduler: through the service's
own socket and loop (`_drain`), a SUBMIT that raised after the core took it in is refused with
500 and forgotten (its decode reservation let go), and the next one is served; failures that
persist end the loop (`shared.failures`). The exception is injected: the core has no known one,
its fuzz (`tests/unit/test_scheduler_odd_values.py`) looks for them."""

from __future__ import annotations

import signal
import time

import pytest
import zmq

from services.scheduler.service import SchedulerConfig, SchedulerService
from shared import wire
from shared.failures import DEFAULT_LIMIT, FailureWindow, PersistentFailures


class Peer:
    """A gateway or worker: a DEALER on the scheduler's ROUTER."""

    def __init__(self, context: zmq.Context, address: str, identity: bytes):
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, identity)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.connect(address)

    def next(self) -> wire.Message:
        assert self.socket.poll(5000)
        return wire.recv(self.socket)

    def received(self) -> list[wire.Message]:
        messages = []
        while self.socket.poll(200):
            messages.append(wire.recv(self.socket))
        return messages


@pytest.fixture
def cluster(tmp_path):
    context = zmq.Context()
    service = SchedulerService(SchedulerConfig(address=f"ipc://{tmp_path}/s"), context)
    peers = {name: Peer(context, service.config.address, name.encode()) for name in "gpd"}
    for name, role in (("g", "gateway"), ("p", "prefill"), ("d", "decode")):
        deliver(service, peers[name], hello(service, name, role, tmp_path))
        assert peers[name].received()[0].accepted
    peers["d2"] = Peer(context, service.config.address, b"d2")  # joins in a test
    yield service, peers
    service.socket.close(linger=0)
    service.security.stop()
    context.destroy(linger=0)


def hello(service: SchedulerService, name: str, role: str, tmp_path) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=name,
        model=service.config.model,
        address=None if role == "prefill" else f"ipc://{tmp_path}/{name}",
        num_kv_blocks=0 if role == "gateway" else 64,
        block_size=0 if role == "gateway" else 16,
        max_num_seqs=0 if role == "gateway" else 8,
    )


def deliver(service: SchedulerService, peer: Peer, message: wire.Message) -> None:
    """Sends `message` on `peer`'s socket and turns the service's loop over what arrived."""
    wire.send(peer.socket, message)
    assert service.socket.poll(5000)
    service._drain()


def submit(request_id: str) -> wire.Submit:
    return wire.Submit(
        request_id=request_id,
        prompt_token_ids=[7] * 40,
        sampling=wire.SamplingSpec(max_tokens=8),
        tenant="t",
        priority=0,
        gateway_peer_id="g",
        arrival_time=0.0,
    )


def raise_after(service: SchedulerService) -> None:
    """The service's SUBMIT handling raises once the core has taken the request in (queued,
    then dispatched: the decode worker asked to reserve)."""
    real = service._submit

    def submit_then_raise(*args):
        real(*args)
        raise RuntimeError("injected")

    service._submit = submit_then_raise  # type: ignore[method-assign]


def failures(service: SchedulerService, kind: str) -> float | None:
    return service.events.registry.get_sample_value("tandem:message_failures_total", {"type": kind})


def test_a_submit_that_raises_is_refused_and_forgotten_and_the_next_is_served(cluster):
    service, peers = cluster
    raise_after(service)
    dispatched = []
    real_dispatched = service.events.dispatched

    def record_dispatched(request_id: str, *args) -> None:
        dispatched.append(request_id)
        real_dispatched(request_id, *args)

    service.events.dispatched = record_dispatched  # type: ignore[method-assign]
    deliver(service, peers["g"], submit("poison"))
    [reply] = peers["g"].received()
    assert isinstance(reply, wire.SubmitReply) and not reply.accepted
    assert reply.status_code == 500
    assert reply.message == (
        "the scheduler failed on this request (RuntimeError; its log has the traceback)"
    )
    assert failures(service, "Submit") == 1
    # What the core had done is undone: its reservation (which never went out: the handler
    # that made it raised) is cancelled and let go.
    [told] = peers["d"].received()
    assert isinstance(told, wire.Cancel) and told.request_id == "poison"
    assert "poison" not in service.core.requests and len(service.core.queue) == 0
    assert not service.core.registry.get("d").request_ids
    assert dispatched == []  # neither logged nor timed as dispatched

    del service._submit  # the class's own again
    deliver(service, peers["g"], submit("r1"))
    [reply] = peers["g"].received()
    assert reply.accepted and reply.request_id == "r1"
    assert [type(m) for m in peers["d"].received()] == [wire.Reserve]
    assert dispatched == ["r1"]


def test_a_submit_that_raises_after_its_acceptance_was_built_has_one_answer(cluster):
    """The core built the SUBMIT's acceptance, then the dispatch pass after it raised outside
    the placement's guard: the gateway heard "accepted", then "refused", kept the first and
    waited for a request the scheduler had forgotten."""
    service, peers = cluster

    def raises(*args):
        raise RuntimeError("injected")

    service.core._placeable_lengths = raises  # type: ignore[method-assign]
    deliver(service, peers["g"], submit("poison"))
    replies = peers["g"].received()
    assert [(type(r), r.accepted, r.status_code) for r in replies] == [
        (wire.SubmitReply, False, 500)
    ]
    assert "poison" not in service.core.requests and len(service.core.queue) == 0
    del service.core._placeable_lengths
    deliver(service, peers["g"], submit("r1"))
    [reply] = peers["g"].received()
    assert reply.accepted


def test_a_tick_that_raises_costs_that_turn_not_the_scheduler(cluster):
    """The periodic turn had no guard: one exception ended the scheduler and its queue."""
    service, peers = cluster
    real_tick = service.core.tick

    def cancel_then_raise(now):
        service.core._send(b"d", wire.Cancel(request_id="x", reason="built before the raise"))
        raise RuntimeError("injected")

    service.core.tick = cancel_then_raise  # type: ignore[method-assign]
    service._tick_guarded(1.0)
    assert failures(service, "tick") == 1
    [told] = peers["d"].received()
    assert told.request_id == "x"  # what was built before the raise went out
    service.core.tick = real_tick  # type: ignore[method-assign]
    service._tick_guarded(2.0)
    assert failures(service, "tick") == 1


def heartbeat(peer_id: str, num_free_blocks: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        peer_id=peer_id, num_waiting=0, num_running=0, num_free_blocks=num_free_blocks,
        num_total_blocks=64, steps_completed=0, sent_at=0.0,
    )  # fmt: skip


def test_what_a_failing_pass_decided_for_other_requests_still_goes_out(cluster):
    """A dispatch pass places many requests, each decision's messages built as it is taken.
    When the core raises on the second (here its decode pick), the first one's reservation is
    sent all the same: it used to be lost with the exception, its request waiting out the
    reservation's timeout (5 s) for a worker that never heard of it. The second fails to its
    gateway (it used to be left out of the queue, waiting for nobody)."""
    service, peers = cluster
    deliver(service, peers["d"], heartbeat("d", num_free_blocks=0))  # no room: both queue
    for request_id in ("a", "b"):
        deliver(service, peers["g"], submit(request_id))
        [reply] = peers["g"].received()
        assert reply.accepted and reply.request_id == request_id
    assert peers["d"].received() == [] and len(service.core.queue) == 2
    registry = service.core.registry
    real_pick = registry.pick_decode
    picks = []

    def pick_then_raise(*args):
        picks.append(args)
        if len(picks) == 2:
            raise RuntimeError("injected")
        return real_pick(*args)

    registry.pick_decode = pick_then_raise  # type: ignore[method-assign]
    deliver(service, peers["d"], heartbeat("d", num_free_blocks=64))  # room: a pass places both
    told = peers["d"].received()
    assert [(type(m), m.request_id) for m in told] == [(wire.Reserve, "a")]
    [failed] = peers["g"].received()
    assert [(d.request_id, d.finish_reason) for d in failed.deltas] == [("b", "error")]
    assert failures(service, "dispatch") == 1 and failures(service, "Heartbeat") is None
    assert "b" not in service.core.requests and service.core.num_queued_tokens == 0
    assert service.core.outbox == []


def test_a_submit_whose_own_placement_raises_is_accepted_then_failed(cluster):
    """The SUBMIT was handled (queued); the pass it began failed its request: the gateway hears
    both, in order, and the failure is counted as the dispatch's, not the SUBMIT's."""
    service, peers = cluster
    registry = service.core.registry

    def pick_raises(*args):
        raise RuntimeError("injected")

    registry.pick_decode = pick_raises  # type: ignore[method-assign]
    deliver(service, peers["g"], submit("a"))
    accepted, failed = peers["g"].received()
    assert accepted.accepted and accepted.request_id == "a"
    [delta] = failed.deltas
    assert delta.request_id == "a" and delta.finish_reason == "error"
    assert delta.error == (
        "the scheduler failed to place this request (RuntimeError; its log has the traceback)"
    )
    assert failures(service, "dispatch") == 1 and failures(service, "Submit") is None
    assert peers["d"].received() == [] and not service.core.requests


def test_a_worker_whose_hello_begins_a_failing_pass_is_welcomed(cluster, tmp_path):
    """A decode worker joining makes room: the pass its HELLO begins fails the queued request
    whose placement raises, and the worker still has its acknowledgement (a HELLO unanswered
    is sent again and again)."""
    service, peers = cluster
    deliver(service, peers["d"], heartbeat("d", num_free_blocks=0))  # no room: it queues
    deliver(service, peers["g"], submit("a"))
    assert peers["g"].received()[0].accepted and len(service.core.queue) == 1

    def pick_raises(*args):
        raise RuntimeError("injected")

    service.core.registry.pick_decode = pick_raises  # type: ignore[method-assign]
    deliver(service, peers["d2"], hello(service, "d2", "decode", tmp_path))
    [ack] = peers["d2"].received()
    assert isinstance(ack, wire.HelloAck) and ack.accepted
    [failed] = peers["g"].received()
    assert [(d.request_id, d.finish_reason) for d in failed.deltas] == [("a", "error")]
    assert failures(service, "dispatch") == 1 and failures(service, "Hello") is None


def test_failures_that_persist_end_the_loop(cluster):
    service, peers = cluster
    # The window's clock stands still: how fast this machine logs 21 tracebacks (a pretty one
    # can take half a second) must not decide whether they fell within 10 s.
    service.failures = FailureWindow(clock=lambda: 0.0)
    service._submit = lambda *args: 1 / 0  # type: ignore[method-assign]
    for index in range(DEFAULT_LIMIT):
        deliver(service, peers["g"], submit(f"r{index}"))
        assert peers["g"].next().status_code == 500
    with pytest.raises(PersistentFailures, match="21 messages failed within 10 s"):
        deliver(service, peers["g"], submit("one-too-many"))


def test_a_flood_of_messages_does_not_hold_off_the_tick(tmp_path):
    """The loop read messages until none was left before it ticked: under a flood the socket
    never empties, and the tick (silent workers out of rotation, reservations and prefills
    timed out, the gateways' status) waited for the flood to end. It ticks on time, the rest of
    the flood read after."""
    context = zmq.Context()
    config = SchedulerConfig(address=f"ipc://{tmp_path}/s", heartbeat_interval_s=0.1)
    service = SchedulerService(config, context)
    gateway, worker = (Peer(context, config.address, name) for name in (b"g", b"d"))
    deliver(service, gateway, hello(service, "g", "gateway", tmp_path))
    deliver(service, worker, hello(service, "d", "decode", tmp_path))
    num_flood = 300
    for _ in range(num_flood):
        wire.send(worker.socket, heartbeat("d", num_free_blocks=64))
    handled, handled_at_status = [], []
    real_handle, real_status = service._handle_guarded, service._broadcast_status

    def slow_handle(*args):
        time.sleep(0.002)  # the flood outlasts several ticks: 0.6 s against one each 0.05 s
        handled.append(None)
        return real_handle(*args)

    def status_then_stop(now):
        real_status(now)
        handled_at_status.append(len(handled))
        if len(handled_at_status) == 3:
            service.stop()

    service._handle_guarded = slow_handle  # type: ignore[method-assign]
    service._broadcast_status = status_then_stop  # type: ignore[method-assign]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    time.sleep(0.3)  # the whole flood waits at the scheduler's socket
    try:
        service.serve_forever()
    finally:
        for number, handler in handlers.items():
            signal.signal(number, handler)
        context.destroy(linger=0)
    # Ticks on time, and the flood read between them.
    assert handled_at_status == sorted(set(handled_at_status)), handled_at_status
    assert handled_at_status[-1] < num_flood, handled_at_status


def test_a_gateway_hears_the_schedulers_epoch_with_its_welcome(tmp_path):
    """The status carrying the epoch came at the next tick: a SUBMIT this scheduler accepted
    before it was taken, after a restart, for a request the scheduler before had lost, and
    resumed for nothing (a new attempt at the back of the queue, a resumption spent)."""
    context = zmq.Context()
    service = SchedulerService(SchedulerConfig(address=f"ipc://{tmp_path}/s"), context)
    try:
        gateway = Peer(context, service.config.address, b"g")
        deliver(service, gateway, hello(service, "g", "gateway", tmp_path))
        ack, status = gateway.received()
        assert ack.accepted and isinstance(status, wire.ClusterStatus)
        assert status.scheduler_epoch == service.epoch
        worker = Peer(context, service.config.address, b"d")
        deliver(service, worker, hello(service, "d", "decode", tmp_path))
        assert [type(m) for m in worker.received()] == [wire.HelloAck]  # (gateways only)
    finally:
        service.socket.close(linger=0)
        service.security.stop()
        context.destroy(linger=0)
