"""A worker's token streams to gateways, on real sockets: what a gateway can read."""

from __future__ import annotations

import zmq

from services.worker.streams import GatewayStreams
from shared import wire
from shared.curve import Security


def test_a_step_of_more_requests_than_a_message_carries_reaches_the_gateway(tmp_path):
    """A step sent each gateway one Tokens message, a delta per request: past 4,096 requests
    (a legal max_num_seqs) the gateway could not decode it, and dropped the whole step."""
    context = zmq.Context()
    address = f"ipc://{tmp_path}/gateway"
    gateway = context.socket(zmq.PULL)
    gateway.bind(address)
    streams = GatewayStreams(context, Security(None, None), idle_s=300)
    count = 2 * wire.MAX_LIST_LEN + 1
    deltas = [wire.TokenDelta(request_id=f"r{i}", token_ids=[7], index=3) for i in range(count)]
    try:
        streams.send({address: deltas})
        received = []
        while len(received) < count and gateway.poll(5000):
            received += wire.decode(gateway.recv_multipart(copy=False)).deltas
        assert [d.request_id for d in received] == [d.request_id for d in deltas]
    finally:
        streams.close()
        gateway.close(linger=0)
        context.term()
