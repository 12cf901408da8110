"""The gateway's time limits, with the real tokenizer and a scheduler played by the test: no
first token in time, or no end in time, is a 504 naming the setting, and the request is
cancelled in the cluster."""

from __future__ import annotations

import asyncio

import pytest
import zmq.asyncio

from services.gateway.cluster import ClusterClient
from services.gateway.generation import Generator, Timeouts
from services.gateway.openai_protocol import ApiError, parse_completion_request
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.integration.test_gateway_resume import FakeScheduler, delta


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.engine.loader import resolve_model_dir

    return AutoTokenizer.from_pretrained(resolve_model_dir("smollm2")[0])


async def run(tmp_path, tokenizer, timeouts: Timeouts, tokens_sent: int) -> tuple[list, list]:
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
    return got, errors


def test_no_first_token_in_time_is_a_504(tmp_path, tokenizer):
    got, (error,) = asyncio.run(run(tmp_path, tokenizer, Timeouts(first_token_s=0.3), 0))
    assert not got and error.status == 504 and "first_token_timeout_s" in error.message


def test_no_end_in_time_is_a_504_after_the_tokens_so_far(tmp_path, tokenizer):
    timeouts = Timeouts(first_token_s=0.3, request_s=1.0)
    got, (error,) = asyncio.run(run(tmp_path, tokenizer, timeouts, 2))
    assert [e.token_ids for e in got] == [[100], [101]]
    assert error.status == 504 and "request_timeout_s" in error.message
