"""The API's structured-output fields, parsed into one engine `Constraint` or refused with a 400.

Two spellings, so that clients of either work unchanged:
- OpenAI's `response_format`: `{"type": "text"}` (nothing), `{"type": "json_object"}`, and
  `{"type": "json_schema", "json_schema": {"name", "schema", "strict", "description"}}`. The schema
  is enforced whether `strict` is true or not (a constrained decoder has no weaker mode).
- vLLM's `structured_outputs`: exactly one of `json` (a schema, object or string), `regex`,
  `choice` (a list of strings), `grammar` (EBNF, xgrammar's dialect) or `json_object: true`.

At most one of the two may ask for something. The constraint is parsed by the grammar engine
here (`to_grammar`, which needs no tokenizer), so an invalid schema, regex or grammar, any schema
keyword the engine cannot enforce, and a grammar, schema or regex that can never end, is
answered with a 400 naming the field before the request reaches the cluster; the compile
against the vocabulary happens on the workers.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from typing import Any

from services.gateway.grammar_check import check_rules_end
from shared.engine.constraint import (
    Constraint,
    choice_constraint,
    schema_constraint,
    to_grammar,
)
from shared.errors import InvalidRequestError

_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})
OPENAI_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # a function's or a response format's name
NAME_RULE = "must be 1 to 64 letters, digits, _ or -"
_STRUCTURED_KINDS = ("json", "regex", "choice", "grammar", "json_object")
_STRUCTURED_FIELDS = frozenset(_STRUCTURED_KINDS)


def parse_constraint(body: Mapping[str, Any]) -> Constraint | None:
    """The request's constraint, checked by the grammar engine; InvalidRequestError naming the
    field for anything it cannot honour."""
    from_format = _parse_response_format(body.get("response_format"))
    from_vllm = _parse_structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_vllm is not None:
        raise InvalidRequestError(
            "structured_outputs", "give `response_format` or `structured_outputs`, not both"
        )
    constraint = from_format or from_vllm
    if constraint is not None:
        check_parses(constraint)  # a syntax error is a 400 now, not a failed stream
    return constraint


@functools.lru_cache(maxsize=64)  # specs of 64 KiB at most: 4 MiB
def check_parses(constraint: Constraint) -> None:
    """Parses the constraint with the grammar engine (InvalidRequestError if it cannot), once
    per distinct constraint: this runs on the gateway's event loop, where each prompt of a
    completions batch, and each turn of an agent, brings the same schema again (a refusal is
    not remembered: it names the field of the request at hand). A grammar must also be able
    to end wherever the model may go, and so must a schema's and a regex's: xgrammar compiles
    one that cannot, and the request failed at generation (grammar_check)."""
    grammar = to_grammar(constraint)
    if constraint.kind in ("grammar", "json_schema", "regex"):
        check_rules_end(grammar, constraint)


def _fail(param: str, message: str) -> Any:
    raise InvalidRequestError(param, message)


def _parse_response_format(value: Any) -> Constraint | None:
    param = "response_format"
    if value is None:
        return None
    if not isinstance(value, dict):
        _fail(param, "must be an object with a `type`")
    kind = value.get("type")
    allowed = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
    if not isinstance(kind, str) or kind not in allowed:
        _fail(f"{param}.type", f"must be one of {sorted(allowed)}, got {kind!r}")
    for name in value:
        if name not in allowed[kind]:
            _fail(f"{param}.{name}", f"unknown field `{name}` for type {kind!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        return Constraint("json_object", "", param)
    spec = value.get("json_schema")
    where = f"{param}.json_schema"
    if not isinstance(spec, dict):
        _fail(where, "must be an object with `name` and `schema`")
    for name in spec:
        if name not in _JSON_SCHEMA_FIELDS:
            _fail(f"{where}.{name}", f"unknown field `{name}`")
    if not isinstance(spec.get("name"), str) or not OPENAI_NAME.fullmatch(spec["name"]):
        # (OpenAI's rule, as for a tool's name: "a b/c!" and 65 characters passed)
        _fail(f"{where}.name", f"is required and {NAME_RULE}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        _fail(f"{where}.strict", "must be a boolean")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        _fail(f"{where}.description", "must be a string")
    schema = spec.get("schema")
    if schema is None or schema == {}:  # OpenAI: no schema means any JSON object
        return Constraint("json_object", "", where)
    return schema_constraint(schema, f"{where}.schema")


def _parse_structured_outputs(value: Any) -> Constraint | None:
    param = "structured_outputs"
    if value is None:
        return None
    if not isinstance(value, dict):
        _fail(param, f"must be an object with one of {list(_STRUCTURED_KINDS)}")
    for name in value:
        if name not in _STRUCTURED_FIELDS:
            _fail(f"{param}.{name}", f"unknown field `{name}`")
    given = [k for k in _STRUCTURED_KINDS if value.get(k) not in (None, False)]
    if len(given) != 1:
        _fail(param, f"give exactly one of {list(_STRUCTURED_KINDS)}, got {given}")
    (kind,) = given
    where, spec = f"{param}.{kind}", value[kind]
    if kind == "json":
        return schema_constraint(spec, where)
    if kind == "choice":
        return choice_constraint(spec, where)
    if kind == "json_object":
        if spec is not True:
            _fail(where, "must be true")
        return Constraint("json_object", "", where)
    if not isinstance(spec, str) or not spec:
        _fail(where, "must be a non-empty string")
    return Constraint(kind, spec, where)
