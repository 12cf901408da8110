"""An output that is either the requested answer or tool calls: the constraint of a chat request
that gives both a response format and tools the model may call (`tool_choice: "auto"`).

Without it the response format's grammar held the whole output and no call could be written: an
agent that wants a typed final answer and offers tools (the OpenAI Agents SDK sends both when an
agent has an `output_type`) never had a tool called. The kind `answer_or_calls` allows either the
answer's grammar, or one to `max_calls` calls written the way the model's chat template teaches
(`CALL_FORMATS`, the formats services.gateway.tool_formats parses), each call's JSON held by the
tools' schema (`{"name": <a tool's name>, <arguments key>: <its parameters>}`).

Its spec is JSON, so the constraint stays plain data on the wire and is compiled where tokens
are sampled: `{"answer": {"kind", "spec"}, "calls": <one call's JSON schema, as text>, "format":
<a CALL_FORMATS name>, "max_calls": <1 to MAX_CALLS>}`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.engine.constraint import MAX_SPEC_CHARS, Constraint, to_grammar
from shared.errors import InvalidRequestError

KIND = "answer_or_calls"
MAX_CALLS = 8  # calls in one answer: each is a copy of the call grammar in the compiled one


@dataclass(frozen=True)
class CallFormat:
    """How a format writes calls around their JSON, as EBNF fragments ("" for nothing)."""

    opening: str  # before the first call
    before: str  # before each call's JSON
    after: str  # after each call's JSON
    between: str  # between two calls
    closing: str  # after the last call
    arguments_key: str  # the call object's key for the arguments


_NEWLINES = r"[ \n]{0,2}"  # what models put around and between tagged blocks
CALL_FORMATS = {
    "tagged": CallFormat(
        "", f'"<tool_call>" {_NEWLINES}', f'{_NEWLINES} "</tool_call>"', _NEWLINES, "", "arguments"
    ),
    # The marker as text: where it is a special token the grammar engine cannot write it, so a
    # Mistral model calls in its list form only by spelling the marker out.
    "mistral": CallFormat('"[TOOL_CALLS]" " "? "["', "", "", '"," " "?', '"]"', "arguments"),
    "llama3_json": CallFormat("", "", "", '" "? ";" " "?', "", "parameters"),
}


def answer_or_calls(
    answer: Constraint, call_schema: str, format_name: str, max_calls: int
) -> Constraint:
    """The constraint allowing `answer`, or up to `max_calls` calls each meeting `call_schema`
    in the format named; an InvalidRequestError naming `tools` if the two do not fit a spec."""
    spec = json.dumps(
        {
            "answer": {"kind": answer.kind, "spec": answer.spec},
            "calls": call_schema,
            "format": format_name,
            "max_calls": max_calls,
        }
    )
    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(
            "tools",
            f"the response format and the tools' parameters come to {len(spec)} characters of"
            f" schema together; a request that gives both takes at most {MAX_SPEC_CHARS}",
        )
    return Constraint(KIND, spec, answer.param)


def parts(constraint: Constraint) -> tuple[Constraint, Constraint, CallFormat, int]:
    """The answer's constraint, one call's, the format and the most calls, checked (the spec
    comes off the wire: anything else is an InvalidRequestError, never a KeyError)."""
    try:
        spec = json.loads(constraint.spec)
    except (json.JSONDecodeError, RecursionError):
        spec = None
    answer = spec.get("answer") if isinstance(spec, dict) else None
    if (
        not isinstance(answer, dict)
        or answer.get("kind") == KIND
        or not isinstance(spec.get("calls"), str)
        or spec.get("format") not in CALL_FORMATS
        or type(spec.get("max_calls")) is not int
        or not 1 <= spec["max_calls"] <= MAX_CALLS
    ):
        raise InvalidRequestError(constraint.param, f"not a valid {KIND} spec")
    answer_constraint = Constraint(answer.get("kind"), answer.get("spec", ""), constraint.param)
    calls = Constraint("json_schema", spec["calls"], "tools")
    return answer_constraint, calls, CALL_FORMATS[spec["format"]], spec["max_calls"]


def grammar(constraint: Constraint) -> Any:
    """The xgrammar `Grammar`: the answer's, or the calls in their format."""
    import xgrammar as xgr

    answer, calls, call_format, max_calls = parts(constraint)
    block = xgr.Grammar.concat(
        _fragment(call_format.before), to_grammar(calls), _fragment(call_format.after)
    )
    sequence = block  # then a block before each shorter sequence: up to `max_calls` blocks
    for _ in range(max_calls - 1):
        more = xgr.Grammar.concat(_fragment(call_format.between), sequence)
        sequence = xgr.Grammar.concat(block, xgr.Grammar.union(_fragment(""), more))
    written = xgr.Grammar.concat(
        _fragment(call_format.opening), sequence, _fragment(call_format.closing)
    )
    return xgr.Grammar.union(to_grammar(answer), written)


def _fragment(ebnf: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {ebnf or chr(34) * 2}")
