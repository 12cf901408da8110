"""Token streams from a worker to gateways: one PUSH socket per gateway address, one message per
step per gateway (more for a step of more requests than a message carries). A gateway that is
gone must not stall the engine, so sends never block: past the high-water mark a message is
dropped and logged (the gateway is dead or hopelessly behind)."""

from __future__ import annotations

from collections import defaultdict

import zmq

from services.worker.peer_sockets import PeerSockets
from shared import wire
from shared.curve import Security
from shared.logs import get_logger


class GatewayStreams:
    def __init__(self, context: zmq.Context, security: Security, idle_s: float):
        self.context = context
        self.security = security
        # An idle gateway socket closes with no regard for the requests naming it: nothing was
        # sent on it for `idle_s`, and the next send opens it again.
        self._sockets = PeerSockets(self._open_socket, idle_s)
        self.log = get_logger()

    def __len__(self) -> int:
        return len(self._sockets)

    def _open_socket(self) -> zmq.Socket:
        sock = self.security.client(self.context.socket(zmq.PUSH))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        return sock

    def check(self, address: str) -> str | None:
        """Why tokens cannot be streamed to `address`, or None; connects to it if not connected.
        A worker asks before it takes a request on (`wire.connect_refusal`)."""
        refusal = self._sockets.check(address)
        return None if refusal is None else f"the gateway {refusal}"

    def send(self, deltas_by_address: dict[str, list[wire.TokenDelta]]) -> None:
        for address, deltas in deltas_by_address.items():
            refusal = self.check(address)  # (reopens a socket closed idle)
            if refusal is not None:  # an address never checked: a refusal's last words
                self.log.warning("gateway stream unusable; tokens dropped", error=refusal)
                continue
            # (A message carries MAX_LIST_LEN deltas: a worker may run more sequences.)
            for start in range(0, len(deltas), wire.MAX_LIST_LEN):
                message = wire.Tokens(deltas=deltas[start : start + wire.MAX_LIST_LEN])
                try:
                    self._sockets[address].send_multipart(wire.encode(message), flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.log.warning("gateway stream full; tokens dropped", gateway=address)
                    break

    def close_idle(self) -> list[str]:
        return self._sockets.close_idle()

    def close(self) -> None:
        self._sockets.close()


def group_by_gateway(
    items: list[tuple[str, wire.TokenDelta]],
) -> dict[str, list[wire.TokenDelta]]:
    grouped: dict[str, list[wire.TokenDelta]] = defaultdict(list)
    for address, delta in items:
        grouped[address].append(delta)
    return grouped
