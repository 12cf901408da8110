"""Token streams from a worker to gateways: one PUSH socket per gateway address, one message per
step per gateway. A gateway that is gone must not stall the engine, so sends never block: past the
high-water mark a message is dropped and logged (the gateway is dead or hopelessly behind)."""

from __future__ import annotations

from collections import defaultdict

import zmq

from shared import wire
from shared.curve import Security
from shared.logs import get_logger


class GatewayStreams:
    def __init__(self, context: zmq.Context, security: Security):
        self.context = context
        self.security = security
        self._sockets: dict[str, zmq.Socket] = {}
        self.log = get_logger()

    def check(self, address: str) -> str | None:
        """Why tokens cannot be streamed to `address`, or None; connects to it the first time.
        A worker asks before it takes a request on (`wire.connect_refusal`)."""
        if address in self._sockets:
            return None
        sock = self.security.client(self.context.socket(zmq.PUSH))
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        refusal = wire.connect_refusal(sock, address)
        if refusal is None:
            self._sockets[address] = sock
        return None if refusal is None else f"the gateway {refusal}"

    def send(self, deltas_by_address: dict[str, list[wire.TokenDelta]]) -> None:
        for address, deltas in deltas_by_address.items():
            refusal = self.check(address)
            if refusal is not None:  # an address never checked: a refusal's last words
                self.log.warning("gateway stream unusable; tokens dropped", error=refusal)
                continue
            frames = wire.encode(wire.Tokens(deltas=deltas))
            try:
                self._sockets[address].send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("gateway stream full; tokens dropped", gateway=address)

    def close(self) -> None:
        for sock in self._sockets.values():
            sock.close()


def group_by_gateway(
    items: list[tuple[str, wire.TokenDelta]],
) -> dict[str, list[wire.TokenDelta]]:
    grouped: dict[str, list[wire.TokenDelta]] = defaultdict(list)
    for address, delta in items:
        grouped[address].append(delta)
    return grouped
