"""The gateway's time limits, with the real tokenizer and a scheduler played by the test: no
first token in time, or no end in time, is a 504 naming the setting, and the request is
cancelled in the cluster."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from services.gateway.cluster import ClusterClient, ClusterView, SubmitRefused
from services.gateway.generation import Generator, Timeouts
from services.gateway.openai_protocol import ApiError, parse_completion_request
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta, submit


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2")[0])


async def run(
    tmp_path, tokenizer, timeouts: Timeouts, tokens_sent: int
) -> tuple[list, list, wire.Submit]:
    context = zmq.asyncio.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/scheduler")
    telemetry = GatewayEvents(get_logger())
    cluster = ClusterClient(f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/stream",
                            f"ipc://{tmp_path}/stream", "g", "smollm2", telemetry)  # fmt: skip
    await cluster.start()
    await scheduler.expect(wire.Hello)
    generator = Generator(cluster, tokenizer, "smollm2", 2048, telemetry, timeouts)
    request = parse_completion_request(
        {"model": "smollm2", "prompt": "Hello", "max_tokens": 8}, "smollm2", 2048
    )
    events = generator.events(generator.prepare(request, "cmpl"), "default")
    got, errors = [], []

    async def consume() -> None:
        try:
            async for event in events:
                got.append(event)
        except ApiError as error:
            errors.append(error)

    consumer = asyncio.create_task(consume())
    submit = await scheduler.expect(wire.Submit)
    await scheduler.reply(submit.request_id)
    for token in range(tokens_sent):
        await scheduler.send(delta(submit.request_id, [100 + token]))
    cancel = await asyncio.wait_for(scheduler.expect(wire.Cancel), 10)
    await consumer
    await cluster.close()
    scheduler.socket.close(linger=0)
    context.term()
    assert cancel.request_id == submit.request_id  # the cluster stops working on it
    return got, errors, submit


def test_no_first_token_in_time_is_a_504(tmp_path, tokenizer):
    got, (error,), _ = asyncio.run(run(tmp_path, tokenizer, Timeouts(first_token_s=0.3), 0))
    assert not got and error.status == 504 and "first_token_timeout_s" in error.message


def test_the_submit_tells_the_scheduler_what_is_left_of_the_first_token_time(tmp_path, tokenizer):
    # What the scheduler's wait forecast weighs: the first-token limit, less the time taken
    # at the gateway (tokenizing), and never past the whole request's limit.
    timeouts = Timeouts(first_token_s=0.3, request_s=0.2)
    *_, submit = asyncio.run(run(tmp_path, tokenizer, timeouts, 0))
    assert 0.1 < submit.first_token_deadline_s <= 0.2
    *_, submit = asyncio.run(run(tmp_path, tokenizer, Timeouts(first_token_s=0.3), 0))
    assert 0.2 < submit.first_token_deadline_s <= 0.3


def test_no_end_in_time_is_a_504_after_the_tokens_so_far(tmp_path, tokenizer):
    timeouts = Timeouts(first_token_s=0.3, request_s=1.0)
    got, (error,), _ = asyncio.run(run(tmp_path, tokenizer, timeouts, 2))
    assert [e.token_ids for e in got] == [[100], [101]]
    assert error.status == 504 and "request_timeout_s" in error.message


class PlayedCluster:
    """A gateway's cluster link to a scheduler the test plays, open within `async with`."""

    view = ClusterView()  # (the gateway reads the largest decode pool from it)

    def __init__(self, tmp_path, **client_args) -> None:
        self.context = zmq.asyncio.Context()
        self.scheduler = FakeScheduler(self.context, f"ipc://{tmp_path}/scheduler")
        self.cluster = ClusterClient(f"ipc://{tmp_path}/scheduler", f"ipc://{tmp_path}/stream",
                                     f"ipc://{tmp_path}/stream", "g", "smollm2",
                                     GatewayEvents(get_logger()), **client_args)  # fmt: skip

    async def __aenter__(self) -> PlayedCluster:
        await self.cluster.start()
        await self.scheduler.expect(wire.Hello)
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.cluster.close()
        self.scheduler.socket.close(linger=0)
        self.context.term()


def test_a_submit_the_scheduler_does_not_answer_in_time_is_a_503_and_is_cancelled(tmp_path):
    """Under a flood the scheduler may queue a request and answer late: the gateway's 503 must
    not leave it to run unseen (and twice, once its client retries)."""

    async def scenario() -> tuple[SubmitRefused, wire.Cancel]:
        async with PlayedCluster(tmp_path) as played:
            with pytest.raises(SubmitRefused) as refused:
                await played.cluster.submit(submit("late"), timeout_s=0.2)
            assert (await played.scheduler.expect(wire.Submit)).request_id == "late"
            cancel = await asyncio.wait_for(played.scheduler.expect(wire.Cancel), 10)
            await played.scheduler.reply("late")  # dropped, not mistaken for another's answer
        return refused.value, cancel

    refused, cancel = asyncio.run(scenario())
    assert refused.status_code == 503 and refused.retry_after_s == 1.0
    assert cancel.request_id == "late"


def test_a_submit_whose_caller_leaves_before_the_answer_is_cancelled(tmp_path):
    """A client gone while its SUBMIT awaits the scheduler's answer: once admitted, the request
    must not run for nobody (the gateway forgets it at once, so only a CANCEL can stop it)."""

    async def scenario() -> wire.Cancel:
        async with PlayedCluster(tmp_path) as played:
            caller = asyncio.create_task(played.cluster.submit(submit("left")))
            assert (await played.scheduler.expect(wire.Submit)).request_id == "left"
            caller.cancel()
            with pytest.raises(asyncio.CancelledError):
                await caller
            cancel = await asyncio.wait_for(played.scheduler.expect(wire.Cancel), 10)
            await played.scheduler.reply("left")  # admitted after all: dropped
        return cancel

    assert asyncio.run(scenario()).request_id == "left"


def test_with_the_scheduler_unreachable_submits_are_refused_in_time_and_cancels_never_wait(
    tmp_path,
):
    """No scheduler at all: each SUBMIT refused with 503 after its timeout leaves a CANCEL
    behind, and past 1,000 messages the socket's queue is full. Submits must still be refused
    in their time, and no cancel may wait for room (it hung the handler until the scheduler
    came back)."""

    async def scenario() -> list:
        cluster = ClusterClient(f"ipc://{tmp_path}/nobody", f"ipc://{tmp_path}/stream",
                                f"ipc://{tmp_path}/stream", "g", "smollm2",
                                GatewayEvents(get_logger()), max_pending_submits=5_000)  # fmt: skip
        await cluster.start()
        try:
            submits = [cluster.submit(submit(f"r{i}"), timeout_s=0.5) for i in range(1_500)]
            return await asyncio.wait_for(asyncio.gather(*submits, return_exceptions=True), 30)
        finally:
            await cluster.close()

    answers = asyncio.run(scenario())
    assert {(type(a).__name__, getattr(a, "status_code", None)) for a in answers} == {
        ("SubmitRefused", 503)
    }


def test_past_the_pending_submits_bound_a_request_is_refused_at_once_with_429(tmp_path):
    async def scenario() -> tuple[SubmitRefused, list]:
        async with PlayedCluster(tmp_path, max_pending_submits=2) as played:
            cluster, scheduler = played.cluster, played.scheduler
            pending = [asyncio.create_task(cluster.submit(submit(f"r{i}"))) for i in range(2)]
            await asyncio.sleep(0.05)
            with pytest.raises(SubmitRefused) as refused:
                await cluster.submit(submit("r2"))
            for i in range(2):  # the two sent are answered and go on
                assert (await scheduler.expect(wire.Submit)).request_id == f"r{i}"
                await scheduler.reply(f"r{i}")
            queues = await asyncio.gather(*pending)
            later = asyncio.create_task(cluster.submit(submit("r3")))  # room again, once answered
            assert (await scheduler.expect(wire.Submit)).request_id == "r3"
            await scheduler.reply("r3")
            await later
        return refused.value, queues

    refused, queues = asyncio.run(scenario())
    assert refused.status_code == 429 and "awaiting admission" in refused.message
    assert len(queues) == 2
