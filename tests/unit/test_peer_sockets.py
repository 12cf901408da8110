"""PeerSockets: one real ZeroMQ socket per address, opened when first checked, closed once idle
(unless in use), and opened again when checked after; an address ZeroMQ refuses leaves nothing
open."""

from __future__ import annotations

import pytest
import zmq

from services.worker.peer_sockets import PeerSockets


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def peer_sockets(context, clock, poller=None, opened=None):
    def open_socket():
        sock = context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        if opened is not None:
            opened.append(sock)
        return sock

    return PeerSockets(open_socket, idle_s=10.0, poller=poller, clock=clock)


def test_one_socket_per_address_opened_at_the_first_check(context):
    opened = []
    sockets = peer_sockets(context, Clock(), opened=opened)
    assert sockets.check("tcp://127.0.0.1:5") is None
    assert sockets.check("tcp://127.0.0.1:5") is None
    assert sockets.check("tcp://127.0.0.1:6") is None
    assert len(sockets) == 2 and len(opened) == 2
    assert sockets["tcp://127.0.0.1:5"] is opened[0]
    sockets.close()
    assert len(sockets) == 0 and all(sock.closed for sock in opened)


REFUSED = ["", "zz", "tcp://*:5", "tcp://host:port", "ipc:///" + "x" * 200]


@pytest.mark.parametrize("address", REFUSED)
def test_a_refused_address_is_named_and_its_socket_closed(context, address):
    opened = []
    poller = zmq.Poller()
    sockets = peer_sockets(context, Clock(), poller, opened)
    refusal = sockets.check(address)
    assert refusal is not None and repr(address) in refusal
    assert len(sockets) == 0 and address not in sockets
    assert opened[0].closed
    assert poller.poll(0) == []  # never registered: a closed socket there would break poll


def test_idle_sockets_close_unless_in_use_and_reopen_when_checked(context):
    clock, opened, poller = Clock(), [], zmq.Poller()
    sockets = peer_sockets(context, clock, poller, opened)
    for address in ("ipc:///tmp/a", "ipc:///tmp/b", "ipc:///tmp/c"):
        sockets.check(address)
    clock.now += 6
    sockets.check("ipc:///tmp/c")  # a use: its idle time starts again
    clock.now += 5  # a and b unused for 11 s, c for 5
    assert sockets.close_idle(in_use={"ipc:///tmp/b"}) == ["ipc:///tmp/a"]
    assert opened[0].closed and not opened[1].closed
    assert "ipc:///tmp/a" not in sockets and len(sockets) == 2
    assert len(poller.sockets) == 2  # the closed one unregistered
    clock.now += 10
    assert sorted(sockets.close_idle()) == ["ipc:///tmp/b", "ipc:///tmp/c"]
    assert len(sockets) == 0 and poller.sockets == []
    assert sockets.check("ipc:///tmp/a") is None  # opened afresh
    assert len(opened) == 4 and sockets["ipc:///tmp/a"] is opened[3]
    assert sockets.close_idle() == []  # just used


def test_a_socket_closed_idle_carries_messages_again_once_reopened(context, tmp_path):
    clock = Clock()
    sockets = peer_sockets(context, clock)
    pull = context.socket(zmq.PULL)
    address = f"ipc://{tmp_path}/gateway"
    pull.bind(address)
    sockets.check(address)
    sockets[address].send(b"one")
    assert pull.poll(2000) and pull.recv() == b"one"
    clock.now += 11
    assert sockets.close_idle() == [address]
    assert sockets.check(address) is None
    sockets[address].send(b"two")
    assert pull.poll(2000) and pull.recv() == b"two"
