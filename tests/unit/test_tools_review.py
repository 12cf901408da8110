"""Tool calling's refusals of input the model cannot use: a tool whose arguments could never be
an object; and what it lets through though OpenAI refuses it."""

from __future__ import annotations

import pytest

from services.gateway.openai_protocol import ApiError, parse_chat_request
from services.gateway.tool_output import extract_tool_calls
from tests.unit.test_tool_output import MODEL, WEATHER

QUESTION = {"role": "user", "content": "Weather in Paris and Oslo?"}


def chat(**fields):
    return parse_chat_request({"model": MODEL, "messages": [QUESTION], **fields}, MODEL, 2048)


def refused(param: str, match: str, **fields) -> None:
    with pytest.raises(ApiError) as info:
        chat(**fields)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert match in info.value.message


def result(call_id: str) -> dict:
    return {"role": "tool", "tool_call_id": call_id, "content": "sunny"}


def test_a_tool_result_answering_no_earlier_call_is_let_through():
    """OpenAI answers 400; vLLM and SGLang take it, and agents that trim their histories send
    it: refusing it would fail them here only."""
    request = chat(messages=[QUESTION, result("call_1")], tools=[WEATHER])
    assert request.messages[-1]["role"] == "tool"


@pytest.mark.parametrize("call_id", [None, ""])
def test_a_tool_result_must_name_the_call_it_answers(call_id):
    """Left out, it was taken and shown as no call's result (a framework's bug answered 200,
    the prompt broken). OpenAI refuses it too; one naming no earlier call is let through."""
    message = {"role": "tool", "content": "sunny"}
    if call_id is not None:
        message["tool_call_id"] = call_id
    refused("messages[1].tool_call_id", "must name the call it answers",
            messages=[QUESTION, message], tools=[WEATHER])  # fmt: skip


@pytest.mark.parametrize("call_id", [None, "", 7])
def test_a_history_call_must_have_its_id(call_id):
    """The id tool messages answer it by: a call without one was taken (OpenAI refuses it)."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    if call_id is not None:
        call["id"] = call_id
    calls = {"role": "assistant", "content": None, "tool_calls": [call]}
    refused("messages[1].tool_calls[0].id", "the call's id",
            messages=[QUESTION, calls, result("call_1")], tools=[WEATHER])  # fmt: skip


NO_OBJECTS = [{"type": "string"}, {"type": "array", "items": {}}, {"type": ["string", "null"]}]


@pytest.mark.parametrize("choice", ["auto", "none"])
@pytest.mark.parametrize("parameters", NO_OBJECTS)
def test_a_shown_tool_whose_parameters_are_no_object_is_refused(parameters, choice):
    """With `auto` (or `none`) a tool whose parameters name another type than an object was
    taken, and could never be called: a call's arguments must be an object, so what the model
    wrote to its schema (`"arguments": "Paris"`) came back as content, with no call."""
    tool = {"type": "function", "function": {"name": "search", "parameters": parameters}}
    refused("tools[1].function.parameters", '"type": "object"',
            tools=[WEATHER, tool], tool_choice=choice)  # fmt: skip


@pytest.mark.parametrize("parameters", [{"type": "object"}, {"type": ["object", "null"]}, {}])
def test_a_shown_tool_whose_parameters_may_be_an_object_is_taken(parameters):
    tool = {"type": "function", "function": {"name": "search", "parameters": parameters}}
    setup = chat(tools=[tool]).tools
    content, found = extract_tool_calls(setup, '<tool_call>{"name": "search"}</tool_call>')
    assert content is None and found[0]["function"] == {"name": "search", "arguments": "{}"}


@pytest.mark.parametrize(
    ("choice", "said"),
    [("required", "requires a call"), ({"type": "function", "function": {"name": "f"}}, "names")],
)
def test_a_tool_choice_without_tools_says_what_it_asked_for(choice, said):
    refused("tool_choice", f"{said}", tool_choice=choice)
