"""A request's output constraint (structured outputs): what the output must match, checked at once.

A `Constraint` is a kind and its text: a JSON schema, a regex, a JSON list of choices, an EBNF
grammar (xgrammar's dialect, GBNF-like), or nothing for `json_object` (any JSON object). It is
plain data, so it travels in `SamplingParams` and on the wire unchanged; `shared.engine.grammar`
compiles it against the tokenizer where tokens are sampled.

`check_constraint` refuses, before any work, what the grammar engine could not honour: a spec
past the size cap, text that does not parse, and JSON schema keywords that xgrammar would ignore
(it would then emit output that violates the schema while calling it valid). Each refusal is an
`InvalidRequestError` naming the field, so the HTTP API answers 400 with that name.

A schema's `pattern` describes the string's value, but xgrammar matches it against the string's
JSON text, writing what the pattern allows between the quotes as it is: a pattern that can match a
quote, a backslash or a control character let it write invalid JSON. So each pattern is
translated into one over the JSON text first (`json_string_pattern`: such a character becomes its
escape), and the features whose meaning the translation cannot keep are refused.
"""

from __future__ import annotations

import json
import re
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass
from re import _constants as sre  # the parsed form of a regex (Python 3.11+)
from re import _parser as sre_parser
from typing import Any

from shared.engine import call_grammar
from shared.engine.json_pattern import (
    MAX_PATTERN_SIZE,
    json_string_pattern,
    pattern_size,
    python_spelling,
)
from shared.errors import InvalidRequestError

# (`answer_or_calls`: a response format or tool calls, shared.engine.call_grammar)
KINDS = ("json_object", "json_schema", "regex", "choice", "grammar", "answer_or_calls")
MAX_SPEC_CHARS = 64 << 10  # a schema, regex or grammar; bounds compile time and cache entries
MAX_CHOICES = 256
MAX_SCHEMA_DEPTH = 32
# xgrammar's time for a schema's patterns grows with the sum of their sizes squared (see
# json_pattern's MAX_PATTERN_SIZE): at most four patterns of the largest size (0.1 s each).
MAX_PATTERNS_COST = 4 * MAX_PATTERN_SIZE**2
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
        except (json.JSONDecodeError, RecursionError) as error:  # (nested past the parser)
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
            if key == "anyOf" and not value:  # xgrammar: a grammar no output meets
                raise InvalidRequestError(f"{where}.anyOf", "must list at least one schema")
            for i, sub in enumerate(value):
                check_schema_keywords(sub, f"{where}.{key}[{i}]", depth + 1)
        elif key in ("items", "additionalProperties"):
            check_schema_keywords(value, f"{where}.{key}", depth + 1)
        elif key in _COUNTS and (not _is_int(value) or value < 0):
            # (xgrammar read `"maxLength": -1` as no bound at all)
            raise InvalidRequestError(f"{where}.{key}", "must be a non-negative integer")
        elif key == "pattern":
            if not isinstance(value, str):
                raise InvalidRequestError(f"{where}.pattern", "must be a string (a regex)")
            json_string_pattern(value, f"{where}.pattern")
    _check_combination(schema, where)
    _check_values_typed(schema, where)
    _check_typed(schema, where)
    if depth == 0:
        _check_refs_reach_a_value(schema, where)


_COUNTS = frozenset({"minLength", "maxLength", "minItems", "maxItems"})


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if required is not None and (
        not isinstance(required, list) or not all(isinstance(name, str) for name in required)
    ):
        raise InvalidRequestError(f"{where}.required", "must be a list of property names")
    # With `additionalProperties` closed no output could have such a name; open, xgrammar drops
    # the requirement.
    missing = [name for name in required or () if name not in properties]
    if missing:
        raise InvalidRequestError(
            f"{where}.required",
            f"names {missing[0]!r}, which `properties` does not list: only a listed property"
            " can be required",
        )


# Whether a value is of a JSON Schema type: an integer may be written 1.0, a boolean is not a
# number, and a number may be an integer.
_IS_OF_TYPE: dict[str, Callable[[Any], bool]] = {
    "null": lambda value: value is None,
    "boolean": lambda value: isinstance(value, bool),
    "string": lambda value: isinstance(value, str),
    "object": lambda value: isinstance(value, dict),
    "array": lambda value: isinstance(value, list),
    "number": lambda value: isinstance(value, int | float) and not isinstance(value, bool),
    "integer": lambda value: _is_int(value) or (isinstance(value, float) and value.is_integer()),
}


def _check_values_typed(schema: dict[str, Any], where: str) -> None:
    """Refuses an `enum` value or a `const` that the `type` beside it does not allow: xgrammar
    writes the values and ignores the `type` (see _EXCLUSIVE), so `{"type": "string", "enum":
    [1, 2]}` wrote `1`, a number the schema refuses, called valid."""
    if "type" not in schema or ("enum" not in schema and "const" not in schema):
        return
    types = schema["type"] if isinstance(schema["type"], list) else [schema["type"]]
    if not all(isinstance(name, str) and name in _IS_OF_TYPE for name in types):
        raise InvalidRequestError(
            f"{where}.type", f"must be one of {sorted(_IS_OF_TYPE)}, or a list of them"
        )
    if "const" in schema:  # (not beside `enum`: _check_combination refused that)
        values = [(f"{where}.const", schema["const"])]
    elif isinstance(schema["enum"], list):  # (another `enum` xgrammar refuses itself)
        values = [(f"{where}.enum[{i}]", value) for i, value in enumerate(schema["enum"])]
    else:
        values = []
    for field, value in values:
        if not any(_IS_OF_TYPE[name](value) for name in types):
            allowed = " or ".join(f'"{name}"' for name in types)
            raise InvalidRequestError(
                field,
                f"{json.dumps(value)[:100]} is a value the `type` beside it ({allowed}) does not"
                " allow: only the value would be enforced, and the output would break the type",
            )


# The keywords that constrain one type of value, and that type. xgrammar reads them only beside a
# `type` (or, for an array's, beside `items` or `prefixItems`, from which it takes the array);
# without one it allows any value, when the schema allows any value of another type but only
# some of this one.
_TYPED_KEYWORDS = {
    "minimum": '"number" or "integer"',
    "maximum": '"number" or "integer"',
    "exclusiveMinimum": '"number" or "integer"',
    "exclusiveMaximum": '"number" or "integer"',
    "pattern": '"string"',
    "minLength": '"string"',
    "maxLength": '"string"',
    "minItems": '"array"',
    "maxItems": '"array"',
}


def _check_typed(schema: dict[str, Any], where: str) -> None:
    """Refuses what xgrammar would read as any value: a value keyword without a `type`, an empty
    list of types, and a `$ref` outside this schema."""
    if "type" not in schema:
        is_array = "items" in schema or "prefixItems" in schema
        for key in schema:
            if key in _TYPED_KEYWORDS and not (is_array and key in ("minItems", "maxItems")):
                raise InvalidRequestError(
                    where,
                    f"`{key}` without a `type` cannot be enforced (xgrammar would allow any"
                    f" value): add a `type` ({_TYPED_KEYWORDS[key]})",
                )
    elif schema["type"] == []:
        raise InvalidRequestError(f"{where}.type", "must name at least one type")
    ref = schema.get("$ref", "#")
    if not isinstance(ref, str) or not (ref == "#" or ref.startswith("#/")):
        raise InvalidRequestError(
            f"{where}.$ref",
            f"{ref!r} cannot be resolved: only references into this schema (`#` or `#/...`) are",
        )


Pointer = tuple[str, ...]  # a subschema's place in the schema, as a `$ref` names it


def _check_refs_reach_a_value(schema: dict[str, Any], where: str) -> None:
    """Refuses `$ref`s and `anyOf`s that lead only to one another (`{"$ref": "#"}`, two `$defs`
    naming each other): xgrammar compiled them into a rule that derives nothing, and the request
    failed at its first token, a 500. A subschema reaches a value unless it is a `$ref` to one
    that does not, or an `anyOf` of none that does (neither writes anything before them)."""
    subschemas = list(_subschemas(schema, (), where))  # in the document's order
    by_pointer = {pointer: sub for pointer, _, sub in subschemas}
    revived_by: dict[Pointer, list[Pointer]] = {}  # a subschema -> those it would make reach one
    reaching = []
    for pointer, _, sub in subschemas:
        needs = _alternatives(pointer, sub, by_pointer)
        if needs is None:
            reaching.append(pointer)
        for need in needs or ():
            revived_by.setdefault(need, []).append(pointer)
    reached: set[Pointer] = set()
    while reaching:
        pointer = reaching.pop()
        if pointer not in reached:
            reached.add(pointer)
            reaching += revived_by.get(pointer, ())
    for pointer, path, _ in subschemas:
        if pointer not in reached:
            raise InvalidRequestError(
                path, "its `$ref`s and `anyOf`s lead only to one another: no value can meet it"
            )


def _alternatives(
    pointer: Pointer, sub: dict[str, Any], by_pointer: dict[Pointer, Any]
) -> list[Pointer] | None:
    """The subschemas of which `sub` reaches a value if one does; None if it reaches one itself
    (or xgrammar judges it: a reference to nothing, a boolean branch)."""
    if isinstance(sub.get("$ref"), str):
        target = _ref_pointer(sub["$ref"])
        return [target] if target in by_pointer else None
    branches = sub.get("anyOf")
    if not isinstance(branches, list) or not all(isinstance(b, dict) for b in branches):
        return None
    return [(*pointer, "anyOf", str(i)) for i in range(len(branches))]


def admits_only_objects(schema: Any) -> bool:
    """Whether every value the schema (a whole document) admits is a JSON object, as xgrammar
    reads it: its `type` is "object", or the first of `$ref`, `const`, `enum`, `anyOf` it has
    (the one xgrammar reads, see _EXCLUSIVE) leads only to objects. A schema without any of
    these admits any value."""

    def only_objects(sub: Any, followed: frozenset[Pointer]) -> bool:
        if not isinstance(sub, dict):
            return False  # (`true`: any value)
        if isinstance(sub.get("$ref"), str):
            pointer = _ref_pointer(sub["$ref"])
            if pointer is None or pointer in followed:
                return False
            return only_objects(_resolve(schema, pointer), followed | {pointer})
        if "const" in sub:
            return isinstance(sub["const"], dict)
        if "enum" in sub:
            values = sub["enum"]
            return isinstance(values, list) and all(isinstance(v, dict) for v in values)
        if "anyOf" in sub:
            branches = sub["anyOf"]
            return isinstance(branches, list) and all(only_objects(b, followed) for b in branches)
        return sub.get("type") in ("object", ["object"])

    return only_objects(schema, frozenset())


def _resolve(schema: Any, pointer: Pointer) -> Any:
    """The subschema at `pointer` in `schema`; None where there is none."""
    for part in pointer:
        if isinstance(schema, dict):
            schema = schema.get(part)
        elif isinstance(schema, list) and part.isdigit() and int(part) < len(schema):
            schema = schema[int(part)]
        else:
            return None
    return schema


def _ref_pointer(ref: str) -> Pointer | None:
    if ref == "#":
        return ()
    if not ref.startswith("#/"):
        return None
    parts = urllib.parse.unquote(ref[2:]).split("/")
    return tuple(part.replace("~1", "/").replace("~0", "~") for part in parts)


def _subschemas(schema: Any, pointer: Pointer, where: str):
    """(pointer, field name in errors, subschema) of `schema` and each object subschema in it."""
    if not isinstance(schema, dict):
        return
    yield pointer, where, schema
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            for name, sub in value.items():
                yield from _subschemas(sub, (*pointer, key, name), f"{where}.{key}.{name}")
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            for i, sub in enumerate(value):
                yield from _subschemas(sub, (*pointer, key, str(i)), f"{where}.{key}[{i}]")
        elif key in ("items", "additionalProperties"):
            yield from _subschemas(value, (*pointer, key), f"{where}.{key}")


def rebase_refs(schema: Any, base: str) -> Any:
    """A copy of `schema` to be placed at the JSON pointer `base` of a larger document: its local
    `$ref`s (`#`, `#/...`), which point into `schema` itself, point there still."""

    def rebase(sub: dict[str, Any]) -> dict[str, Any]:
        ref = sub.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            return {**sub, "$ref": base + ref[1:]}
        return sub

    return _map_subschemas(schema, rebase)


def _map_subschemas(schema: Any, change: Callable[[dict[str, Any]], dict[str, Any]]) -> Any:
    """A copy of `schema` with `change` applied to each of its subschemas (objects). Only schema
    positions are walked (an `enum` or `const` value holding a "$ref" key is data)."""
    if not isinstance(schema, dict):
        return schema
    mapped: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            value = {name: _map_subschemas(sub, change) for name, sub in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            value = [_map_subschemas(sub, change) for sub in value]
        elif key in ("items", "additionalProperties"):
            value = _map_subschemas(value, change)
        mapped[key] = value
    return change(mapped)


def _open_unbounded_containers(sub: dict[str, Any]) -> dict[str, Any]:
    """An object without `properties` or `additionalProperties` (any object), or an array
    without `items` or `prefixItems` (any array), with that said explicitly: behind a `$ref`
    xgrammar's strict mode closed them (`{}` and `[]` only; in place they stay open), so a
    forced call to a tool whose parameters are `{"type": "object"}` was always `{}`."""
    types = sub.get("type")
    types = types if isinstance(types, list) else [types]
    if "object" in types and "properties" not in sub and "additionalProperties" not in sub:
        sub = {**sub, "additionalProperties": True}
    if "array" in types and "items" not in sub and "prefixItems" not in sub:
        sub = {**sub, "items": True}
    return sub


def _for_xgrammar(spec: str, param: str) -> str:
    """The schema text as xgrammar must read it: each `pattern` translated (see
    json_string_pattern), unbounded objects and arrays opened (see above). A translation is
    longer (`.` takes about 100 characters), and xgrammar's time grows with it: what the
    translations add is bounded as the spec is."""

    patterns_cost = 0

    def translate(sub: dict[str, Any]) -> dict[str, Any]:
        nonlocal patterns_cost
        sub = _open_unbounded_containers(sub)
        if not isinstance(sub.get("pattern"), str):
            return sub
        translated = json_string_pattern(sub["pattern"], param)
        patterns_cost += pattern_size(sub["pattern"]) ** 2
        return {**sub, "pattern": translated}

    translated = json.dumps(_map_subschemas(json.loads(spec), translate))
    if patterns_cost > MAX_PATTERNS_COST:
        raise InvalidRequestError(
            param,
            f"its patterns are too costly to compile together: their sizes with repetitions"
            f" written out, squared, come to {patterns_cost}; at most {MAX_PATTERNS_COST}"
            " (bound strings' lengths with `maxLength` and no pattern, or repeat less)",
        )
    if len(translated) - len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(
            param,
            f"its patterns, with JSON's escapes written out, come to {len(translated)} characters"
            f" of schema; at most {len(spec) + MAX_SPEC_CHARS} (repeat an atom with `{{n}}`"
            " rather than writing it n times)",
        )
    return translated


# What xgrammar puts before its message: the C++ file and line it was raised at.
_XGRAMMAR_ORIGIN = re.compile(r"^\S+\.(?:cc|h):\d+: ")


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
                spec = _for_xgrammar(constraint.spec, constraint.param)
                return _escaped_bounded_strings(
                    xgr.Grammar.from_json_schema(
                        spec, strict_mode=True, max_whitespace_cnt=MAX_JSON_WHITESPACE
                    )
                )
            case "regex":
                _check_regex_anchors(constraint.spec, constraint.param)
                return xgr.Grammar.from_regex(constraint.spec)
            case "answer_or_calls":
                return _answer_or_calls_grammar(constraint)
            case "choice":
                choices = json.loads(constraint.spec)
                alternatives = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
                return xgr.Grammar.from_ebnf(f"root ::= {alternatives}")
            case _:
                return xgr.Grammar.from_ebnf(constraint.spec)
    except InvalidRequestError:
        raise
    except (RuntimeError, ValueError) as error:
        message = _XGRAMMAR_ORIGIN.sub("", str(error).split("] ", 1)[-1].strip())
        raise InvalidRequestError(
            constraint.param, f"invalid {constraint.kind}: {message}"
        ) from None


_ANCHORS = (sre.AT_BEGINNING, sre.AT_END)  # `^`, `$` (xgrammar reads `\A`, `\Z` as letters)


def _check_regex_anchors(regex: str, param: str) -> None:
    """Refuses a `^` that text may come before, or a `$` that text may come after: xgrammar
    warns and drops it (`$a` matched "a", which no text matches). The whole output is matched,
    so at the regex's ends (a branch's, a group's there) they change nothing and pass, as in a
    schema's `pattern` (json_pattern)."""
    try:
        inner = _has_inner_anchor(list(sre_parser.parse(python_spelling(regex))), True, True)
    except (re.error, OverflowError, RecursionError):
        # A spelling Python's parser does not read (`\e`): only the very ends may anchor.
        inner = any(
            (char == "^" and i > 0) or (char == "$" and i < len(regex) - 1)
            for i, char in _unescaped_anchors(regex)
        )
    if inner:
        raise InvalidRequestError(
            param,
            "invalid regex: `^` and `$` can be enforced only at the ends of the regex (the"
            " engine would drop one inside it); escape them (`\\^`, `\\$`) to match the"
            " characters",
        )


def _has_inner_anchor(items: list[tuple[Any, Any]], at_start: bool, at_end: bool) -> bool:
    """Whether a `^`/`$` among parsed `items` has something before/after it. `at_start`/
    `at_end`: nothing can come before/after the items."""
    anchors = [op is sre.AT and value in _ANCHORS for op, value in items]
    consuming = [i for i, anchor in enumerate(anchors) if not anchor]
    head, tail = (consuming[0], consuming[-1]) if consuming else (len(items), -1)
    for i, (op, value) in enumerate(items):
        first, last = at_start and i <= head, at_end and i >= tail
        if anchors[i]:
            inner = not (first if value is sre.AT_BEGINNING else last)
        elif op is sre.BRANCH:
            inner = any(_has_inner_anchor(list(b), first, last) for b in value[1])
        elif op is sre.SUBPATTERN:
            inner = _has_inner_anchor(list(value[3]), first, last)
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT, sre.POSSESSIVE_REPEAT):
            inner = _has_inner_anchor(list(value[2]), False, False)
        else:
            inner = False
        if inner:
            return True
    return False


def _unescaped_anchors(regex: str):
    """(index, character) of each `^` and `$` outside a character class and not escaped."""
    i, in_class = 0, False
    while i < len(regex):
        char = regex[i]
        if char == "\\":
            i += 2
            continue
        if in_class:
            in_class = char != "]"
        elif char == "[":
            in_class = True
            i += 2 if regex[i + 1 : i + 2] == "^" else 1  # (a class's `^` negates it)
            continue
        elif char in "^$":
            yield i, char
        i += 1


def answer_or_calls(
    answer: Constraint, call_schema: str, format_name: str, max_calls: int
) -> Constraint:
    """The constraint allowing `answer`, or up to `max_calls` calls each meeting `call_schema`
    in the format named (shared.engine.call_grammar); an InvalidRequestError naming `tools` if
    the two do not fit one spec."""
    spec = call_grammar.write_spec(answer.kind, answer.spec, call_schema, format_name, max_calls)
    if len(spec) > MAX_SPEC_CHARS:
        raise InvalidRequestError(
            "tools",
            f"the response format and the tools' parameters come to {len(spec)} characters of"
            f" schema together; a request that gives both takes at most {MAX_SPEC_CHARS}",
        )
    return Constraint(call_grammar.KIND, spec, answer.param)


def _answer_or_calls_grammar(constraint: Constraint) -> Any:
    """The answer's grammar, or the calls in their format (shared.engine.call_grammar)."""
    try:
        parts = call_grammar.read_spec(constraint.spec)
    except ValueError as error:
        raise InvalidRequestError(constraint.param, str(error)) from None
    answer = to_grammar(Constraint(parts.answer_kind, parts.answer_spec, constraint.param))
    call = to_grammar(Constraint("json_schema", parts.call_schema, "tools"))
    return call_grammar.compose(answer, call, parts.call_format, parts.max_calls)


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
