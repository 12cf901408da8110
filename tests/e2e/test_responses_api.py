"""OpenAI's Responses API end to end with the official `openai` client on the real model: the
same greedy answer as chat completions, streamed and whole alike, function calls and their
outputs across turns, a JSON schema output, a stored response continued by its id, and
refusals of what is not served."""

from __future__ import annotations

import json

import openai
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 20}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
QUESTION = "What is the capital of France?"


def test_a_response_is_the_chat_answer_streamed_or_whole(openai_client):
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": QUESTION},
        ],
        max_tokens=12,
        temperature=0,
    )
    fields = {"model": MODEL, "instructions": "Be brief.", "input": QUESTION,
              "max_output_tokens": 12, "temperature": 0}  # fmt: skip
    whole = openai_client.responses.create(**fields)
    assert whole.output_text == chat.choices[0].message.content
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    expected = "incomplete" if chat.choices[0].finish_reason == "length" else "completed"
    assert whole.status == expected
    deltas, final = [], None
    for event in openai_client.responses.create(**fields, stream=True):
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.status == whole.status and final.usage.output_tokens == whole.usage.output_tokens


def test_a_function_call_and_its_output_across_turns(openai_client):
    ask = {"model": MODEL, "tools": [WEATHER], "max_output_tokens": 40, "temperature": 0}
    turn = [{"role": "user", "content": "What is the weather in Paris?"}]
    first = openai_client.responses.create(**ask, input=turn, tool_choice="required")
    (call,) = [item for item in first.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments), dict)
    turn += [
        {"type": "function_call", "call_id": call.call_id, "name": call.name,
         "arguments": call.arguments},
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 24 C"},
    ]  # fmt: skip
    second = openai_client.responses.create(**ask, input=turn, tool_choice="none")
    assert second.output_text and not [i for i in second.output if i.type == "function_call"]


def test_a_json_schema_output(openai_client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
              "required": ["city"], "additionalProperties": False}  # fmt: skip
    response = openai_client.responses.create(
        model=MODEL,
        input=QUESTION,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
        max_output_tokens=30,
        temperature=0,
    )
    assert set(json.loads(response.output_text)) == {"city"}


def test_what_a_stateless_server_cannot_do_is_a_400(openai_client):
    with pytest.raises(openai.BadRequestError) as info:
        openai_client.responses.create(model=MODEL, input="x", previous_response_id="resp_1")
    assert "whole conversation" in str(info.value)
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])


def test_a_stored_response_is_continued_by_its_id(openai_client):
    """`previous_response_id` puts the stored turns before the input: the answer is the chat
    answer of the whole conversation. A response can be read back and deleted; one deleted, or
    never stored, cannot be continued."""
    ask = {"model": MODEL, "max_output_tokens": 10, "temperature": 0}
    first = openai_client.responses.create(**ask, input="My name is Ada. Say hello.")
    second = openai_client.responses.create(
        **ask, input="What is my name?", previous_response_id=first.id
    )
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "My name is Ada. Say hello."},
            {"role": "assistant", "content": first.output_text},
            {"role": "user", "content": "What is my name?"},
        ],
        max_tokens=10,
        temperature=0,
    )
    assert second.output_text == chat.choices[0].message.content
    assert second.previous_response_id == first.id and first.store
    assert openai_client.responses.retrieve(first.id).output_text == first.output_text
    openai_client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        openai_client.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(**ask, input="Again?", previous_response_id=second.id)
    unstored = openai_client.responses.create(**ask, input="Hi", store=False)
    assert not unstored.store
    with pytest.raises(openai.BadRequestError):
        openai_client.responses.create(**ask, input="Hi", previous_response_id=unstored.id)


def test_a_stored_responses_input_items_are_listed(openai_client):
    """`input_items.list` reads what the response was generated from: its conversation's items
    (the earlier turn's input and answer, then its own input), newest first, paged."""
    ask = {"model": MODEL, "max_output_tokens": 5, "temperature": 0}
    first = openai_client.responses.create(**ask, input="Say hi.")
    second = openai_client.responses.create(
        **ask,
        input=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "content": "Again."},
        ],
        previous_response_id=first.id,
    )
    page = openai_client.responses.input_items.list(second.id, limit=2)
    assert [(item.role, item.content[0].text) for item in page.data] == [
        ("user", "Again."), ("developer", "Be brief."),
    ]  # fmt: skip
    assert page.has_more and page.last_id == page.data[-1].id
    items = list(openai_client.responses.input_items.list(second.id, order="asc"))
    assert [item.type for item in items] == ["message"] * 4
    assert items[0].content[0].text == "Say hi." and items[1].id == first.output[0].id
    assert [item.id for item in items[2:]] == [item.id for item in reversed(page.data)]
