"""The grammar of a response format's answer or tool calls (shared.engine.call_grammar)."""

from __future__ import annotations

import json

import pytest
from xgrammar.testing import _is_grammar_accept_string as accepts

from shared.engine import call_grammar
from shared.engine.constraint import Constraint, to_grammar


def _tool(name: str, num_parameters: int) -> dict:
    properties = {f"p{i}": {"type": ["string", "integer"]} for i in range(num_parameters)}
    arguments = {"type": "object", "properties": properties, "additionalProperties": False}
    return {
        "type": "object",
        "properties": {"name": {"const": name}, "arguments": arguments},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


CALL = to_grammar(Constraint("json_schema", json.dumps({"anyOf": [_tool("f", 3), _tool("g", 3)]})))
ANSWER = to_grammar(Constraint("json_object"))
F = '{"name": "f", "arguments": {"p0": 1}}'
G = '{"name": "g", "arguments": {}}'


def _num_rules(grammar) -> int:
    return str(grammar).count("::=")


@pytest.mark.parametrize("format_name", list(call_grammar.CALL_FORMATS))
def test_the_call_grammar_is_not_copied_once_a_call(format_name):
    """Each of the up to eight calls held a copy of the tools' grammar: the compile (on the
    worker, before the first token) took 25-40 times one call's, 7-9 s for a dozen tools of 50
    parameters, and could run past the compile time limit for larger tool sets."""
    call_format = call_grammar.CALL_FORMATS[format_name]
    one = call_grammar.compose(ANSWER, CALL, call_format, 1)
    eight = call_grammar.compose(ANSWER, CALL, call_format, call_grammar.MAX_CALLS)
    assert _num_rules(eight) <= _num_rules(one) + 2


WRITTEN = {
    "tagged": lambda calls, sep: sep.join(f"<tool_call>\n{c}\n</tool_call>" for c in calls),
    "mistral": lambda calls, sep: "[TOOL_CALLS] [" + ("," + sep).join(calls) + "]",
    "llama3_json": lambda calls, sep: (sep + ";" + sep).join(calls),
}


@pytest.mark.parametrize("format_name", list(call_grammar.CALL_FORMATS))
@pytest.mark.parametrize("max_calls", [1, 2, call_grammar.MAX_CALLS])
def test_an_answer_or_one_to_max_calls_are_allowed(format_name, max_calls):
    grammar = call_grammar.compose(ANSWER, CALL, call_grammar.CALL_FORMATS[format_name], max_calls)
    assert accepts(grammar, '{"a": [1]}')
    assert not accepts(grammar, "")  # an answer or a call, not nothing
    for count in range(1, call_grammar.MAX_CALLS + 2):
        calls = [F, G] * count
        for sep in ("", " "):
            text = WRITTEN[format_name](calls[:count], sep)
            assert accepts(grammar, text) == (count <= max_calls), (count, sep)
    assert not accepts(grammar, WRITTEN[format_name]([F], "") + '{"a": 1}')  # not both
