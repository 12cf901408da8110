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

    def _socket(self, address: str) -> zmq.Socket:
        sock = self._sockets.get(address)
        if sock is None:
            sock = self.security.client(self.context.socket(zmq.PUSH))
            sock.setsockopt(zmq.LINGER, 1000)
            sock.setsockopt(zmq.SNDHWM, 10_000)
            sock.connect(address)
            self._sockets[address] = sock
        return sock

    def check(self, address: str) -> str | None:
        """Why tokens cannot be streamed to `address` (ZeroMQ cannot connect to it: not an
        endpoint, an unknown transport), or None. A worker asks before it takes a request on:
        the address comes from the wire, and a connect that raises mid-step ended the worker."""
        try:
            self._socket(address)
        except zmq.ZMQError as error:
            return f"the gateway address {address!r} cannot be connected to: {error.strerror}"
        return None

    def send(self, deltas_by_address: dict[str, list[wire.TokenDelta]]) -> None:
        for address, deltas in deltas_by_address.items():
            frames = wire.encode(wire.Tokens(deltas=deltas))
            try:
                self._socket(address).send_multipart(frames, flags=zmq.NOBLOCK)
            except zmq.Again:
                self.log.warning("gateway stream full; tokens dropped", gateway=address)
            except zmq.ZMQError as error:  # an address never checked: a refusal's last words
                self.log.warning("gateway address unusable; tokens dropped", gateway=address,
                                 error=error.strerror)  # fmt: skip

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
