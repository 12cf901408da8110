"""A worker's HELLO handshake against a scheduler played by the test on a real ROUTER socket:
the interval it is given, and a refusal, an odd interval or silence as a clear error."""

from __future__ import annotations

import math
import threading
import time

import pytest
import zmq

from services.worker.link import HandshakeError, SchedulerLink
from shared import wire
from shared.curve import Security
from shared.logs import get_logger


def hello() -> wire.Hello:
    return wire.Hello(schema_version=wire.SCHEMA_VERSION, role="decode", peer_id="d", model="m",
                      address="tcp://127.0.0.1:1", num_kv_blocks=8, block_size=4,
                      max_num_seqs=2)  # fmt: skip


def answer_hellos(socket: zmq.Socket, ack: wire.HelloAck, stop: threading.Event) -> None:
    while not stop.is_set():
        if socket.poll(50):
            identity, message = wire.recv_from(socket)
            if isinstance(message, wire.Hello):
                wire.send_to(socket, identity, ack)


def handshake(tmp_path, ack: wire.HelloAck | None, timeout_s: float = 10.0) -> SchedulerLink:
    """A link's handshake with a scheduler that answers every HELLO with `ack` (None: silent)."""
    context = zmq.Context()
    scheduler = context.socket(zmq.ROUTER)
    scheduler.setsockopt(zmq.LINGER, 0)
    scheduler.bind(f"ipc://{tmp_path}/scheduler")
    stop = threading.Event()
    answering = threading.Thread(target=answer_hellos, args=(scheduler, ack, stop), daemon=True)
    if ack is not None:
        answering.start()
    link = SchedulerLink(context, f"ipc://{tmp_path}/scheduler", hello(),
                         Security(None, get_logger()))  # fmt: skip
    try:
        link.handshake(timeout_s)
        return link
    finally:
        stop.set()
        if ack is not None:
            answering.join(timeout=5)
        link.close()
        scheduler.close(linger=0)
        context.term()


def ack(interval_s: float, accepted: bool = True, error: str | None = None) -> wire.HelloAck:
    return wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=accepted, error=error,
                         heartbeat_interval_s=interval_s)  # fmt: skip


def test_the_link_heartbeats_as_often_as_the_scheduler_says(tmp_path):
    assert handshake(tmp_path, ack(0.25)).heartbeat_interval_s == 0.25


@pytest.mark.parametrize("interval_s", [math.nan, math.inf, 0.0, -1.0, -math.inf])
def test_an_odd_heartbeat_interval_is_refused_by_name(tmp_path, interval_s):
    with pytest.raises(HandshakeError, match=f"heartbeat every {interval_s} s"):
        handshake(tmp_path, ack(interval_s))


def test_a_refusal_says_why(tmp_path):
    with pytest.raises(HandshakeError, match="refused this worker: model mismatch"):
        handshake(tmp_path, ack(0.5, accepted=False, error="model mismatch"))


def test_a_silent_scheduler_is_an_error_once_the_time_is_up(tmp_path):
    with pytest.raises(HandshakeError, match="no answer from the scheduler within 1 s"):
        handshake(tmp_path, None, timeout_s=1.0)


def test_forgotten_once_the_worker_registers_again_once(tmp_path):
    """The scheduler forgot the worker (it restarted): each heartbeat sent before the worker's
    new HELLO is answered "unknown peer". Those answers come before the HELLO's own answer, on
    the one connection; one drained over 2 s after the HELLO (a long step between) made the
    worker say HELLO a second time, and the scheduler dropped it with every request it had
    given it since. Registering again waits for its welcome, however long the worker's steps,
    unless none comes while it heartbeats on (the HELLO was lost)."""
    from services.worker import link as link_module

    context = zmq.Context()
    scheduler = context.socket(zmq.ROUTER)
    scheduler.setsockopt(zmq.LINGER, 0)
    scheduler.bind(f"ipc://{tmp_path}/scheduler")
    link = SchedulerLink(context, f"ipc://{tmp_path}/scheduler", hello(),
                         Security(None, get_logger()))  # fmt: skip
    forgotten = ack(0.5, accepted=False, error=wire.UNKNOWN_PEER)
    beat = wire.Heartbeat(peer_id="d", num_waiting=0, num_running=0, num_free_blocks=1,
                          num_total_blocks=1, steps_completed=0, sent_at=0.0)  # fmt: skip

    def hellos_sent() -> int:
        count = 0
        while scheduler.poll(200):
            count += isinstance(wire.recv_from(scheduler)[1], wire.Hello)
        return count

    try:
        assert link.on_hello_ack(forgotten, get_logger()) and hellos_sent() == 1
        time.sleep(2.5)  # a long step; then the answer to a heartbeat sent before the HELLO
        link.send_heartbeat(beat, time.monotonic())
        assert not link.on_hello_ack(forgotten, get_logger()) and hellos_sent() == 0
        link.on_hello_ack(ack(0.5), get_logger())  # welcomed
        assert link.on_hello_ack(forgotten, get_logger()) and hellos_sent() == 1  # forgotten again
        for _ in range(link_module.WELCOME_WAIT_BEATS):  # no welcome came: the HELLO was lost
            link.send_heartbeat(beat, time.monotonic())
        assert link.on_hello_ack(forgotten, get_logger()) and hellos_sent() == 1
    finally:
        link.close()
        scheduler.close(linger=0)
        context.term()


def test_a_scheduler_that_welcomes_the_worker_again_sets_its_heartbeat_interval(tmp_path):
    """A restarted scheduler may ask for another interval than the first did: the worker kept
    the first's, and a scheduler whose timeout is shorter than that took it for dead, again
    and again, each time with every request it held. An odd interval is not taken."""
    context = zmq.Context()
    link = SchedulerLink(context, f"ipc://{tmp_path}/scheduler", hello(),
                         Security(None, get_logger()))  # fmt: skip
    try:
        link.heartbeat_interval_s = 20.0  # the first scheduler's
        link.send_heartbeat(beat(), time.monotonic())
        assert link.on_hello_ack(ack(0.5, accepted=False, error=wire.UNKNOWN_PEER), get_logger())
        link.on_hello_ack(ack(0.25), get_logger())  # welcomed by the new one
        assert link.heartbeat_interval_s == 0.25
        assert link.seconds_to_heartbeat(time.monotonic()) <= 0.25
        link.on_hello_ack(ack(math.nan), get_logger())
        assert link.heartbeat_interval_s == 0.25
    finally:
        link.close()
        context.term()


def beat() -> wire.Heartbeat:
    return wire.Heartbeat(peer_id="d", num_waiting=0, num_running=0, num_free_blocks=1,
                          num_total_blocks=1, steps_completed=0, sent_at=0.0)  # fmt: skip


def test_a_scheduler_away_for_minutes_does_not_stop_the_worker(tmp_path):
    """Heartbeats to a scheduler that went away queue in the link; past the socket's bound
    (1,000: some eight minutes of heartbeats) a send that waited stopped the worker's loop for
    good: no steps, no tokens to its gateways, no stop on SIGTERM. They are dropped instead."""
    context = zmq.Context()
    address = f"ipc://{tmp_path}/scheduler"
    scheduler = context.socket(zmq.ROUTER)
    scheduler.bind(address)
    link = SchedulerLink(context, address, hello(), Security(None, None))
    assert link.send(hello()) and scheduler.poll(5000)
    scheduler.close(linger=0)  # crashed, or being restarted
    beat = wire.Heartbeat(peer_id="d", num_waiting=0, num_running=0, num_free_blocks=8,
                          num_total_blocks=8, steps_completed=0, sent_at=0.0)  # fmt: skip
    beating = threading.Thread(
        target=lambda: [link.send_heartbeat(beat, time.monotonic()) for _ in range(1500)],
        daemon=True,
    )
    beating.start()
    beating.join(10)
    try:
        assert not beating.is_alive(), "the link's send waited for a scheduler that is gone"
        assert link.num_dropped > 0
    finally:
        link.close()
        context.term()
