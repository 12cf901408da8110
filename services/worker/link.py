"""A worker's link to the scheduler: HELLO handshake, heartbeats, messages both ways.

The DEALER socket reconnects by itself if the scheduler restarts, or its connection is cut, under
the one routing id it has for the process's life (`shared.endpoints.routing_id`): the scheduler's
messages for the worker reach it as soon as it is back, and what was sent meanwhile the scheduler
holds for it (`services/scheduler/service.py`). A scheduler that does not know
the worker (it restarted, or took the worker for dead during a long stall) answers its next
heartbeat with HelloAck(error=UNKNOWN_PEER), and the worker says HELLO again.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import zmq

from shared import wire
from shared.curve import Security
from shared.endpoints import connect, set_routing_id
from shared.errors import StartUpError
from shared.logs import get_logger

# Registering again, a HELLO still unanswered after this many heartbeats is taken for lost.
# Counted in heartbeats, not seconds: a long step delays the answers' reading, not their order.
WELCOME_WAIT_BEATS = 20
GOODBYE_LINGER_MS = 1000  # a stopping worker's last messages to the scheduler may take this
DROPPED_LOG_EVERY = 100  # a full link logs its first dropped message, then every this many

_log = get_logger()


def _sound_interval(interval: float) -> bool:
    return 0 < interval < math.inf  # (NaN would stop the heartbeats for good)


class HandshakeError(StartUpError):
    """The scheduler refused this worker, or did not answer."""


class SchedulerLink:
    def __init__(self, context: zmq.Context, address: str, hello: wire.Hello, security: Security):
        self.hello = hello
        self.socket = security.client(context.socket(zmq.DEALER))
        self.socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self.socket.setsockopt(zmq.LINGER, 0)
        set_routing_id(self.socket, hello.peer_id)  # the same across reconnects (docstring)
        connect(self.socket, address)
        self.heartbeat_interval_s = 0.5
        self._next_heartbeat = 0.0
        # Heartbeats sent since a re-registration not yet welcomed (None: none awaited).
        self._beats_awaiting_welcome: int | None = None
        self.num_dropped = 0  # messages dropped on a full queue (`send`)

    def handshake(
        self, timeout_s: float = 60.0, stopping: Callable[[], bool] = lambda: False
    ) -> bool:
        """Says HELLO until the scheduler answers (it may start after us); False when
        `stopping()` said so first (a SIGTERM must not wait out the timeout)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if stopping():
                return False
            wire.send(self.socket, self.hello)
            if self.socket.poll(1000):
                message = wire.recv(self.socket)
                if isinstance(message, wire.HelloAck):
                    if not message.accepted:
                        raise HandshakeError(f"scheduler refused this worker: {message.error}")
                    interval = message.heartbeat_interval_s
                    if not _sound_interval(interval):
                        raise HandshakeError(f"scheduler asked for a heartbeat every {interval} s")
                    self.heartbeat_interval_s = interval
                    return True
        raise HandshakeError(f"no answer from the scheduler within {timeout_s:.0f} s")

    def on_hello_ack(self, ack: wire.HelloAck, log) -> bool:
        """An answer after the handshake: the scheduler lost track of us, so register again.
        True when this said HELLO again (what the old registration awaited will not come)."""
        if ack.accepted:
            self._beats_awaiting_welcome = None  # welcomed
            self._take_interval(ack.heartbeat_interval_s, log)
            return False
        if ack.error == wire.UNKNOWN_PEER:
            # Every heartbeat sent before the HELLO is answered so (after an outage, all those
            # queued during it), and those answers come before the HELLO's own, on the one
            # connection: until it comes, they are not news. A second HELLO would make the
            # scheduler drop the worker, and what it gave it since the first.
            beats = self._beats_awaiting_welcome
            if beats is not None and beats < WELCOME_WAIT_BEATS:
                return False
            self._beats_awaiting_welcome = 0
            log.warning("scheduler does not know this worker; registering again")
            self.send(self.hello)
            return True
        log.error("scheduler refused this worker", error=ack.error)
        return False

    def _take_interval(self, interval: float, log) -> None:
        """The interval of a scheduler that welcomed the worker again: a restarted one may ask
        for another (kept to the first's, heartbeats rarer than its timeout took the worker for
        dead, again and again, each time with the requests it held)."""
        if not _sound_interval(interval):
            log.error("scheduler asked for an odd heartbeat interval; kept", interval_s=interval)
            return
        if interval != self.heartbeat_interval_s:
            self.heartbeat_interval_s = interval
            self._next_heartbeat = 0.0  # (the next at once, then at the new pace)

    def send(self, message: wire.Message) -> bool:
        """Sends without waiting; False, the message dropped, when the socket's queue is full:
        the scheduler has been away for minutes (some thousand heartbeats queued), and a send
        that waited would stop the worker's loop (its steps, its gateways' tokens, its stop on
        SIGTERM). What is dropped the scheduler learns again: each heartbeat is whole, and one
        back without the worker asks it to register again."""
        if wire.send_or_drop(self.socket, message):
            return True
        self.num_dropped += 1
        if self.num_dropped % DROPPED_LOG_EVERY == 1:
            _log.warning(
                "scheduler link full; messages dropped",
                type=type(message).__name__,
                num_dropped=self.num_dropped,
            )
        return False

    def heartbeat_due(self, now: float) -> bool:
        return now >= self._next_heartbeat

    def send_heartbeat(self, heartbeat: wire.Heartbeat, now: float) -> None:
        self.send(heartbeat)
        if self._beats_awaiting_welcome is not None:
            self._beats_awaiting_welcome += 1
        self._next_heartbeat = now + self.heartbeat_interval_s

    def seconds_to_heartbeat(self, now: float) -> float:
        return max(0.0, self._next_heartbeat - now)

    def close(self, peer_id: str | None = None) -> None:
        """With `peer_id`, says GOODBYE first (the scheduler re-routes what this worker held at
        once), and gives it and the reports still queued a moment to go out."""
        linger_ms = 0
        if peer_id is not None and wire.send_or_drop(self.socket, wire.Goodbye(peer_id=peer_id)):
            linger_ms = GOODBYE_LINGER_MS
        self.socket.close(linger=linger_ms)
