"""OpenAI tool calling on chat completions: `tools` and `tool_choice` parsed, the tools rendered
into the prompt, calls constrained where they must happen, and parsed out of the output.

The fallback format (for chat templates that know no tools, as the default model's, or teach a
call format services.gateway.tool_formats does not list): the tools' signatures go into the
system turn as JSON, with the instruction to answer a call as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`; assistant `tool_calls` in the
history are rendered the same way, and `tool` messages keep their role.

- `tool_choice: "none"` (or no tools): plain chat; the tools are still shown.
- `"auto"` (the default with tools): the model decides; every well-formed call in the output
  (in the fallback's tagged format, or the format the model's template teaches) becomes a
  `tool_calls` entry, and the text around them is the content.
- `"required"` or a named function: decoding is constrained by a JSON schema to one call of the
  given tools (`name` fixed by `const`, `arguments` by the tool's `parameters`), so even a 135M
  model returns a call that parses. The output is that call's JSON, without tags.
- `parallel_tool_calls: false`: a choice has at most one call, its first; calls the model writes
  after it are dropped (neither calls nor content), as vLLM does.

A response with calls finishes with `"tool_calls"`. The calls are cut out of the output by
services.gateway.tool_output, for streamed and whole responses alike.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from services.gateway.structured_outputs import NAME_RULE, OPENAI_NAME, check_parses
from shared.engine import call_grammar
from shared.engine.constraint import (
    MAX_SPEC_CHARS,
    Constraint,
    admits_only_objects,
    answer_or_calls,
    check_schema_keywords,
    rebase_refs,
)
from shared.errors import InvalidRequestError

MAX_TOOLS = 64
_FUNCTION_FIELDS = frozenset({"name", "description", "parameters", "strict"})
# A parameterless tool's arguments: exactly {} (a bare {"type": "object"} would let the model
# invent properties until max_tokens).
_NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
_NOT_AN_OBJECT = 'must describe an object ("type": "object"): a call\'s arguments are one'
_JSON_TYPES = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}


@dataclass(frozen=True)
class NamedTool:
    """A `tool_choice` that names the function to call: kept apart from the modes, which are
    strings, since a function may be named "none", "auto" or "required" too."""

    name: str


@dataclass(frozen=True)
class ToolSetup:
    """A chat request's tools: their functions as given, and the choice."""

    functions: tuple[Mapping[str, Any], ...]
    choice: str | NamedTool  # "none", "auto", "required", or the function to call
    parallel: bool = True  # `parallel_tool_calls`: false, a choice's first call alone is kept

    @property
    def forced(self) -> bool:
        return self.choice == "required" or isinstance(self.choice, NamedTool)

    def may_call(self, name: str) -> bool:
        """Whether a forced call may be to the function `name`."""
        return self.choice in ("required", NamedTool(name))

    def constraint(self) -> Constraint | None:
        """The call schema for `required` or a named function; None when the model decides."""
        if not self.forced:
            return None
        chosen = [f for f in self.functions if self.may_call(f["name"])]
        text = _call_schema(chosen, "arguments", _parameters)
        if len(text) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                "tools",
                f"the parameters of the tools a forced call may use come to {len(text)}"
                f" characters of schema; a forced call takes at most {MAX_SPEC_CHARS}"
                " (name one tool, or shorten their schemas)",
            )
        return Constraint("json_schema", text, "tools")

    def answer_or_calls(self, answer: Constraint, format_name: str) -> Constraint:
        """With `auto`, a response format's `answer` or calls of these tools in the model's
        format (`shared.engine.call_grammar`): the response format alone would hold every
        output, and no call could be written. A tool whose parameters the engine cannot
        enforce (only shown, so any schema was taken) is called with any JSON object."""
        arguments_key = call_grammar.CALL_FORMATS[format_name].arguments_key
        calls = _call_schema(self.functions, arguments_key, _enforceable_parameters)
        max_calls = call_grammar.MAX_CALLS if self.parallel else 1
        return answer_or_calls(answer, calls, format_name, max_calls)

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools in OpenAI's request form, as chat templates that render tools take them."""
        return [{"type": "function", "function": dict(f)} for f in self.functions]

    def system_text(self) -> str:
        signatures = "\n".join(json_text(dict(f)) for f in self.functions)
        return (
            "You may call these tools (JSON signatures, one a line):\n"
            f"{signatures}\n"
            'To call one, answer <tool_call>{"name": NAME, "arguments": {...}}</tool_call>.'
        )


def json_text(value: Any) -> str:
    """`value` as JSON with its characters as they are (as chat templates' `tojson` writes it,
    and a model its calls: `"Zürich"`, not `"Z\\u00fcrich"`), but for lone surrogates, which
    are no characters (a `\\ud800` in a call's JSON) and stay escaped: text must encode."""
    text = json.dumps(value, ensure_ascii=False)
    try:
        text.encode()
    except UnicodeEncodeError:
        return json.dumps(value)
    return text


def _call_schema(
    functions: Sequence[Mapping[str, Any]],
    arguments_key: str,
    parameters: Callable[[Mapping[str, Any]], Any],
) -> str:
    """The JSON schema, as text, of one call of any of `functions`: its `name` fixed by `const`,
    its arguments under `arguments_key` by `parameters(function)`. Each tool's parameters sit
    under `$defs`, named by the tool, their own `$ref`s (a pydantic model's `#/$defs/...`)
    rebased there: they point into the parameters, not this root."""
    calls = [
        {
            "type": "object",
            "properties": {
                "name": {"const": f["name"]},
                arguments_key: {"$ref": f"#/$defs/{f['name']}"},
            },
            "required": ["name", arguments_key],
            "additionalProperties": False,
        }
        for f in functions
    ]
    schema = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema["$defs"] = {
        f["name"]: rebase_refs(parameters(f), f"#/$defs/{f['name']}") for f in functions
    }
    return json.dumps(schema)


# Keywords that fix a schema's values without a `type` (xgrammar reads them alone).
_VALUE_KEYWORDS = frozenset({"$ref", "const", "enum", "anyOf"})


def _parameters(function: Mapping[str, Any]) -> Any:
    """A tool's parameters as a call's schema holds them: a call's arguments are an object, so
    parameters that name no `type` (`{"description": ...}`) are an object's; xgrammar read them
    as any value, and a call with a number for arguments does not parse."""
    parameters = function.get("parameters") or _NO_ARGUMENTS
    if "type" not in parameters and not _VALUE_KEYWORDS & parameters.keys():
        return {"type": "object", **parameters}
    return parameters


def _enforceable_parameters(function: Mapping[str, Any]) -> Any:
    """A shown tool's parameters if the engine can enforce them, else any object."""
    parameters = _parameters(function)
    try:
        _check_enforceable(parameters, "parameters")
    except InvalidRequestError:
        return {"type": "object"}
    return parameters


def parse_tools(body: Mapping[str, Any]) -> ToolSetup | None:
    """`tools` and `tool_choice` checked; None without tools. InvalidRequestError names the
    field of any bad value, an unknown tool name in `tool_choice` included. (A tool result
    answering no call in the history is let through, as vLLM and SGLang do: agents that trim
    their histories send them, and OpenAI's 400 would fail them here only.)"""
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise InvalidRequestError("parallel_tool_calls", "must be true or false")
    if tools is None or tools == []:
        if choice not in (None, "none", "auto"):
            asks = "requires a call" if choice == "required" else "names a tool"
            raise InvalidRequestError("tool_choice", f"{asks}, but `tools` is empty")
        return None
    if not isinstance(tools, list) or len(tools) > MAX_TOOLS:
        raise InvalidRequestError("tools", f"must be a list of at most {MAX_TOOLS} tools")
    functions = tuple(_parse_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools))
    names = [f["name"] for f in functions]
    if len(set(names)) != len(names):
        raise InvalidRequestError("tools", "tool names must be distinct")
    setup = ToolSetup(functions, _parse_choice(choice, names), parallel is not False)
    for i, function in enumerate(functions):
        if setup.may_call(function["name"]):  # enforced: the engine must be able to
            _check_enforceable(_parameters(function), f"tools[{i}].function.parameters")
    return setup


def _check_enforceable(parameters: Mapping[str, Any], where: str) -> None:
    """A forced call's parameters (as `_parameters` gives them) are a grammar: of keywords the
    engine enforces, that xgrammar compiles, admitting objects alone. (With `auto` or `none`
    they are only shown to the model, so any schema will do: an agent's tools, often with
    `format` or a pattern beside a length, are not refused for it.)"""
    check_schema_keywords(parameters, where)
    if not admits_only_objects(parameters):
        raise InvalidRequestError(where, _NOT_AN_OBJECT)
    check_parses(Constraint("json_schema", json.dumps(parameters), where))


def _parse_tool(tool: Any, where: str) -> Mapping[str, Any]:
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or set(tool)
        != {
            "type",
            "function",
        }
    ):
        raise InvalidRequestError(where, 'must be {"type": "function", "function": {...}}')
    function = tool["function"]
    if not isinstance(function, dict):
        raise InvalidRequestError(f"{where}.function", "must be an object")
    for name in function:
        if name not in _FUNCTION_FIELDS:
            raise InvalidRequestError(f"{where}.function.{name}", f"unknown field `{name}`")
    if not isinstance(function.get("name"), str) or not OPENAI_NAME.fullmatch(function["name"]):
        raise InvalidRequestError(f"{where}.function.name", NAME_RULE)
    if function.get("description") is not None and not isinstance(function["description"], str):
        raise InvalidRequestError(f"{where}.function.description", "must be a string")
    if function.get("strict") is not None and not isinstance(function["strict"], bool):
        raise InvalidRequestError(f"{where}.function.strict", "must be a boolean")
    parameters = function.get("parameters")
    if parameters is not None and not isinstance(parameters, dict):
        raise InvalidRequestError(f"{where}.function.parameters", "must be a JSON schema")
    if parameters is not None and _names_no_object(parameters):
        # (Even a tool only shown: the model, writing to its schema, could never call it.)
        raise InvalidRequestError(f"{where}.function.parameters", _NOT_AN_OBJECT)
    return function


def _names_no_object(parameters: Mapping[str, Any]) -> bool:
    """Whether the parameters' `type` rules an object out (`"string"`, `["array", "null"]`)."""
    kind = parameters.get("type")
    return kind is not None and "object" not in (kind if isinstance(kind, list) else [kind])


def _parse_choice(choice: Any, names: list[str]) -> str | NamedTool:
    if choice is None:
        return "auto"
    if choice in ("none", "auto", "required"):
        return choice
    named = isinstance(choice, dict) and choice.get("type") == "function"
    function = choice.get("function") if named else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise InvalidRequestError(
            "tool_choice",
            'must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
        )
    if function["name"] not in names:
        raise InvalidRequestError(
            "tool_choice", f"names the unknown tool {function['name']!r}; tools: {names}"
        )
    return NamedTool(function["name"])


def parse_history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls` checked, in the form chat templates take:
    [{"type": "function", "function": {"name", "arguments": <parsed JSON>}, "id"}]."""
    if not isinstance(calls, list):
        raise InvalidRequestError(where, "must be a list of tool calls")
    parsed_calls = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequestError(f"{where}[{i}]", "must have `function.name`")
        arguments = _history_arguments(function.get("arguments"), f"{where}[{i}].function")
        named = {"name": function["name"], "arguments": arguments}
        # Required, as OpenAI's: the tool messages answer it by it (some templates show it too;
        # Mistral's require it).
        if not isinstance(call.get("id"), str) or not call["id"]:
            raise InvalidRequestError(f"{where}[{i}].id", "must be the call's id, a string")
        parsed_calls.append({"type": "function", "function": named, "id": call["id"]})
    return parsed_calls


def _history_arguments(arguments: Any, where: str) -> dict[str, Any]:
    """A history call's arguments: OpenAI's JSON text of an object (an object itself is taken
    too; left out or null: none). Anything but an object is refused: chat templates iterate
    the arguments as a mapping, and no model is taught to write a list or a number there."""
    if arguments is None:
        return {}
    try:
        parsed = json.loads(arguments) if isinstance(arguments, str) else arguments
    except (json.JSONDecodeError, RecursionError):  # (RecursionError: nested too deep)
        raise InvalidRequestError(f"{where}.arguments", "must be a JSON object: not JSON") from None
    if not isinstance(parsed, dict):
        got = _JSON_TYPES.get(type(parsed), "a number")  # (not the value: it may be long)
        raise InvalidRequestError(f"{where}.arguments", f"must be a JSON object, got {got}")
    try:  # JSON text in the body's JSON: its escapes escaped the body's check for these
        json.dumps(parsed, ensure_ascii=False).encode()
    except UnicodeEncodeError as error:
        code = ord(error.object[error.start])
        raise InvalidRequestError(
            f"{where}.arguments", f"a lone UTF-16 surrogate (\\u{code:04x}) is no character"
        ) from None
    return parsed


def tagged_calls(calls: list[dict[str, Any]]) -> str:
    """Parsed history calls as the tagged text the model would have written."""
    texts = []
    for call in calls:
        function = call["function"]
        call_json = json_text({"name": function["name"], "arguments": function["arguments"]})
        texts.append(f"<tool_call>{call_json}</tool_call>")
    return "\n".join(texts)


def fallback_messages(
    messages: list[dict[str, Any]], tools: ToolSetup | None
) -> list[dict[str, str]]:
    """The conversation in the fallback format, for templates that know no tools: history
    calls as tagged text after the assistant's content, and the tools' signatures at the end of
    the system turn (one is added if there is none)."""
    plain = []
    for message in messages:
        content = message["content"]
        if message.get("tool_calls"):
            calls = tagged_calls(message["tool_calls"])
            content = f"{content}\n{calls}" if content else calls
        plain.append({"role": message["role"], "content": content})
    if tools is None:
        return plain
    if plain[0]["role"] == "system":
        first = {"role": "system", "content": f"{plain[0]['content']}\n\n{tools.system_text()}"}
        return [first, *plain[1:]]
    return [{"role": "system", "content": tools.system_text()}, *plain]
