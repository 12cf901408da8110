"""The gateway's cluster link against odd messages from its cluster: wire-valid frames whose
values no scheduler or worker should send (ids of other requests, positions past the output,
counts past int64, NaN and infinite delays, unknown finish reasons), played by the test on a
real ROUTER socket and a real PUSH to the stream. The link must go on: its readers alive, no
chore ended by an exception, and a request submitted afterwards served as usual."""

from __future__ import annotations

import asyncio
import math
import random

import pytest
import zmq
import zmq.asyncio

from services.gateway.app import error_response
from services.gateway.cluster import MAX_RETRY_AFTER_S, ClusterClient, refusal
from services.gateway.generation import _refusal_error
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit

ODD_INTS = [0, 1, -1, 2**31, -(2**63), 2**63 - 1, 2**64 - 1, 10**12]
ODD_FLOATS = [0.0, -0.0, -1.0, 1e-300, 1e300, math.inf, -math.inf, math.nan]
FINISH_REASONS = [None, "stop", "length", "lost", "preempted", "abort", "timeout", "error", "?"]
# The attempts the link may know of: two requests, each resumed up to three times.
ATTEMPT_IDS = ["a", "b", "a~1", "b~1", "a~2", "b~2", "a~3", "b~3", "unknown", ""]


class OddCluster:
    """Random messages a gateway may receive, with odd values often enough to matter."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def int_(self) -> int:
        return self.rng.choice(ODD_INTS) if self.rng.random() < 0.3 else self.rng.randrange(8)

    def float_(self) -> float:
        return self.rng.choice(ODD_FLOATS) if self.rng.random() < 0.5 else 3 * self.rng.random()

    def request_id(self) -> str:
        return self.rng.choice(ATTEMPT_IDS)

    def delta(self) -> wire.TokenDelta:
        rng, n = self.rng, self.rng.randrange(4)
        return wire.TokenDelta(
            request_id=self.request_id(),
            token_ids=[self.int_() for _ in range(n)],
            logprobs=rng.choice([None, [self.float_() for _ in range(rng.choice([n, n + 1]))]]),
            top_logprobs=rng.choice([None, [[(self.int_(), self.float_())] for _ in range(n)]]),
            finish_reason=rng.choice(FINISH_REASONS),
            error=rng.choice([None, None, "odd"]),
            num_cached_tokens=rng.choice([None, self.int_()]),
            index=rng.choice([None, self.int_()]),
        )

    def message(self) -> wire.Message:
        rng = self.rng
        match rng.randrange(5):
            case 0:
                return wire.Tokens(deltas=[self.delta() for _ in range(rng.randrange(1, 4))])
            case 1:
                finish = rng.choice(FINISH_REASONS[1:])
                return wire.StreamEnded(
                    request_id=self.request_id(), finish_reason=finish, output_length=self.int_()
                )
            case 2:
                return wire.SubmitReply(
                    request_id=self.request_id(),
                    accepted=rng.random() < 0.5,
                    status_code=rng.choice([200, 400, 429, 503, 0, -1, 10**9]),
                    message=rng.choice([None, "odd"]),
                    retry_after_s=rng.choice([None, self.float_()]),
                )
            case 3:
                return wire.ClusterStatus(
                    num_prefill=self.int_(),
                    num_decode=self.int_(),
                    num_queued=self.int_(),
                    num_in_flight=self.int_(),
                    max_queue_wait_s=self.float_(),
                    scheduler_epoch=rng.choice(["", "e1", "e2"]),
                )
            case _:
                return wire.HelloAck(
                    schema_version=self.int_(),
                    accepted=rng.random() < 0.5,
                    error=None,
                    heartbeat_interval_s=self.float_(),
                )


def failed_tasks(client: ClusterClient) -> list[BaseException]:
    tasks = [*client._tasks, *client._chores]
    return [t.exception() for t in tasks if t.done() and not t.cancelled() and t.exception()]


async def submitted(client: ClusterClient, scheduler: FakeScheduler, request_id: str):
    task = asyncio.create_task(client.submit(submit(request_id)))
    await scheduler.expect(wire.Submit)
    await scheduler.reply(request_id)
    return await task


async def odd_session(tmp_path, seed: int, num_messages: int = 120) -> None:
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    stream = f"ipc://{tmp_path}/stream"
    client = ClusterClient(f"ipc://{tmp_path}/scheduler", stream, stream, "g", "m",
                           GatewayEvents(get_logger()), stream_end_grace_s=0.01)  # fmt: skip
    worker = context.socket(zmq.PUSH)
    worker.setsockopt(zmq.LINGER, 0)
    try:
        await client.start()
        await scheduler.expect(wire.Hello)
        for request_id in ("a", "b"):
            await submitted(client, scheduler, request_id)
        worker.connect(stream)
        odd = OddCluster(seed)
        for step in range(num_messages):
            message = odd.message()
            if isinstance(message, wire.Tokens) and odd.rng.random() < 0.5:
                await wire.async_send(worker, message)  # the stream socket, as a worker would
            else:
                await scheduler.send(message)
            await asyncio.sleep(0.02 if odd.rng.random() < 0.1 else 0)
            assert not failed_tasks(client), f"seed {seed}, message {step}: {message!r}"
        await asyncio.sleep(0.05)
        assert not failed_tasks(client), f"seed {seed}, after the messages"
        # The link still serves: a request submitted now gets its tokens and its end.
        queue = await asyncio.wait_for(submitted(client, scheduler, "c"), 5)
        await scheduler.send(delta("c", [5, 6]))
        await scheduler.send(delta("c", [7], finish="length"))
        got = [await asyncio.wait_for(queue.get(), 5) for _ in range(2)]
        assert [d.token_ids for d in got] == [[5, 6], [7]] and got[-1].finish_reason == "length"
    finally:
        worker.close(linger=0)
        await client.close()
        scheduler.socket.close(linger=0)
        context.term()


@pytest.mark.parametrize("seed", range(6))
def test_odd_cluster_messages_leave_the_link_serving(tmp_path, seed):
    asyncio.run(odd_session(tmp_path, seed))


def reply(status: int, retry_after_s: float | None, accepted: bool = False) -> wire.SubmitReply:
    return wire.SubmitReply(request_id="r", accepted=accepted, status_code=status,
                            message="busy", retry_after_s=retry_after_s)  # fmt: skip


@pytest.mark.parametrize("retry_after_s", [math.nan, math.inf, -math.inf, -1.0, 1e300])
def test_a_refusal_with_an_odd_delay_is_answered_without_one(retry_after_s):
    refused = refusal(reply(503, retry_after_s))
    assert (refused.status_code, refused.retry_after_s) == (503, None)
    response = error_response(_refusal_error(refused))
    assert response.status_code == 503 and "retry-after" not in response.headers


def test_a_refusal_keeps_a_sound_delay_and_status():
    refused = refusal(reply(429, 2.4))
    assert (refused.status_code, refused.retry_after_s, refused.message) == (429, 2.4, "busy")
    assert error_response(_refusal_error(refused)).headers["retry-after"] == "2"
    assert refusal(reply(503, MAX_RETRY_AFTER_S)).retry_after_s == MAX_RETRY_AFTER_S


@pytest.mark.parametrize("status", [0, -1, 200, 302, 10**9])
def test_a_refusal_whose_status_is_no_http_error_is_a_bad_gateway(status):
    refused = refusal(reply(status, None))
    assert refused.status_code == 502
    assert f"status {status}" in refused.message and "busy" in refused.message
    assert error_response(_refusal_error(refused)).status_code == 502
