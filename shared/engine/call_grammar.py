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
<a CALL_FORMATS name>, "max_calls": <1 to MAX_CALLS>}`. This module writes and reads the spec
and composes the grammar of its compiled parts; shared.engine.constraint makes the constraint
(`answer_or_calls`) and compiles the parts (`to_grammar`), so the arrow runs one way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

KIND = "answer_or_calls"
MAX_CALLS = 8  # calls in one answer


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


@dataclass(frozen=True)
class Parts:
    """A spec read: the answer's constraint (kind and spec), one call's JSON schema, the
    format and the most calls."""

    answer_kind: str
    answer_spec: str
    call_schema: str
    call_format: CallFormat
    max_calls: int


def write_spec(
    answer_kind: str, answer_spec: str, call_schema: str, format_name: str, max_calls: int
) -> str:
    answer = {"kind": answer_kind, "spec": answer_spec}
    parts = {"answer": answer, "calls": call_schema, "format": format_name}
    return json.dumps({**parts, "max_calls": max_calls})


def read_spec(text: str) -> Parts:
    """The spec's parts, checked: it comes off the wire, and anything else is a ValueError
    (never a KeyError)."""
    try:
        spec = json.loads(text)
    except (json.JSONDecodeError, RecursionError):
        spec = None
    answer = spec.get("answer") if isinstance(spec, dict) else None
    if (
        not isinstance(answer, dict)
        or answer.get("kind") == KIND
        or not isinstance(answer.get("kind"), str)
        or not isinstance(answer.get("spec", ""), str)
        or not isinstance(spec.get("calls"), str)
        or spec.get("format") not in CALL_FORMATS
        or type(spec.get("max_calls")) is not int
        or not 1 <= spec["max_calls"] <= MAX_CALLS
    ):
        raise ValueError(f"not a valid {KIND} spec")
    call_format = CALL_FORMATS[spec["format"]]
    return Parts(
        answer["kind"], answer.get("spec", ""), spec["calls"], call_format, spec["max_calls"]
    )


def compose(answer: Any, call: Any, call_format: CallFormat, max_calls: int) -> Any:
    """The xgrammar `Grammar` of the answer's grammar, or 1 to `max_calls` of `call` written
    in the format. The call's rules are held once, repeated by reference: a copy a call (as
    `Grammar.concat` makes) multiplied the compile's time 25-40 times at eight calls."""
    import xgrammar as xgr

    block = xgr.Grammar.concat(_fragment(call_format.before), call, _fragment(call_format.after))
    fragments = (call_format.opening, call_format.between, call_format.closing)
    # The union names each part's root rule apart from every other rule; its own root, which
    # lists them, is replaced by the one that repeats the block.
    parts = xgr.Grammar.union(answer, block, *map(_fragment, fragments))
    text = str(parts)
    root = _UNION_ROOT.search(text)
    names = _RULE_REFERENCE.findall(root[1]) if root else []
    if len(names) != 5:  # xgrammar writes unions otherwise: not the version pinned (a 500)
        raise AssertionError(f"cannot compose {KIND}: unexpected union {text[:200]!r}")
    answer_rule, block_rule, opening, between, closing = names
    calls = f"{opening} {block_rule} ({between} {block_rule}){{0, {max_calls - 1}}} {closing}"
    written = f"root ::= (({answer_rule}) | ({calls}))"
    return xgr.Grammar.from_ebnf(text[: root.start()] + written + text[root.end() :])


_UNION_ROOT = re.compile(r"^root ::= (.*)$", re.MULTILINE)
_RULE_REFERENCE = re.compile(r"\((\w+)\)")


def _fragment(ebnf: str) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(f"root ::= {ebnf or chr(34) * 2}")
