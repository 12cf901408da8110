"""Tool calling in the API layer: tools and tool_choice checked, rendered into the prompt (the
documented fallback format), forced calls constrained. Parsing calls out of the output:
tests/unit/test_tool_output.py."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_protocol import ApiError, parse_chat_request, parse_completion_request
from services.gateway.tool_output import extract_tool_calls
from shared.engine.constraint import to_grammar

MODEL = "smollm2"
MAX_LEN = 2048
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # parameterless
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Weather in Paris?"}]}


def chat(**fields):
    return parse_chat_request({**CHAT, **fields}, MODEL, MAX_LEN)


def refused(param: str, match: str, parse=parse_chat_request, **fields) -> None:
    base = CHAT if parse is parse_chat_request else {"model": MODEL, "prompt": "x"}
    with pytest.raises(ApiError) as info:
        parse({**base, **fields}, MODEL, MAX_LEN)
    assert info.value.status == 400 and info.value.param == param, info.value.message
    assert match in info.value.message


def test_tools_go_into_the_system_turn():
    request = chat(tools=[WEATHER, NOW])
    assert request.tools.choice == "auto"
    system = request.messages[0]
    assert system["role"] == "system" and "get_weather" in system["content"]
    assert "<tool_call>" in system["content"]
    assert request.sampling_params(10, MAX_LEN).constraint is None  # the model decides


def test_forced_calls_are_constrained_to_the_tools_schemas():
    named = chat(
        tools=[WEATHER, NOW], tool_choice={"type": "function", "function": {"name": "now"}}
    )
    schema = json.loads(named.sampling_params(10, MAX_LEN).constraint.spec)
    assert schema["properties"]["name"] == {"const": "now"}
    assert schema["properties"]["arguments"] == {"$ref": "#/$defs/now"}
    assert schema["$defs"]["now"]["additionalProperties"] is False  # exactly {}
    required = chat(tools=[WEATHER, NOW], tool_choice="required")
    constraint = required.sampling_params(10, MAX_LEN).constraint
    assert len(json.loads(constraint.spec)["anyOf"]) == 2
    to_grammar(constraint)  # xgrammar takes it


@pytest.mark.parametrize("name", ["none", "auto", "required"])
def test_a_tool_named_like_a_mode_is_forced_when_named(name):
    """A named choice was kept as the bare name: a tool called "none" or "auto", named in
    `tool_choice`, was taken for that mode (no constraint, no call parsed)."""
    tool = {"type": "function", "function": {**WEATHER["function"], "name": name}}
    request = chat(tools=[tool, NOW], tool_choice={"type": "function", "function": {"name": name}})
    assert request.tools.forced and request.tools.may_call(name)
    assert not request.tools.may_call("now")
    schema = json.loads(request.sampling_params(10, MAX_LEN).constraint.spec)
    assert schema["properties"]["name"] == {"const": name}
    call = json.dumps({"name": name, "arguments": {"city": "Oslo"}})
    content, calls = extract_tool_calls(request.tools, call)
    assert content is None and calls[0]["function"]["name"] == name
    assert chat(tools=[tool, NOW], tool_choice=name).tools.choice == name  # the mode, as a string


def test_history_with_calls_and_results_is_rendered():
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
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
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    request = chat(messages=messages, tools=[WEATHER])
    assert request.messages[2] == {
        "role": "assistant",
        "content": '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>',
    }
    assert request.messages[3] == {"role": "tool", "content": "sunny"}


@pytest.mark.parametrize(
    ("fields", "param", "match"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice", "unknown tool 'x'"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "must be"),
        ({"tool_choice": "required"}, "tool_choice", "`tools` is empty"),
        ({"tools": [{"type": "function"}]}, "tools[0]", "must be"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]},
         "tools[0].function.name", "letters"),
        # `$` matched before a final newline: the name went into the call schema with it
        ({"tools": [{"type": "function", "function": {"name": "f\n"}}]},
         "tools[0].function.name", "letters"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]},
         "tools[0].function.strict", "boolean"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"not": {}}}}],
          "tool_choice": "required"}, "tools[0].function.parameters", "`not`"),
        ({"tools": [{"type": "function", "function": {"name": "f", "returns": 1}}]},
         "tools[0].function.returns", "unknown"),
        ({"tools": [WEATHER], "tool_choice": "required",
          "structured_outputs": {"json_object": True}}, "tool_choice", "cannot be combined"),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or"),
        ({"parallel_tool_calls": 0}, "parallel_tool_calls", "true or false"),
        ({"tools": [WEATHER, {"type": "function",
                     "function": {"name": "f", "parameters": {"type": "string"}}}],
          "tool_choice": {"type": "function", "function": {"name": "f"}}},
         "tools[1].function.parameters", '"type": "object"'),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": "objekt"}}}}}],
          "tool_choice": "required"}, "tools[0].function.parameters", "invalid json_schema"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}],
          "tool_choice": "required"}, "tools[0].function.parameters", "invalid json_schema"),
        ({"tools": [{"type": "function", "function": {"name": f"f{i}", "parameters": {
            "type": "object", "properties": {
                f"p{j}": {"type": "string", "description": "x" * 80} for j in range(30)}}}}
            for i in range(40)], "tool_choice": "required"}, "tools", "name one tool"),
    ],
)  # fmt: skip
def test_bad_tool_fields_are_refused(fields, param, match):
    refused(param, match, **fields)


def test_completions_refuse_tools():
    refused("tools", "not supported", parse=parse_completion_request, tools=[WEATHER])


PYDANTIC_STYLE = {  # what `Model.model_json_schema()` gives: its sub-models under `$defs`
    "type": "function",
    "function": {
        "name": "book",
        "parameters": {
            "type": "object",
            "properties": {"where": {"$ref": "#/$defs/Place"}, "when": {"type": "string"}},
            "required": ["where", "when"],
            "$defs": {
                "Place": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "near": {"anyOf": [{"$ref": "#/$defs/Place"}, {"type": "null"}]},
                    },
                    "required": ["city", "near"],
                }
            },
        },
    },
}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "book"}}])
def test_a_forced_call_keeps_the_tools_own_refs(choice):
    from xgrammar.testing import _is_grammar_accept_string as accepts

    request = chat(tools=[PYDANTIC_STYLE, NOW], tool_choice=choice)
    grammar = to_grammar(request.sampling_params(10, MAX_LEN).constraint)
    call = {"name": "book", "arguments": {"where": {"city": "Oslo", "near": {"city": "Bergen",
            "near": None}}, "when": "noon"}}  # fmt: skip
    assert accepts(grammar, json.dumps(call))
    call["arguments"]["where"]["near"] = {"town": "Bergen"}
    assert not accepts(grammar, json.dumps(call))


AGENT_TOOL = {  # as MCP servers describe theirs: formats, and patterns beside length bounds
    "type": "function",
    "function": {
        "name": "fetch",
        "parameters": {
            "type": "object",
            "properties": {
                "url": {"type": "string", "format": "uri"},
                "slug": {"type": "string", "pattern": "^[a-z-]+$", "maxLength": 64},
            },
            "required": ["url"],
        },
    },
}


@pytest.mark.parametrize(
    "choice", ["auto", "none", {"type": "function", "function": {"name": "now"}}]
)
def test_tools_only_shown_to_the_model_may_use_any_schema(choice):
    """Under `auto` or `none`, or when another tool is forced, a tool's parameters only go into
    the prompt: keywords the engine cannot enforce were refused all the same (an agent's whole
    request a 400 for one tool's `format`)."""
    request = chat(tools=[AGENT_TOOL, NOW], tool_choice=choice)
    assert request.tools.functions[0]["name"] == "fetch"


def test_a_forced_tool_still_needs_an_enforceable_schema():
    refused("tools[0].function.parameters.properties.url", "`format`", tools=[AGENT_TOOL, NOW],
            tool_choice="required")  # fmt: skip


def _history_call(arguments) -> list[dict]:
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": arguments}}  # fmt: skip
    return [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


@pytest.mark.parametrize(
    "arguments",
    ["[1]", "5", '"Paris"', "null", [1], "true", "{", "[" * 100_000 + "]" * 100_000],
)  # (the last nests past Python's recursion limit: a RecursionError, a 500)
def test_history_call_arguments_must_be_a_json_object(arguments):
    """A call's arguments are a JSON object (OpenAI's, and what chat templates iterate with
    `.items()`): a list, a number or a string parsed fine as JSON and was accepted, to be
    rendered as a call no model writes (or to break the template with a 500)."""
    refused("messages[1].tool_calls[0].function.arguments", "JSON object",
            messages=_history_call(arguments), tools=[WEATHER])  # fmt: skip


@pytest.mark.parametrize("arguments", ['{"city": "Paris"}', {"city": "Paris"}])
def test_history_call_arguments_as_json_text_or_an_object(arguments):
    request = chat(messages=_history_call(arguments), tools=[WEATHER])
    call = request.template_messages[1]["tool_calls"][0]
    assert call["function"]["arguments"] == {"city": "Paris"}


def test_history_call_arguments_left_out_or_null_are_empty():
    for function in ({"name": "now"}, {"name": "now", "arguments": None}):
        messages = _history_call("{}")
        messages[1]["tool_calls"][0]["function"] = function
        call = chat(messages=messages, tools=[NOW]).template_messages[1]["tool_calls"][0]
        assert call["function"]["arguments"] == {}


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "run"}}])
def test_a_forced_call_to_a_free_form_tool_may_pass_any_object(choice):
    """A tool whose parameters are a bare `{"type": "object"}` takes any arguments; behind the
    call schema's `$ref` xgrammar closed it, and every forced call was `run({})`."""
    from xgrammar.testing import _is_grammar_accept_string as accepts

    free_form = {"type": "function", "function": {"name": "run", "parameters": {"type": "object"}}}
    request = chat(tools=[free_form], tool_choice=choice)
    grammar = to_grammar(request.sampling_params(10, MAX_LEN).constraint)
    assert accepts(grammar, '{"name": "run", "arguments": {"cmd": "ls", "args": ["-l"]}}')
    assert accepts(grammar, '{"name": "run", "arguments": {}}')


def test_the_fallback_prompt_writes_text_as_it_is_not_as_escapes():
    """The tools' signatures and the history's calls went into the prompt as ASCII JSON: a
    tool described in Chinese reached the model as `\\u5929\\u6c14` (as chat templates' `tojson`
    does not write it, nor the model its calls)."""
    weather = json.loads(json.dumps(WEATHER))
    weather["function"]["description"] = "查询城市天气"
    messages = _history_call('{"city": "Zürich"}')
    request = chat(messages=messages, tools=[weather])
    assert "查询城市天气" in request.messages[0]["content"]
    assert '"city": "Zürich"' in request.messages[2]["content"]


@pytest.mark.parametrize("arguments", ['{"city": "\\ud800"}', '{"\\udc00": 1}'])
def test_history_call_arguments_with_a_lone_surrogate_are_refused(arguments):
    """Arguments are JSON text inside the body's JSON: a `\\ud800` escaped there passed the
    body's check for lone surrogates, and the chat template's text then failed to tokenize (a
    500). It is no character, refused as it is anywhere else in the body."""
    refused("messages[1].tool_calls[0].function.arguments", "lone UTF-16 surrogate",
            messages=_history_call(arguments), tools=[WEATHER])  # fmt: skip


# -- a response format beside tools the model may call ----------------------------------------

ANSWER = {
    "type": "json_schema",
    "json_schema": {
        "name": "answer",
        "schema": {
            "type": "object",
            "properties": {"temperature": {"type": "integer"}},
            "required": ["temperature"],
            "additionalProperties": False,
        },
    },
}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
NOW_CALL = '{"name": "now", "arguments": {}}'


def accepts(constraint, text: str) -> bool:
    from xgrammar.testing import _is_grammar_accept_string

    return _is_grammar_accept_string(to_grammar(constraint), text)


def test_auto_tools_beside_a_response_format_may_answer_or_call():
    """The response format's grammar held every output, so with `auto` tools no call could be
    written (an agent with a typed final answer never had a tool called)."""
    constraint = chat(tools=[WEATHER, NOW], response_format=ANSWER).sampling_params(10, MAX_LEN)
    constraint = constraint.constraint
    assert accepts(constraint, '{"temperature": 21}')  # the answer
    assert accepts(constraint, f"<tool_call>\n{PARIS}\n</tool_call>")  # a call
    assert accepts(constraint, f"<tool_call>{PARIS}</tool_call>\n<tool_call>{NOW_CALL}</tool_call>")
    for wrong in (
        '{"temperature": "warm"}',  # the answer's schema holds
        "It is sunny.",  # neither
        '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>',  # no such tool
        '<tool_call>{"name": "get_weather", "arguments": {"town": "Paris"}}</tool_call>',
        f'{{"temperature": 21}}<tool_call>{PARIS}</tool_call>',  # not both
    ):
        assert not accepts(constraint, wrong), wrong
    # ...and the calls are read back as calls, the answer as content
    request = chat(tools=[WEATHER, NOW], response_format=ANSWER)
    content, calls = extract_tool_calls(request.tools, f"<tool_call>{PARIS}</tool_call>")
    assert content is None and calls[0]["function"]["name"] == "get_weather"


def test_parallel_tool_calls_false_allows_one_call_beside_a_response_format():
    request = chat(tools=[WEATHER, NOW], response_format=ANSWER, parallel_tool_calls=False)
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, f"<tool_call>{PARIS}</tool_call>")
    assert not accepts(
        constraint, f"<tool_call>{PARIS}</tool_call><tool_call>{NOW_CALL}</tool_call>"
    )


@pytest.mark.parametrize(
    ("tool_format", "call"),
    [
        ("mistral", f"[TOOL_CALLS][{PARIS}, {NOW_CALL}]"),
        (
            "llama3_json",
            '{"name": "get_weather", "parameters": {"city": "Paris"}}; '
            + NOW_CALL.replace("arguments", "parameters"),
        ),
    ],
)
def test_calls_beside_a_response_format_take_the_templates_format(tool_format, call):
    request = chat(tools=[WEATHER, NOW], response_format=ANSWER)
    constraint = request.sampling_params(10, MAX_LEN, tool_format=tool_format).constraint
    assert accepts(constraint, call) and accepts(constraint, '{"temperature": 21}')
    assert not accepts(constraint, f"<tool_call>{PARIS}</tool_call>")


@pytest.mark.parametrize("choice", ["none", None])
def test_no_calls_or_no_tools_leave_the_response_format_alone(choice):
    tools = {"tool_choice": choice, "tools": [WEATHER]} if choice else {}
    constraint = chat(response_format=ANSWER, **tools).sampling_params(10, MAX_LEN).constraint
    assert constraint.kind == "json_schema"


def test_a_shown_tool_the_engine_cannot_enforce_is_called_with_any_object():
    """Tools only shown may use any schema (`format`, ...): beside a response format such a
    tool's arguments are any JSON object, not a refusal of the request."""
    email = {
        "type": "function",
        "function": {
            "name": "mail",
            "parameters": {"type": "object", "properties": {"to": {"format": "email"}}},
        },
    }
    request = chat(tools=[email, WEATHER], response_format=ANSWER)
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, '<tool_call>{"name": "mail", "arguments": {"x": [1]}}</tool_call>')
    assert not accepts(
        constraint, '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>'
    )


def test_a_response_format_and_tools_past_the_spec_bound_are_refused():
    """Each tool's parameters fit a spec, the two tools beside the answer do not."""

    def tool(name: str) -> dict:
        described = {"type": "string", "description": "x" * 200}
        properties = {f"p{i}": described for i in range(150)}
        parameters = {"type": "object", "properties": properties}
        return {"type": "function", "function": {"name": name, "parameters": parameters}}

    request = chat(tools=[tool("a"), tool("b")], response_format=ANSWER)
    with pytest.raises(ApiError) as info:
        request.sampling_params(10, MAX_LEN)
    assert info.value.status == 400 and info.value.param == "tools"
    assert "together" in info.value.message


def test_a_forced_call_beside_a_response_format_is_the_call():
    """An agent forcing a call keeps its final answer's format set (the OpenAI Agents SDK
    sends both): that was a 400; the call's schema holds, as the format shapes answers only."""
    request = chat(tools=[WEATHER, NOW], tool_choice="required", response_format=ANSWER)
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, PARIS) and not accepts(constraint, '{"temperature": 21}')
    refused(
        "tool_choice",
        "structured_outputs",
        tools=[WEATHER],
        tool_choice="required",
        structured_outputs={"regex": "[0-9]+"},
    )


def test_structured_outputs_beside_auto_tools_shape_the_whole_output():
    """vLLM's `structured_outputs` constrains the output itself (a call spelled out by a regex
    included): it is not widened to calls as a `response_format` is."""
    request = chat(tools=[WEATHER], structured_outputs={"regex": "[0-9]{2}"})
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert constraint.kind == "regex"


# -- a call's arguments are an object, whatever the tool's parameters leave out ---------------


def _tool(parameters) -> dict:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


NOT_OBJECTS = ("5", '"x"', "[1]", "null")


@pytest.mark.parametrize(
    "parameters",
    [{"description": "No arguments."}, {"title": "Args", "required": []}],
)
def test_a_forced_call_to_a_tool_whose_parameters_name_no_type_passes_an_object(parameters):
    """Parameters without a `type` are an object's (the call only parses with one), but xgrammar
    read them as any value: a forced call could be `{"name": "f", "arguments": 5}`, which came
    back as content with no call."""
    request = chat(tools=[_tool(parameters)], tool_choice="required")
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, '{"name": "f", "arguments": {}}')
    for arguments in NOT_OBJECTS:
        assert not accepts(constraint, f'{{"name": "f", "arguments": {arguments}}}'), arguments
    # ...and beside a response format, the same for a call the model chooses
    request = chat(tools=[_tool(parameters)], response_format=ANSWER)
    constraint = request.sampling_params(10, MAX_LEN).constraint
    for arguments in NOT_OBJECTS:
        call = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
        assert not accepts(constraint, call), arguments


NOT_AN_OBJECT = [
    {"anyOf": [{"type": "object"}, {"type": "string"}]},
    {"$ref": "#/$defs/Name", "$defs": {"Name": {"type": "string"}}},
    {"enum": [{"a": 1}, 2]},
    {"const": 5},
]


@pytest.mark.parametrize("parameters", NOT_AN_OBJECT)
def test_a_forced_tool_whose_parameters_allow_other_values_is_refused(parameters):
    refused("tools[0].function.parameters", "must describe an object",
            tools=[_tool(parameters)], tool_choice="required")  # fmt: skip


@pytest.mark.parametrize("parameters", NOT_AN_OBJECT)
def test_a_shown_tool_whose_parameters_allow_other_values_is_called_with_an_object(parameters):
    request = chat(tools=[_tool(parameters)], response_format=ANSWER)
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, '<tool_call>{"name": "f", "arguments": {"k": 1}}</tool_call>')
    for arguments in NOT_OBJECTS:
        call = f'<tool_call>{{"name": "f", "arguments": {arguments}}}</tool_call>'
        assert not accepts(constraint, call), arguments


def test_a_forced_tool_whose_parameters_are_a_ref_to_an_object_is_called():
    """A recursive pydantic model's schema is a `$ref` to its `$defs`: an object all the same."""
    node = {"type": "object", "properties": {"children": {"type": "array",
            "items": {"$ref": "#/$defs/Node"}}}, "required": ["children"]}  # fmt: skip
    request = chat(tools=[_tool({"$ref": "#/$defs/Node", "$defs": {"Node": node}})],
                   tool_choice="required")  # fmt: skip
    constraint = request.sampling_params(10, MAX_LEN).constraint
    assert accepts(constraint, '{"name": "f", "arguments": {"children": [{"children": []}]}}')
