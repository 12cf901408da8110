"""The Responses API's translation to chat and back (services.gateway.responses_api); end to end
with the `openai` client in tests/e2e/test_responses_api.py."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_protocol import ApiError, parse_chat_request
from services.gateway.responses_api import (
    ResponseEvents,
    ResponseKeeper,
    chat_body,
    response_object,
    sse,
)

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    "strict": True,
}


def test_a_conversation_with_calls_and_their_outputs_becomes_chat():
    body = {
        "model": MODEL,
        "instructions": "Be brief.",
        "input": [
            {"role": "user", "content": "Weather in Paris and Rome?"},
            {
                "type": "function_call",
                "call_id": "c1",
                "name": "get_weather",
                "arguments": '{"city": "Paris"}',
            },
            {
                "type": "function_call",
                "call_id": "c2",
                "name": "get_weather",
                "arguments": '{"city": "Rome"}',
            },
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "rain"}],
            },
            {
                "type": "message",
                "role": "developer",
                "content": [{"type": "input_text", "text": "Answer."}],
            },
        ],
        "tools": [WEATHER],
        "tool_choice": {"type": "function", "name": "get_weather"},
        "max_output_tokens": 50,
        "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "object"}}},
        "store": True,
        "metadata": {"k": "v"},
    }
    chat = chat_body(body)
    system, user, calls, out1, out2, developer = chat["messages"]
    assert system == {"role": "system", "content": "Be brief."}
    assert [c["id"] for c in calls["tool_calls"]] == ["c1", "c2"]  # parallel calls: one message
    assert out2 == {
        "role": "tool",
        "tool_call_id": "c2",
        "content": [{"type": "text", "text": "rain"}],
    }
    assert developer == {"role": "developer", "content": [{"type": "text", "text": "Answer."}]}
    assert chat["tools"][0]["function"]["name"] == "get_weather"
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert chat["max_completion_tokens"] == 50
    assert chat["response_format"]["json_schema"]["schema"] == {"type": "object"}
    request = parse_chat_request(chat, MODEL, 2048)  # the chat API takes what it makes
    assert request.tools.forced and request.max_tokens == 50
    assert request.messages[-1] == {"role": "system", "content": "Answer."}


def test_a_string_input_is_a_user_message_and_a_stream_asks_for_usage():
    chat = chat_body({"model": MODEL, "input": "Hi", "stream": True})
    assert chat["messages"] == [{"role": "user", "content": "Hi"}]
    assert chat["stream_options"] == {"include_usage": True}


@pytest.mark.parametrize(
    ("body", "param", "match"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "no responses"),
        # (Responses are kept: the others' refusal said none were.)
        ({"input": "x", "conversation": "conv_1"}, "conversation", "previous_response_id"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "item references"),
        ({"input": "x", "frequency": 1}, "frequency", "unknown field"),
        ({"input": []}, "input", "non-empty"),
        ({"input": 5}, "input", "string or"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
         "input[0].content[0]", "input_image"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type", "reasoning"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]},
         "input[0].call_id", "string"),
        ({"input": [{"type": "function_call", "call_id": "", "name": "f", "arguments": "{}"}]},
         "input[0].call_id", "non-empty"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]},
         "input[0].output", "string"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type", "web_search"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "function"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format.type", "json_schema"),
        ({"input": "x", "text": "json"}, "text", "format"),
        ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "x", "background": True}, "background", "false"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning", "does not reason"),
        ({"input": "x", "instructions": 3}, "instructions", "string"),
        ([], "body", "JSON object"),
    ],
)  # fmt: skip
def test_what_is_not_served_is_a_400_naming_the_field(body, param, match):
    with pytest.raises(ApiError) as info:
        chat_body(body)
    assert info.value.status == 400 and info.value.param == param
    assert match in info.value.message


def chat_answer(content, calls=(), finish="stop"):
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = list(calls)
    usage = {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip
    return {"choices": [{"index": 0, "message": message, "finish_reason": finish}], "usage": usage}


CALL = {"id": "call_1", "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip


def test_a_chat_answer_becomes_a_response():
    body = {"model": MODEL, "input": "x", "max_output_tokens": 5}
    response = response_object(body, chat_answer("Hello", [CALL]))
    message, call = response["output"]
    assert response["object"] == "response" and response["status"] == "completed"
    assert message["content"] == [{"type": "output_text", "text": "Hello", "annotations": []}]
    assert (call["type"], call["call_id"], call["name"]) == (
        "function_call",
        "call_1",
        "get_weather",
    )
    assert response["usage"]["input_tokens_details"]["cached_tokens"] == 4
    assert response["usage"]["total_tokens"] == 10 and response["max_output_tokens"] == 5
    cut = response_object(body, chat_answer("Hel", finish="length"))
    assert cut["status"] == "incomplete"
    assert cut["incomplete_details"] == {"reason": "max_output_tokens"}
    assert cut["output"][0]["status"] == "incomplete"  # (its text cut short)


def chunk(content=None, calls=None, finish=None, usage=None):
    delta = {}
    if content is not None:
        delta["content"] = content
    if calls is not None:
        delta["tool_calls"] = [{"index": 0, **calls}]
    choices = [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish}]
    return {"choices": choices, "usage": usage}


def test_a_chat_stream_becomes_a_responses_event_stream():
    events = ResponseEvents({"model": MODEL, "input": "x"})
    stream = [*events.start()]
    for piece in (chunk("Hel"), chunk("lo"), chunk(calls=CALL), chunk(finish="tool_calls"),
                  chunk(usage=chat_answer("")["usage"])):  # fmt: skip
        stream += events.chunk(piece)
    stream += events.end()
    kinds = [e["type"] for e in stream]
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in stream] == list(range(len(stream)))
    final = stream[-1]["response"]
    assert [item["type"] for item in final["output"]] == ["message", "function_call"]
    assert final["output"][0]["content"][0]["text"] == "Hello"
    assert final["usage"]["output_tokens"] == 3
    assert stream[6]["text"] == "Hello" and stream[11]["arguments"] == '{"city": "Paris"}'
    assert sse(stream[0]).startswith(b"event: response.created\ndata: {")


def test_a_stream_cut_by_max_output_tokens_ends_incomplete():
    events = ResponseEvents({"model": MODEL, "input": "x"})
    stream = [*events.start(), *events.chunk(chunk("Hel", finish="length")), *events.end()]
    assert stream[-1]["type"] == "response.incomplete"
    assert stream[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    done = [e["item"] for e in stream if e["type"] == "response.output_item.done"]
    assert [item["status"] for item in done] == ["incomplete"]
    assert stream[-1]["response"]["output"][0]["status"] == "incomplete"
    error = events.error({"error": {"message": "boom", "code": None, "param": None}})
    assert error["type"] == "error" and error["message"] == "boom"
    assert json.loads(sse(error).split(b"data: ")[1])["sequence_number"] == len(stream)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}]},
         "input"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a",
                                             "schema": {"type": "object", "format": "email"}}}},
         "text.format.schema"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "returns": 1}]},
         "tools[0].returns"),
        ({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": 3}]},
         "tools[0].parameters"),
    ],
)  # fmt: skip
def test_a_chat_refusal_names_the_field_as_the_responses_body_has_it(fields, param):
    from services.gateway.responses_api import in_responses_terms

    with pytest.raises(ApiError) as info:
        try:
            parse_chat_request(chat_body({"model": MODEL, **fields}), MODEL, 2048)
        except ApiError as error:
            raise in_responses_terms(error) from None
    assert info.value.status == 400 and info.value.param == param, info.value.message


# -- stored responses ---------------------------------------------------------------------------


def stored_turn(store, tenant, response_id, previous, text):
    response = {"id": response_id, "output": [], "status": "completed"}
    messages = [{"role": "user", "content": text}, {"role": "assistant", "content": text.upper()}]
    assert store.put(tenant, response, previous, messages)


def test_a_conversation_is_the_chain_of_its_stored_turns():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    stored_turn(store, "t", "r1", None, "a")
    stored_turn(store, "t", "r2", "r1", "b")
    stored_turn(store, "t", "r3", "r1", "c")  # a branch from r1
    texts = [m["content"] for m in store.conversation("t", "r2")]
    assert texts == ["a", "A", "b", "B"]
    assert [m["content"] for m in store.conversation("t", "r3")] == ["a", "A", "c", "C"]
    assert store.response("t", "r2")["id"] == "r2"
    for wrong in (lambda: store.conversation("u", "r2"), lambda: store.response("u", "r2")):
        with pytest.raises(ApiError):  # another tenant's
            wrong()
    store.delete("t", "r1")
    with pytest.raises(ApiError) as info:
        store.conversation("t", "r2")  # a link of its chain is gone
    assert info.value.status == 400 and info.value.param == "previous_response_id"
    assert "r1" in info.value.message
    with pytest.raises(ApiError) as info:
        store.response("t", "r1")
    assert info.value.status == 404


def test_the_store_is_bounded_by_bytes_the_least_recently_used_leaving_first():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore(max_bytes=1000)
    for i in range(40):
        stored_turn(store, "t", f"r{i}", f"r{i - 1}" if i else None, "x" * 20)
        assert store.num_bytes <= 1000
    assert 0 < len(store) < 40
    with pytest.raises(ApiError):
        store.conversation("t", "r39")  # its chain's start left
    big = {"id": "big", "output": [], "status": "completed"}
    assert not store.put("t", big, None, [{"role": "user", "content": "y" * 2000}])
    assert not ResponseStore(max_bytes=0).put("t", big, None, [])
    with pytest.raises(ValueError):
        ResponseStore(max_bytes=-1)


def test_a_stored_answer_is_the_chat_message_it_continues_with():
    from services.gateway.responses_api import answer_messages

    response = response_object({"model": MODEL, "input": "x"}, chat_answer("Hello", [CALL]))
    assert answer_messages(response["output"]) == [
        {"role": "assistant", "content": "Hello", "tool_calls": [CALL]}
    ]
    assert answer_messages([]) == []
    chat = chat_body({"model": MODEL, "input": "next", "instructions": "Be kind."},
                     answer_messages(response["output"]))  # fmt: skip
    assert [m["role"] for m in chat["messages"]] == ["system", "assistant", "user"]


def test_the_gateways_store_size_is_checked():
    from services.gateway.service import GatewayConfig
    from shared.config import ConfigError

    assert GatewayConfig(response_store_bytes=0).response_store_bytes == 0  # none kept
    with pytest.raises(ConfigError, match="response_store_bytes"):
        GatewayConfig(response_store_bytes=-1)


# -- what clients send, and what they expect back ------------------------------------------------


@pytest.mark.parametrize("reasoning", ["high", [], 1])
def test_a_reasoning_that_is_no_object_is_a_400(reasoning):
    """It was a 500 (`"high".get`): a client's mistake must be a 400 naming the field."""
    with pytest.raises(ApiError) as info:
        chat_body({"model": MODEL, "input": "x", "reasoning": reasoning})
    assert info.value.status == 400 and info.value.param == "reasoning"


def test_a_text_setting_without_a_format_is_plain_text():
    """The OpenAI Agents SDK sends `text: {"verbosity": ...}` alone for an agent without an
    `output_type` and a verbosity set: it was a 400 asking for a format."""
    chat = chat_body({"model": MODEL, "input": "x", "text": {"verbosity": "low"}})
    assert "response_format" not in chat
    assert "response_format" not in chat_body({"model": MODEL, "input": "x", "text": {}})


@pytest.mark.parametrize(
    "fields",
    [
        {"prompt_cache_retention": "24h"},  # the Agents SDK's ModelSettings.prompt_cache_retention
        {"max_tool_calls": 3},  # built-in tools' calls: there are none here
        {"top_logprobs": None},
        {"prompt": None},
    ],
)
def test_the_apis_own_fields_at_values_asking_nothing_are_taken(fields):
    """Fields of OpenAI's Responses API were refused as unknown (`unknown field
    prompt_cache_retention`), though they ask nothing of this server at these values."""
    chat = chat_body({"model": MODEL, "input": "x", **fields})
    assert chat["messages"] == [{"role": "user", "content": "x"}]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"max_tool_calls": 0}, "max_tool_calls"),
        ({"max_tool_calls": "3"}, "max_tool_calls"),
    ],
)
def test_the_apis_own_fields_asking_what_is_not_served_are_a_400(fields, param):
    with pytest.raises(ApiError) as info:
        chat_body({"model": MODEL, "input": "x", **fields})
    assert info.value.status == 400 and info.value.param == param
    assert "unknown field" not in info.value.message


def test_an_answers_text_and_calls_echoed_back_are_one_assistant_turn():
    """An answer with text and a call is one assistant message (as the model wrote it, and as
    `previous_response_id` continues it); echoed back as its output items (the Agents SDK's
    default) it became two assistant turns: another prompt than the same conversation stored."""
    from services.gateway.responses_api import answer_messages

    response = response_object({"model": MODEL, "input": "x"}, chat_answer("Let me see.", [CALL]))
    items = json.loads(json.dumps(response["output"]))  # as the client sends them back
    items.append({"type": "function_call_output", "call_id": CALL["id"], "output": "sunny"})
    echoed = chat_body({"model": MODEL, "input": items})["messages"]
    stored = [*answer_messages(response["output"]), echoed[-1]]
    assert [m["role"] for m in echoed] == ["assistant", "tool"]
    as_chat = [parse_chat_request({"model": MODEL, "messages": messages}, MODEL, 2048).messages
               for messages in (echoed, stored)]  # fmt: skip
    assert as_chat[0] == as_chat[1]


def test_a_function_outputs_unserved_part_is_named_in_output():
    item = {"type": "function_call_output", "call_id": "c",
            "output": [{"type": "input_image", "image_url": "u"}]}  # fmt: skip
    with pytest.raises(ApiError) as info:
        chat_body({"model": MODEL, "input": [item]})
    assert info.value.param == "input[0].output[0]", info.value.param


def test_the_response_and_its_events_have_every_field_the_sdks_types_require():
    """Checked strictly against the `openai` package's types: the text events lacked
    `logprobs`, the usage `input_tokens_details.cache_write_tokens` (clients that validate, as
    typed SDKs do, refused them)."""
    from openai.types.responses import Response, ResponseStreamEvent
    from pydantic import TypeAdapter

    body = {"model": MODEL, "input": "x"}
    Response.model_validate(response_object(body, chat_answer("Hello", [CALL])))
    events = ResponseEvents(body)
    stream = [*events.start()]
    for piece in (chunk("Hel"), chunk(calls=CALL), chunk(finish="tool_calls"),
                  chunk(usage=chat_answer("")["usage"])):  # fmt: skip
        stream += events.chunk(piece)
    stream += events.end()
    adapter = TypeAdapter(ResponseStreamEvent)
    for event in stream:
        assert adapter.validate_python(event).type == event["type"]


def test_metadata_is_checked_as_openai_bounds_it():
    """Echoed into the Response and kept with it: anything was taken (a list of a million
    empty objects weighs far more in memory than its JSON)."""
    assert chat_body({"model": MODEL, "input": "x", "metadata": {"k": "v"}})
    for metadata in ("abc", {"k": 1}, {"k": "v" * 513}, {"k" * 65: "v"},
                     {f"k{i}": "v" for i in range(17)}):  # fmt: skip
        with pytest.raises(ApiError) as info:
            chat_body({"model": MODEL, "input": "x", "metadata": metadata})
        assert info.value.status == 400 and info.value.param == "metadata"


def test_the_store_holds_what_it_counts():
    """The bound is on bytes, but a response was kept as Python objects: an empty object is 3
    bytes of JSON and 64 of memory, so a tool's schema of them held ~20x what was counted."""
    import gc
    import tracemalloc

    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    tool = {**WEATHER, "parameters": {"enum": [{} for _ in range(100_000)]}}
    text = json.dumps({"model": MODEL, "input": "x", "tools": [tool]})
    tracemalloc.start()
    try:
        body = json.loads(text)  # (as the request's body: its objects are traced)
        response = response_object(body, chat_answer("Hello"))
        ResponseKeeper(store, "t", body).keep(response)
        del body, response, tool
        gc.collect()
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert held < 2 * store.num_bytes, (held, store.num_bytes)


def test_a_stored_response_reads_as_it_was_answered():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    body = {"model": MODEL, "input": "x"}
    response = response_object(body, chat_answer("Hello"))
    ResponseKeeper(store, "t", body).keep(response)
    assert response["store"] is True
    assert store.response("t", response["id"]) == response
    response["output"].clear()  # the answer's object, changed later, is not what is kept
    assert store.response("t", response["id"])["output"]


def test_a_turn_whose_chain_left_while_it_ran_can_still_be_continued():
    """A turn continuing r1 began with r1's conversation; r1 was evicted (or deleted) while it
    was generated. It was stored pointing at r1 and answered `store: true`, and the client's
    next turn was a 400: the turn now keeps the conversation it began with."""
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    stored_turn(store, "t", "r1", None, "a")
    body = {"model": MODEL, "input": "b", "previous_response_id": "r1"}
    keeper = ResponseKeeper(store, "t", body, store.conversation("t", "r1"))
    store.delete("t", "r1")  # (as the least recently used would leave)
    response = response_object(body, chat_answer("B"))
    keeper.keep(response)
    assert response["store"] is True
    texts = [m["content"] for m in store.conversation("t", response["id"])]
    assert texts == ["a", "A", "b", "B"]
    assert store.response("t", response["id"])["previous_response_id"] == "r1"  # (as asked)


def test_a_conversation_longer_than_a_request_body_may_be_is_refused_unread():
    """Each turn's input is bounded by the body limit, but a chain of them was not: a tenant's
    chain replayed the whole store (64 MiB by default, 8 times the largest body) into one
    prompt each turn, all of it tokenized before the context's bound refused it."""
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    for i in range(5):
        stored_turn(store, "t", f"r{i}", f"r{i - 1}" if i else None, "x" * 100)
    whole = store.conversation("t", "r4", max_chars=10_000)
    assert len(whole) == 10
    with pytest.raises(ApiError) as info:
        store.conversation("t", "r4", max_chars=500)
    assert info.value.status == 400 and info.value.param == "previous_response_id"
    assert "500" in info.value.message


def test_a_streamed_responses_envelope_is_the_same_from_first_event_to_last(monkeypatch):
    """`response.created` said `store: false` of a response being stored, and the last event
    a later `created_at` than the first (it was taken again at the end)."""
    from services.gateway import responses_api
    from services.gateway.response_store import ResponseStore

    clock = iter(range(1000, 2000))
    monkeypatch.setattr(responses_api.time, "time", lambda: next(clock))
    body = {"model": MODEL, "input": "x"}
    events = ResponseEvents(body, ResponseKeeper(ResponseStore(), "t", body))
    created = [*events.start()][0]["response"]
    completed = [*events.chunk(chunk("Hi", finish="stop")), *events.end()][-1]["response"]
    assert created["created_at"] == completed["created_at"]
    assert created["store"] is True and completed["store"] is True


def test_storing_a_turn_evicts_others_before_the_chain_it_continues():
    """r1's conversation was read when r2 began, but others were stored since, so r1 was the
    least recently used when r2's own storing passed the bound: r2 evicted its own chain."""
    from services.gateway.response_store import ResponseStore

    store = ResponseStore(max_bytes=700)
    stored_turn(store, "t", "r1", None, "a")
    store.conversation("t", "r1")  # (as r2 began)
    for i in range(3):  # other requests, stored while r2 ran
        stored_turn(store, "t", f"other{i}", None, "o")
    stored_turn(store, "t", "r2", "r1", "b" * 50)
    assert store.num_bytes <= 700
    assert [m["content"] for m in store.conversation("t", "r2")] == ["a", "A", "b" * 50, "B" * 50]


# -- a stored response's input items ------------------------------------------------------------


def kept(store, body, text="Hello", tenant="t"):
    """The Response of `body`, answered `text`, stored as the gateway stores it (after the
    conversation its `previous_response_id` began with)."""
    previous = body.get("previous_response_id")
    earlier = store.conversation(tenant, previous) if previous else None
    earlier_items = store.input_items(tenant, previous, answered=True) if previous else None
    response = response_object(body, chat_answer(text))
    ResponseKeeper(store, tenant, body, earlier, earlier_items).keep(response)
    return response


def test_a_responses_input_items_are_its_input_as_typed_items_with_ids():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    given = [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "output_text", "text": "Hm"}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}",
         "id": "fc_given"},
        {"type": "function_call_output", "call_id": "c1", "output": "sun"},
        {"role": "developer", "content": [{"type": "input_text", "text": "Answer."}]},
    ]  # fmt: skip
    response = kept(store, {"model": MODEL, "input": given})
    items = store.input_items("t", response["id"])
    user, assistant, call, output, developer = items
    assert user == {
        "id": user["id"],
        "type": "message",
        "role": "user",
        "content": [{"type": "input_text", "text": "Weather?"}],
        "status": "completed",
    }
    assert assistant["content"] == [{"type": "output_text", "text": "Hm", "annotations": []}]
    assert call["id"] == "fc_given" and call["status"] == "completed"
    assert output["call_id"] == "c1" and output["output"] == "sun"
    assert developer["content"] == [{"type": "input_text", "text": "Answer."}]
    assert len({item["id"] for item in items}) == 5
    assert store.input_items("t", response["id"]) == items  # the same ids each read


def test_a_continued_responses_input_items_are_its_whole_conversation():
    """As OpenAI lists them: the items used to generate the response, so the earlier turns'
    inputs and answers (their output items, as answered) before its own input."""
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    first = kept(store, {"model": MODEL, "input": "a"}, "A")
    second = kept(store, {"model": MODEL, "input": "b", "previous_response_id": first["id"]}, "B")
    items = store.input_items("t", second["id"])
    assert [(item["role"], item["content"][0]["text"]) for item in items] == [
        ("user", "a"), ("assistant", "A"), ("user", "b"),
    ]  # fmt: skip
    assert items[1] == first["output"][0]


def test_input_items_are_counted_by_the_stores_bound():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    body = {"model": MODEL, "input": "x" * 1000}
    response = kept(store, body)
    # the input counted twice: as the chat message it is continued with, and as its item
    assert store.num_bytes > 2000 + len(json.dumps(response))


def test_a_turn_whose_chain_left_while_it_ran_keeps_its_whole_input_items():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    first = kept(store, {"model": MODEL, "input": "a"}, "A")
    body = {"model": MODEL, "input": "b", "previous_response_id": first["id"]}
    keeper = ResponseKeeper(
        store,
        "t",
        body,
        store.conversation("t", first["id"]),
        store.input_items("t", first["id"], answered=True),
    )
    store.delete("t", first["id"])
    response = response_object(body, chat_answer("B"))
    keeper.keep(response)
    texts = [item["content"][0]["text"] for item in store.input_items("t", response["id"])]
    assert texts == ["a", "A", "b"]


def test_input_items_of_an_unknown_or_broken_response_are_a_404():
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    first = kept(store, {"model": MODEL, "input": "a"}, "A")
    second = kept(store, {"model": MODEL, "input": "b", "previous_response_id": first["id"]}, "B")
    for tenant, response_id in (("t", "resp_none"), ("u", second["id"])):
        with pytest.raises(ApiError) as info:
            store.input_items(tenant, response_id)
        assert info.value.status == 404 and info.value.param == "response_id"
    store.delete("t", first["id"])
    with pytest.raises(ApiError) as info:
        store.input_items("t", second["id"])  # a turn of its conversation is gone
    assert info.value.status == 404 and first["id"] in info.value.message


ITEMS = [{"id": f"i{n}", "type": "message"} for n in range(5)]


@pytest.mark.parametrize(
    ("query", "ids", "has_more"),
    [
        ({}, ["i4", "i3", "i2", "i1", "i0"], False),
        ({"order": "asc"}, ["i0", "i1", "i2", "i3", "i4"], False),
        ({"limit": "2"}, ["i4", "i3"], True),
        ({"limit": "2", "after": "i3"}, ["i2", "i1"], True),
        ({"limit": "2", "after": "i1"}, ["i0"], False),
        ({"order": "asc", "after": "i2", "limit": "100"}, ["i3", "i4"], False),
        ({"after": "i0"}, [], False),
        ({"include": "message.input_image.image_url"}, ["i4", "i3", "i2", "i1", "i0"], False),
    ],
)  # fmt: skip
def test_input_items_are_paged_as_openai_pages_them(query, ids, has_more):
    from services.gateway.responses_api import input_item_page

    page = input_item_page(ITEMS, query)
    assert page["object"] == "list" and page["has_more"] is has_more
    assert [item["id"] for item in page["data"]] == ids
    assert page["first_id"] == (ids[0] if ids else None)
    assert page["last_id"] == (ids[-1] if ids else None)


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "101"}, "limit"),
        ({"limit": "x"}, "limit"),
        ({"limit": "-1"}, "limit"),
        ({"order": "up"}, "order"),
        ({"after": "i9"}, "after"),
    ],
)
def test_a_bad_input_items_query_is_a_400_naming_it(query, param):
    from services.gateway.responses_api import input_item_page

    with pytest.raises(ApiError) as info:
        input_item_page(ITEMS, query)
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("field", ["safety_identifier", "user"])
@pytest.mark.parametrize("value", [5, "x" * 257])
def test_a_bad_safety_identifier_is_named_as_given(field, value):
    with pytest.raises(ApiError) as info:
        parse_chat_request(chat_body({"model": MODEL, "input": "x", field: value}), MODEL, 2048)
    assert info.value.status == 400 and info.value.param == field
    assert field in info.value.message


@pytest.mark.parametrize(
    ("item", "param"),
    [({"role": {"name": "user"}, "content": "x"}, "input[0].role"),
     ({"role": ["user"], "content": "x"}, "input[0].role"),
     ({"role": "user", "content": [{"type": ["input_text"], "text": "x"}]}, "input[0].content[0]"),
     ({"role": "user", "content": [{"type": {"a": 1}}]}, "input[0].content[0]"),
     ({"type": "function_call_output", "call_id": "c", "output": [{"type": {"a": 1}}]},
      "input[0].output[0]")],
)  # fmt: skip
def test_an_unhashable_role_or_part_type_is_a_400_naming_it(item, param):
    """A JSON object or list where a string belongs was a TypeError (a 500) at a set lookup."""
    with pytest.raises(ApiError) as info:
        chat_body({"model": MODEL, "input": [item]})
    assert info.value.status == 400 and info.value.param == param


@pytest.mark.parametrize("status", [{"a": 1}, ["completed"], 5])
def test_an_input_items_odd_status_does_not_fail_the_answered_turn(status):
    """An item's `status` is not read to answer: a JSON object there failed storing the turn
    once answered (a 500 after the whole generation, or a stream without its last event)."""
    from services.gateway.response_store import ResponseStore

    store = ResponseStore()
    body = {"model": MODEL, "input": [{"role": "user", "content": "x", "status": status}]}
    chat_body(body)
    response = kept(store, body)
    assert response["store"] is True
    assert store.input_items("t", response["id"])[0]["status"] == "completed"
