"""Which worker each of the scheduler's ROUTER connections belongs to, and which closed.

A worker killed (its process gone, a container stopped) closes its connection at once: the
kernel ends it. The ROUTER says nothing of that to the application, so the scheduler waited out
the heartbeat timeout (10 s) before it moved the worker's requests on, and their streams stood
still meanwhile. The socket monitor reports a closed connection by its file descriptor; each
message read off the ROUTER names the descriptor it came in on (ZMQ_SRCFD), so a worker's
heartbeat ties its descriptor to its identity, and the close to the worker.

A descriptor is a number the kernel hands out again: a worker whose connection closed may be
another's by the time the event is read, or the closed one's last heartbeat may be read after
it. Neither loses a worker: a close only marks one (`WorkerState.disconnected_at`), and its
next heartbeat clears the mark; only a worker that stays silent for the grace after it leaves
rotation, and only sooner than the heartbeat timeout would have taken it.
"""

from __future__ import annotations

import zmq
from zmq.utils.monitor import parse_monitor_message


class ConnectionWatch:
    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self.monitor: zmq.Socket | None = None  # (`start`: a service that serves)
        self._identity_by_fd: dict[int, bytes] = {}

    def start(self) -> zmq.Socket:
        """Watches the socket's connections from now; the monitor socket, to poll."""
        self.monitor = self.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        return self.monitor

    def saw(self, frame: zmq.Frame, identity: bytes) -> None:
        """A worker's message arrived in `frame`: its connection is the worker's now."""
        self._identity_by_fd[frame.get(zmq.SRCFD)] = identity

    def closed(self) -> list[bytes]:
        """The identities whose connections closed since last asked (never blocks)."""
        identities: list[bytes] = []
        while self.monitor is not None:
            try:
                frames = self.monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return identities
            event = parse_monitor_message(frames)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                identity = self._identity_by_fd.pop(event["value"], None)
                if identity is not None:
                    identities.append(identity)
        return identities

    def close(self) -> None:
        if self.monitor is not None:  # (else its context's term waits for it forever)
            self.socket.disable_monitor()
            self.monitor.close(linger=0)
            self.monitor = None
