"""Tool calling end to end with the official `openai` client on the real model: forced calls
(`required`, named) always parse, `auto` answers in a valid shape, and a multi-turn exchange with
a tool result goes through."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOW = {"type": "function", "function": {"name": "now", "description": "The time now"}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def ask(client, messages, **fields):
    return client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, tools=[WEATHER, NOW], **fields
    )


def test_forced_tool_calls_parse(openai_client):
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        response = ask(openai_client, QUESTION, tool_choice=choice)
        (call,) = response.choices[0].message.tool_calls
        assert response.choices[0].finish_reason == "tool_calls"
        assert call.id.startswith("call_") and call.type == "function"
        if choice != "required":
            assert call.function.name == "get_weather"
        arguments = json.loads(call.function.arguments)
        assert isinstance(arguments, dict)
    named = ask(
        openai_client, QUESTION, tool_choice={"type": "function", "function": {"name": "now"}}
    )
    (call,) = named.choices[0].message.tool_calls
    assert call.function.name == "now" and isinstance(json.loads(call.function.arguments), dict)


def test_auto_and_a_multi_turn_exchange(openai_client):
    first = ask(openai_client, QUESTION, tool_choice="auto")
    message = first.choices[0].message
    if message.tool_calls:  # the model chose to call: finish_reason says so
        assert first.choices[0].finish_reason == "tool_calls"
    else:
        assert message.content and first.choices[0].finish_reason in ("stop", "length")
    history = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "Sunny, 21 C"},
    ]
    answer = ask(openai_client, history, tool_choice="none")
    assert answer.choices[0].message.content and not answer.choices[0].message.tool_calls


def streamed_calls(client, messages, **fields) -> tuple[str, list[dict], str]:
    """(content, calls assembled from their deltas by index, finish reason) of a streamed ask."""
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=60, temperature=0, tools=[WEATHER, NOW],
        stream=True, **fields,
    )  # fmt: skip
    content, calls, finish = "", {}, None
    for chunk in stream:
        (choice,) = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


def test_streamed_tool_calls_match_the_whole_response(openai_client):
    for choice in ("required", "auto"):
        whole = ask(openai_client, QUESTION, tool_choice=choice).choices[0]
        content, calls, finish = streamed_calls(openai_client, QUESTION, tool_choice=choice)
        assert finish == whole.finish_reason
        assert content == (whole.message.content or "")
        expected = [(c.function.name, json.loads(c.function.arguments))
                    for c in whole.message.tool_calls or []]  # fmt: skip
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == expected
        assert all(c["id"].startswith("call_") for c in calls)
    _, calls, finish = streamed_calls(openai_client, QUESTION, tool_choice="required")
    assert finish == "tool_calls" and len(calls) == 1


ANSWER_FORMAT = {
    "type": "json_schema",
    "json_schema": {
        "name": "weather",
        "schema": {
            "type": "object",
            "properties": {"summary": {"type": "string", "maxLength": 40}},
            "required": ["summary"],
            "additionalProperties": False,
        },
    },
}
LESS_THAN = 44  # "<" in the default model's vocabulary: the first token of a tagged call


def test_a_response_format_beside_auto_tools_answers_or_calls(openai_client):
    """An agent asking for a typed answer and offering tools (as the OpenAI Agents SDK does):
    the response format held every output before, and no call could ever be written. Steered
    to open a tag, the model's output is a call; left alone, it is a call or the answer."""
    steered = ask(
        openai_client,
        QUESTION,
        response_format=ANSWER_FORMAT,
        logit_bias={str(LESS_THAN): 100},
        parallel_tool_calls=False,
    ).choices[0]
    assert steered.finish_reason == "tool_calls", steered.message.content
    (call,) = steered.message.tool_calls
    assert call.function.name in ("get_weather", "now")
    assert isinstance(json.loads(call.function.arguments), dict)
    free = ask(openai_client, QUESTION, response_format=ANSWER_FORMAT).choices[0]
    if free.message.tool_calls:
        assert free.finish_reason == "tool_calls"
    else:
        assert free.finish_reason == "stop"
        assert set(json.loads(free.message.content)) == {"summary"}
