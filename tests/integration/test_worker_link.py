"""A worker's HELLO handshake against a scheduler played by the test on a real ROUTER socket:
the interval it is given, and a refusal, an odd interval or silence as a clear error."""

from __future__ import annotations

import math
import threading

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
