"""The Responses API's routes (services.gateway.app) driven by the `openai` client, over a
played cluster that answers every prompt with a given text: what the client sends back is
taken, and stored conversations continue as their clients expect."""

from __future__ import annotations

import asyncio

import openai
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.cluster import ClusterView
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

    view = ClusterView()  # (the gateway reads the largest decode pool from it)
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


def clients_by_key(tokenizer, tenants: dict[str, str | None]) -> list[openai.OpenAI]:  # noqa: F811
    """One client per API key (key -> its tenant, None: a bare key) of one gateway."""
    from services.gateway.auth import ApiKeys

    generator = Generator(TextCluster(tokenizer, "Hello."), tokenizer, MODEL, 8192,
                          GatewayEvents(get_logger()))  # fmt: skip
    http = TestClient(build_app(generator, 1 << 20, ApiKeys(tenants), responses=ResponseStore()))
    return [
        openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http)
        for key in tenants
    ]


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


def test_a_responses_input_items_are_listed_and_paged_as_the_client_reads_them(tokenizer):  # noqa: F811
    cluster = TextCluster(tokenizer, "Hello.")
    client = client_of(cluster, tokenizer, ResponseStore())
    first = client.responses.create(model=MODEL, input="Hi")
    given = [{"role": "user", "content": f"m{n}"} for n in range(5)]
    second = client.responses.create(model=MODEL, input=given, previous_response_id=first.id)
    page = client.responses.input_items.list(second.id, limit=3)
    assert [item.content[0].text for item in page.data] == ["m4", "m3", "m2"]
    assert page.has_more and page.first_id == page.data[0].id and page.last_id == page.data[2].id
    pages = client.responses.input_items.list(second.id, order="asc", limit=2)
    texts = [item.content[0].text for item in pages]  # (the client fetches page after page)
    assert texts == ["Hi", "Hello.", "m0", "m1", "m2", "m3", "m4"]  # (its conversation's)
    rest = client.responses.input_items.list(second.id, after=page.data[1].id, limit=100)
    assert [item.content[0].text for item in rest.data] == ["m2", "m1", "m0", "Hello.", "Hi"]
    assert not rest.has_more
    only = client.responses.input_items.list(first.id)
    assert only.data[0].type == "message" and only.data[0].role == "user"


@pytest.mark.parametrize(
    ("query", "param"),
    [({"limit": 0}, "limit"), ({"limit": 101}, "limit"), ({"order": "up"}, "order"),
     ({"after": "msg_none"}, "after")],
)  # fmt: skip
def test_a_bad_input_items_query_is_a_400(tokenizer, query, param):  # noqa: F811
    client = client_of(TextCluster(tokenizer, "Hello."), tokenizer, ResponseStore())
    response = client.responses.create(model=MODEL, input="Hi")
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(response.id, **query)
    assert info.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.input_items.list(response.id, extra_query={"limit": "x"})
    assert info.value.body["param"] == "limit"


def test_input_items_not_stored_or_anothers_are_a_404_as_the_response_is(tokenizer):  # noqa: F811
    alice, bob = clients_by_key(tokenizer, {"key-of-alice-0000": "alice",
                                            "key-of-bob-000000": "bob"})  # fmt: skip
    stored = alice.responses.create(model=MODEL, input="Hi")
    unstored = alice.responses.create(model=MODEL, input="Hi", store=False)
    for client, response_id in ((bob, stored.id), (alice, unstored.id), (alice, "resp_none")):
        with pytest.raises(openai.NotFoundError) as info:
            client.responses.retrieve(response_id)
        with pytest.raises(openai.NotFoundError) as listed:
            client.responses.input_items.list(response_id)
        assert listed.value.body == info.value.body
    assert len(alice.responses.input_items.list(stored.id).data) == 1


@pytest.mark.parametrize(
    "text",
    # (text after the call too: the stream's items are message, call, message)
    [CALL_TEXT + " Done.",
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>Done.'],
)  # fmt: skip
def test_a_streamed_answer_echoed_as_items_is_the_prompt_previous_response_id_gives(
    tokenizer,  # noqa: F811
    text,
):
    """The stream sends text written after a call as a message item after the call's: echoed
    back, they are the one assistant turn that was answered, as the stored response has it."""
    cluster = TextCluster(tokenizer, text)
    client = client_of(cluster, tokenizer, ResponseStore())
    events = list(client.responses.create(model=MODEL, input="Weather?", tools=[WEATHER],
                                          stream=True))  # fmt: skip
    first = events[-1].response
    call = next(item for item in first.output if item.type == "function_call")
    output = {"type": "function_call_output", "call_id": call.call_id, "output": "sun"}
    client.responses.create(
        model=MODEL, input=[output], previous_response_id=first.id, tools=[WEATHER]
    )
    echoed = [item.model_dump(exclude_none=True) for item in first.output]
    client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": "Weather?"}, *echoed, output],
        tools=[WEATHER],
    )
    assert tokenizer.decode(cluster.prompts[1]) == tokenizer.decode(cluster.prompts[2])


class FailingCluster(TextCluster):
    """Answers with the text's first three tokens, then the request is aborted (a worker lost
    for good, a timeout): the cluster's error ends the stream midway."""

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        self.prompts.append(list(submit.prompt_token_ids))
        queue: asyncio.Queue = asyncio.Queue()
        for token in self.token_ids[:3]:
            queue.put_nowait(delta([token]))
        queue.put_nowait(delta([], finish="abort"))
        return queue


def test_a_stream_that_fails_midway_closes_its_item_and_ends_failed(tokenizer):  # noqa: F811
    """It sent an `error` event alone: the message item it had added was never done, and no
    final event said the Response failed (a client waiting for one waited for good)."""
    store = ResponseStore()
    client = client_of(FailingCluster(tokenizer, "One two three four five."), tokenizer, store)
    events = list(client.responses.create(model=MODEL, input="Count.", stream=True))
    kinds = [event.type for event in events]
    assert kinds[-2:] == ["response.output_item.done", "response.failed"] and "error" in kinds
    added = [e.item.id for e in events if e.type == "response.output_item.added"]
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.id for e in done] == added and done[0].item.status == "incomplete"
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.message
    assert failed.output[0].content[0].text == "One two three"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(failed.id)  # (a failed Response is not kept)


def test_a_bare_keys_stored_responses_are_its_own(tokenizer):  # noqa: F811
    """Keys without a tenant all stored under one owner: any bare key read, continued and
    deleted the responses of another, given an id."""
    keys = {"bare-key-one-0000": None, "bare-key-two-0000": None, "k-tenant-0000": "t"}
    one, two, tenant = clients_by_key(tokenizer, keys)
    stored = one.responses.create(model=MODEL, input="Hi")
    for other in (two, tenant):
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(stored.id)
        with pytest.raises(openai.BadRequestError):  # (the chain is not the caller's)
            other.responses.create(model=MODEL, input="More", previous_response_id=stored.id)
        with pytest.raises(openai.NotFoundError):
            other.responses.delete(stored.id)
    assert one.responses.retrieve(stored.id).id == stored.id
    assert one.responses.create(model=MODEL, input="More", previous_response_id=stored.id).id
