"""Sockets to the peers a worker's jobs name (gateways for token streams, decode workers for KV),
one per address: opened when a job first names the address, closed once unused for a while.

Addresses come and go with the peers: a gateway or decode worker that restarts on another host or
port is a new address, and its old socket would otherwise stay for the worker's life, retrying
its connection and holding what was queued for a peer that is gone. A worker in a long-lived
cluster would gather them until it ran out of file descriptors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection

import zmq

from shared import wire
from shared.endpoints import set_ipv6


class PeerSockets:
    def __init__(
        self,
        open_socket: Callable[[], zmq.Socket],
        idle_s: float,
        poller: zmq.Poller | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        """`open_socket` makes an unconnected socket (its options set); a `poller` polls each
        connected socket, for the replies that come back on it."""
        self._open_socket = open_socket
        self.idle_s = idle_s
        self._poller = poller
        self._clock = clock
        self._sockets: dict[str, zmq.Socket] = {}
        self._addresses: dict[zmq.Socket, str] = {}  # (the other way round)
        self._last_used: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._sockets)

    def __contains__(self, address: str) -> bool:
        return address in self._sockets

    def check(self, address: str) -> str | None:
        """Why `address` cannot be connected to, or None; opens its socket if none is open
        (`wire.connect_refusal`) and counts as a use."""
        if address not in self._sockets:
            sock = set_ipv6(self._open_socket(), address)
            refusal = wire.connect_refusal(sock, address)
            if refusal is not None:
                return refusal
            self._sockets[address] = sock
            self._addresses[sock] = address
            if self._poller is not None:
                self._poller.register(sock, zmq.POLLIN)
        self._last_used[address] = self._clock()
        return None

    def __getitem__(self, address: str) -> zmq.Socket:
        """The open socket to `address` (`check` it first: it may have been closed idle)."""
        return self._sockets[address]

    def address_of(self, sock: zmq.Socket) -> str | None:
        """The address `sock` is the open socket to; None for a socket not opened here."""
        return self._addresses.get(sock)

    def close_idle(self, in_use: Collection[str] = ()) -> list[str]:
        """Closes the sockets unused for `idle_s` whose address is not `in_use` (a reply is
        awaited on it, or a job holds it); returns their addresses."""
        cutoff = self._clock() - self.idle_s
        idle = [
            address
            for address, used in self._last_used.items()
            if used < cutoff and address not in in_use
        ]
        for address in idle:
            self._close(address)
        return idle

    def discard(self, address: str) -> None:
        """Closes the socket to `address` now, dropping what is queued in it."""
        self._close(address)

    def close(self) -> None:
        for address in list(self._sockets):
            self._close(address)

    def _close(self, address: str) -> None:
        sock = self._sockets.pop(address)
        del self._addresses[sock]
        del self._last_used[address]
        if self._poller is not None:
            self._poller.unregister(sock)
        sock.close()  # with the linger its opener set
