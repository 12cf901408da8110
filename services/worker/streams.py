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
            for message in _messages(deltas):
                try:
                    self._sockets[address].send_multipart(wire.encode(message), flags=zmq.NOBLOCK)
                except zmq.Again:
                    self.log.warning("gateway stream full; tokens dropped", gateway=address)
                    break

    def close_idle(self) -> list[str]:
        return self._sockets.close_idle()

    def close(self) -> None:
        self._sockets.close()


def _messages(deltas: list[wire.TokenDelta]) -> list[wire.Tokens]:
    """One gateway's deltas as Tokens messages. A delta carrying its prompt's logprobs (up to
    megabytes: a header's bound, which the worker that computed them checked alone) goes in a
    message of its own: two together could be past the bound, and the encode raised in the
    worker's step. The rest go MAX_LIST_LEN to a message (a worker may run more sequences)."""
    scored = [delta for delta in deltas if delta.prompt_logprobs is not None]
    plain = [delta for delta in deltas if delta.prompt_logprobs is None]
    messages = [wire.Tokens(deltas=[delta]) for delta in scored]
    for start in range(0, len(plain), wire.MAX_LIST_LEN):
        messages.append(wire.Tokens(deltas=plain[start : start + wire.MAX_LIST_LEN]))
    return messages


def group_by_gateway(
    items: list[tuple[str, wire.TokenDelta]],
) -> dict[str, list[wire.TokenDelta]]:
    grouped: dict[str, list[wire.TokenDelta]] = defaultdict(list)
    for address, delta in items:
        grouped[address].append(delta)
    return grouped
