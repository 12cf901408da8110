"""The Responses API's routes (services.gateway.app) driven by the `openai` client, over a
played cluster that answers every prompt with a given text: what the client sends back is
taken, and stored conversations continue as their clients expect."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.generation import Generator
from services.gateway.response_store import ResponseStore
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import delta, tokenizer  # noqa: F401

MODEL = "m"
CALL_TEXT = (
    'Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


class TextCluster:
    """Answers every request with `text`, one token a delta; `on_submit` runs as it arrives."""

    peer_id = "g"

    def __init__(self, tokenizer, text: str, on_submit=None) -> None:  # noqa: F811
        self.token_ids = tokenizer(text, add_special_tokens=False).input_ids
        self.on_submit = on_submit
        self.prompts: list[list[int]] = []

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        self.prompts.append(list(submit.prompt_token_ids))
        if self.on_submit is not None:
            self.on_submit()
        queue: asyncio.Queue = asyncio.Queue()
        for i, token in enumerate(self.token_ids):
            last = i == len(self.token_ids) - 1
            queue.put_nowait(delta([token], finish="stop" if last else None))
        return queue

    async def cancel(self, request_id: str, reason: str) -> None:
        pass

    def finished(self, request_id: str) -> None:
        pass


def client_of(
    cluster: TextCluster,
    tokenizer,  # noqa: F811
    store: ResponseStore,
    max_body_bytes: int = 1 << 20,
) -> openai.OpenAI:
    generator = Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()))
    http = TestClient(build_app(generator, max_body_bytes, responses=store))
    return openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=http)


def test_a_conversation_echoed_as_items_is_the_prompt_previous_response_id_gives(tokenizer):  # noqa: F811
    """The Agents SDK sends the last answer's output items back (a message, then its call):
    they made two assistant turns, another prompt than the stored response continues."""
    cluster = TextCluster(tokenizer, CALL_TEXT)
    client = client_of(cluster, tokenizer, ResponseStore())
    first = client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER])
    assert [item.type for item in first.output] == ["message", "function_call"]
    output = {"type": "function_call_output", "call_id": first.output[1].call_id, "output": "sun"}
    client.responses.create(
        model=MODEL, input=[output], previous_response_id=first.id, tools=[WEATHER]
    )
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather?"}, *echoed, output],
        tools=[WEATHER],
    )
    assert cluster.prompts[1] == cluster.prompts[2]


@pytest.mark.parametrize("stream", [False, True])
def test_a_turn_whose_chain_left_while_it_ran_is_continued(tokenizer, stream):  # noqa: F811
    """The turn it continued was dropped while the request ran (as the least recently used is
    evicted): the new response was answered as stored, and its continuation was a 400."""
    store = ResponseStore()
    cluster = TextCluster(tokenizer, "Hello.")
    client = client_of(cluster, tokenizer, store)
    first = client.responses.create(model=MODEL, input="Hi")
    cluster.on_submit = lambda: store.delete("", first.id)
    second = client.responses.create(
        model=MODEL, input="Again", previous_response_id=first.id, stream=stream
    )
    if stream:
        second = [event for event in second][-1].response
    cluster.on_submit = None
    assert second.store
    client.responses.create(model=MODEL, input="More", previous_response_id=second.id)
    prompt = tokenizer.decode(cluster.prompts[-1])
    assert prompt.index("Hi") < prompt.index("Again") < prompt.index("More")


def test_a_conversation_longer_than_the_body_limit_is_refused(tokenizer):  # noqa: F811
    store = ResponseStore()
    cluster = TextCluster(tokenizer, "Hello.")
    client = client_of(cluster, tokenizer, store, max_body_bytes=4096)
    previous = None
    for _ in range(3):  # each turn well within the limit, the three past it
        answered = client.responses.create(
            model=MODEL, input="x " * 800, previous_response_id=previous
        )
        previous = answered.id
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model=MODEL, input="more", previous_response_id=previous)
    assert info.value.body["param"] == "previous_response_id"
    assert len(cluster.prompts) == 3  # refused before it was tokenized
