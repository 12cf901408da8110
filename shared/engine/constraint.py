"""A request's output constraint (structured outputs): what the output must match, checked at once.

A `Constraint` is a kind and its text: a JSON schema, a regex, a JSON list of choices, an EBNF
grammar (xgrammar's dialect, GBNF-like), or nothing for `json_object` (any JSON object). It is
plain data, so it travels in `SamplingParams` and on the wire unchanged; `shared.engine.grammar`
compiles it against the tokenizer where tokens are sampled.

`check_constraint` refuses, before any work, what the grammar engine could not honour: a spec
past the size cap, text that does not parse, and JSON schema keywords that xgrammar would ignore
(it would then emit output that violates the schema while calling it valid). Each refusal is an
`InvalidRequestError` naming the field, so the HTTP API answers 400 with that name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from shared.errors import InvalidRequestError

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 64 << 10  # a schema, regex or grammar; bounds compile time and cache entries
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32
# Whitespace between JSON tokens, per run: unbounded, a small model loops on newlines until
# max_tokens (seen on SmolLM2); 16 fits any indentation it uses.
MAX_JSON_WHITESPACE = 16
# Keywords the grammar engine enforces (or that change nothing: annotations). Any other keyword
# in a schema is refused by name rather than silently ignored.
_ENFORCED_KEYWORDS = frozenset(
    {
        "type",
        "properties",
        "required",
        "additionalProperties",
        "items",
        "prefixItems",
        "enum",
        "const",
        "anyOf",
        "$ref",
        "$defs",
        "definitions",
        "minItems",
        "maxItems",
        "minLength",
        "maxLength",
        "pattern",
        "minimum",
        "maximum",
        "exclusiveMinimum",
        "exclusiveMaximum",
    }
)
_ANNOTATIONS = frozenset(
    {"title", "description", "default", "examples", "$schema", "$id", "$comment", "strict"}
)
# Keywords whose value is a map of names to schemas, not a schema itself.
_SCHEMA_MAPS = frozenset({"properties", "$defs", "definitions"})
_SCHEMA_LISTS = frozenset({"anyOf", "prefixItems"})


@dataclass(frozen=True, slots=True)
class Constraint:
    """What a request's output must match. `spec` is "" for json_object, JSON text for
    json_schema and choice (a list of strings), the pattern for regex, EBNF for grammar."""

    kind: str
    spec: str = ""
    param: str = "structured_outputs"  # the API field it came from, named in errors

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidRequestError(self.param, f"unknown constraint kind {self.kind!r}")
        if not isinstance(self.spec, str) or len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidRequestError(
                self.param, f"must be at most {MAX_SPEC_CHARS} characters of text"
            )

    def __eq__(self, other: object) -> bool:  # `param` names a field; it is not the constraint
        return isinstance(other, Constraint) and (self.kind, self.spec) == (other.kind, other.spec)

    def __hash__(self) -> int:
        return hash((self.kind, self.spec))


def choice_constraint(choices: Any, param: str) -> Constraint:
    if (
        not isinstance(choices, list)
        or not 1 <= len(choices) <= MAX_CHOICES
        or not all(isinstance(c, str) and c for c in choices)
    ):
        raise InvalidRequestError(param, f"must be a list of 1 to {MAX_CHOICES} non-empty strings")
    return Constraint("choice", json.dumps(choices), param)


def schema_constraint(schema: Any, param: str) -> Constraint:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise InvalidRequestError(param, f"is not valid JSON: {error}") from None
    if not isinstance(schema, dict | bool):
        raise InvalidRequestError(param, "a JSON schema must be an object")
    check_schema_keywords(schema, param)
    # Key order kept: properties are generated in the order the schema gives them.
    return Constraint("json_schema", json.dumps(schema), param)


def check_schema_keywords(schema: Any, where: str, depth: int = 0) -> None:
    """Refuses keywords the engine cannot enforce, naming the first one and where it is."""
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequestError(where, f"the schema nests deeper than {MAX_SCHEMA_DEPTH}")
    if isinstance(schema, bool):
        return
    if not isinstance(schema, dict):
        raise InvalidRequestError(where, "every subschema must be an object or a boolean")
    for key, value in schema.items():
        if key in _ANNOTATIONS:
            continue
        if key not in _ENFORCED_KEYWORDS:
            raise InvalidRequestError(
                where, f"the JSON schema keyword `{key}` cannot be enforced by this server"
            )
        if key in _SCHEMA_MAPS:
            if not isinstance(value, dict):
                raise InvalidRequestError(f"{where}.{key}", "must be an object")
            for name, sub in value.items():
                check_schema_keywords(sub, f"{where}.{key}.{name}", depth + 1)
        elif key in _SCHEMA_LISTS:
            if not isinstance(value, list):
                raise InvalidRequestError(f"{where}.{key}", "must be a list of schemas")
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{where}.{key}[{i}]", depth + 1)
        elif key in ("items", "additionalProperties"):
            check_schema_keywords(value, f"{where}.{key}", depth + 1)
    _check_combination(schema, where)


# xgrammar reads the first of these a subschema has and ignores every other keyword beside it
# (`type` beside `const` or `enum` changes nothing their values do not already fix).
_EXCLUSIVE = (("$ref", frozenset()), ("const", {"type"}), ("enum", {"type"}), ("anyOf", set()))
_CONTAINERS = frozenset({"$defs", "definitions"})


def _check_combination(schema: dict[str, Any], where: str) -> None:
    """Refuses keywords that are each enforced, but not beside one another: the output would
    meet one and break the other while the request called it valid."""
    keywords = [k for k in schema if k not in _ANNOTATIONS and k not in _CONTAINERS]
    for first, beside in _EXCLUSIVE:
        if first in schema:
            ignored = [k for k in keywords if k != first and k not in beside]
            if ignored:
                raise InvalidRequestError(
                    where,
                    f"`{first}` beside `{ignored[0]}` cannot be enforced: only the `{first}`"
                    f" would be (move `{ignored[0]}` into what the `{first}` names)",
                )
            break
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        raise InvalidRequestError(
            where,
            "`pattern` beside `minLength`/`maxLength` cannot be enforced: bound the"
            " length in the pattern",
        )
    required, properties = schema.get("required"), schema.get("properties") or {}
    closed = schema.get("additionalProperties", False) is False  # strict: false by default
    if isinstance(required, list) and isinstance(properties, dict) and closed:
        missing = [name for name in required if name not in properties]
        if missing:
            raise InvalidRequestError(
                f"{where}.required",
                f"names {missing[0]!r}, which `properties` does not list: no output could have it",
            )


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` to be placed at the JSON pointer `base` of a larger document: its local
    `$ref`s (`#`, `#/...`), which point into `schema` itself, point there still. Only schema
    positions are walked (an `enum` or `const` value holding a "$ref" key is data)."""
    if not isinstance(schema, dict):
        return schema
    rebased: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            rebased[key] = base + value[1:]
        elif key in _SCHEMA_MAPS and isinstance(value, dict):
            rebased[key] = {name: rebase_refs(sub, base) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            rebased[key] = [rebase_refs(sub, base) for sub in value]
        elif key in ("items", "additionalProperties"):
            rebased[key] = rebase_refs(value, base)
        else:
            rebased[key] = value
    return rebased


def to_grammar(constraint: Constraint) -> Any:
    """The constraint as an xgrammar `Grammar` (no tokenizer needed): parses it, so a syntax
    error surfaces here as an InvalidRequestError naming the field."""
    import xgrammar as xgr  # here: the API layer validates without loading it at import

    try:
        match constraint.kind:
            case "json_object":
                # Any JSON object: the schema {"type": "object"} (the builtin grammar would
                # allow any JSON value, which json_object does not).
                return xgr.Grammar.from_json_schema(
                    '{"type": "object"}', strict_mode=False, max_whitespace_cnt=MAX_JSON_WHITESPACE
                )
            case "json_schema":
                return _escaped_bounded_strings(
                    xgr.Grammar.from_json_schema(
                        constraint.spec, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                    )
                )
            case "regex":
                return xgr.Grammar.from_regex(constraint.spec)
            case "choice":
                choices = json.loads(constraint.spec)
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            case _:
                return xgr.Grammar.from_ebnf(constraint.spec)
    except (RuntimeError, ValueError) as error:
        message = str(error).split("] ", 1)[-1].strip()  # drop xgrammar's timestamp and path
        raise InvalidRequestError(
            constraint.param, f"invalid {constraint.kind}: {message}"
        ) from None


# The character class xgrammar 0.2.8-0.2.9 writes for a string with `minLength` or `maxLength`
# (a rule `x_characters` repeated `{2, 4}`, or inline for bounds of one): anything but a quote,
# a backslash, CR and LF. So a tab or a NUL went out raw: invalid JSON. It becomes the plain
# string's class, which leaves out every control character. (Escapes stay out of bounded
# strings, as xgrammar has them: letting "\\" and an escape alternate with the class made
# every mask fill inside such a string 100-1,000 times slower, 22 ms a token at maxLength 64
# and 140 ms at 200 against 0.1-0.3, and a step waits on its masks.)
_BOUNDED_CHARACTER = r"[^\"\\\r\n]"
_JSON_CHARACTER = r"[^\0-\x1f\"\\]"


def _escaped_bounded_strings(grammar: Any) -> Any:
    """The grammar with its length-bounded strings' characters kept to JSON's (see above)."""
    import xgrammar as xgr

    text = str(grammar)
    if _BOUNDED_CHARACTER not in text or "basic_escape ::=" not in text:
        return grammar
    return xgr.Grammar.from_ebnf(text.replace(_BOUNDED_CHARACTER, _JSON_CHARACTER))
