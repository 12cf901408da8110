r"""Refuses a constraint whose grammar has a rule that can never end: a
`structured_outputs.grammar`, or the grammar xgrammar writes for a JSON schema or a regex.

A grammar may parse and still allow no complete output: a rule that only refers to itself
(`root ::= "a" root`), rules that lead only to one another, a left recursion without a base
case, a character class that matches no character (`[^\s\S]`); a schema whose `$ref` leads
back to itself through required properties or items only (`{"properties": {"child": {"$ref":
"#"}}, "required": ["child"]}`). xgrammar compiles them, and the request failed at generation:
where the matcher allowed no token, a 500 ("the output constraint allows no next token"); where
it let the model into the rule, "b" after "b" (or `{"child": {"child": ...`) to `max_tokens`.
The matcher lets the model into any rule the root reaches, even beside an alternative that ends
(`root ::= "a" | "a" x`), so every rule the root reaches must be able to end, not only the root.

The classic fixpoint of productive nonterminals, read from xgrammar's own parse of the grammar
(its JSON serialization: the rules, and the expressions they are made of) rather than from the
request's text, so that this reads the grammar exactly as the engine will. Conservative: an
expression this does not know (a token, a regex, a tag dispatch...) counts as one that ends, and
a lookahead is no part of the text (xgrammar does not hold the output to it at the end).

The same reading gives the token ids a grammar names (`grammar_token_ids`), which the gateway
holds to the vocabulary as it does `stop_token_ids` (generation.py).
"""

from __future__ import annotations

import functools
import json
import re
from collections import deque
from dataclasses import dataclass
from typing import Any

from shared.engine.constraint import Constraint, to_grammar
from shared.errors import InvalidRequestError

# The layout of xgrammar 0.2.8's `Grammar.serialize_json`: each expression `[type, length,
# data...]` in `grammar_expr_data`, its start in `grammar_expr_indptr`, and each rule
# `[name, body_expr_id, lookahead_expr_id, ...]`. Another layout turns the check off (it
# never refuses what it cannot read); tests/unit/test_structured_outputs_api.py notices.
_LAYOUT = "v16"

# xgrammar's GrammarExprType, in its order (grammar_impl.h); later types are appended.
(
    _BYTE_STRING,
    _CHARACTER_CLASS,
    _CHARACTER_CLASS_STAR,
    _EMPTY_STR,
    _RULE_REF,  # [rule_id]
    _SEQUENCE,  # [expr_id, ...]: ends when each does
    _CHOICES,  # [expr_id, ...]: ends when one does
    _TAG_DISPATCH,  # [tag_expr_id, rule_id, ..., loop_after_dispatch, excludes_expr_id]
    _REPEAT,  # [rule_id, min, max] (max -1: no bound)
    _TOKEN,  # [token_id, ...]: one of these tokens
    _EXCLUDE_TOKEN,  # [token_id, ...]: any token but these
    # [n, token_id, rule_id, ... (n pairs), loop_after_dispatch, m, excluded token_id, ... (m)]
    _TOKEN_TAG_DISPATCH,
) = range(12)

_MAX_NAMED = 8  # rules a refusal lists
_MAX_CODE_POINT = 0x10FFFF
# A rule the request's text defines (xgrammar names those it adds for a group or a repetition
# after their rule, `root_1`: a refusal names the request's own where it can).
_DEFINITION = re.compile(r"^\s*([\w.-]+)\s*::=", re.MULTILINE)


def check_rules_end(grammar: Any, constraint: Constraint) -> None:
    """InvalidRequestError naming the constraint's field (and the rules) if a rule the root of
    its grammar reaches can never end."""
    endless = find_endless(grammar)
    if endless is None:
        return
    if constraint.kind == "grammar":
        message = _grammar_refusal(endless, constraint.spec)
    elif constraint.kind == "regex":
        message = "invalid regex: part of it can match no text: a character class in it matches"
        message += " no character, so an output that enters that part could never end"
    else:  # a schema's patterns are refused an empty class before (json_string_pattern)
        message = (
            "invalid json_schema: a `$ref` leads back to where it stands through required"
            " properties or items only, so no finite value meets that part and an output that"
            f" enters it could never end (the engine's rules {_listed(endless.rules)} cannot)"
        )
    raise InvalidRequestError(constraint.param, message)


def _grammar_refusal(endless: Endless, spec: str) -> str:
    defined = set(_DEFINITION.findall(spec))
    written = [name for name in endless.rules if name in defined] or endless.rules
    listed = _listed(written)
    or_nothing = " or a character class that matches no character" if endless.empty_class else ""
    if len(written) == 1:
        detail = f"rule {listed} can never end: each of its alternatives needs it again"
        outcome = "no output that enters it can finish; give it an alternative that ends"
    else:
        detail = f"rules {listed} can never end: each of their alternatives needs one of them"
        outcome = "no output that enters them can finish"
    return f"invalid grammar: {detail} (directly or through other rules){or_nothing}, so {outcome}"


def _listed(names: list[str]) -> str:
    listed = ", ".join(f"`{name}`" for name in names[:_MAX_NAMED])
    if len(names) > _MAX_NAMED:
        listed += f" and {len(names) - _MAX_NAMED} more"
    return listed


@dataclass(frozen=True)
class Endless:
    """What of a grammar can never end."""

    rules: list[str]  # the rules the root reaches that derive no finite text, nearest first
    empty_class: bool  # whether the root reaches a character class that matches no character


def find_endless(grammar: Any) -> Endless | None:
    """What of the grammar the root reaches can never end; None if every rule it reaches can
    (or the layout is not one this reads)."""
    parsed = _read(grammar)
    if parsed is None:
        return None
    exprs, rules, root = parsed
    ends = _ending_nodes(exprs, rules)
    num_exprs = len(exprs)
    reached = _reachable_nodes(exprs, rules, root)
    endless = [
        rules[node - num_exprs][0] for node in reached if node >= num_exprs and node not in ends
    ]
    if not endless:
        return None
    empty_class = any(
        node < num_exprs and exprs[node][0] == _CHARACTER_CLASS and _matches_nothing(exprs[node][1])
        for node in reached
    )
    return Endless(endless, empty_class)


@functools.lru_cache(maxsize=64)  # (as structured_outputs.check_parses: the same grammar again)
def grammar_token_ids(constraint: Constraint) -> frozenset[int]:
    """The token ids a `grammar` constraint names (`Token(...)`, `ExcludeToken(...)`, a
    `TokenTagDispatch`'s tokens and excludes), which the worker's compile requires in its
    vocabulary; none for another kind, or a layout this does not read."""
    if constraint.kind != "grammar" or "Token" not in constraint.spec:  # (no token, no parse)
        return frozenset()
    parsed = _read(to_grammar(constraint))
    if parsed is None:
        return frozenset()
    return frozenset(token for kind, data in parsed[0] for token in _named_tokens(kind, data))


def _named_tokens(kind: int, data: list[int]) -> list[int]:
    if kind in (_TOKEN, _EXCLUDE_TOKEN):
        return data
    if kind == _TOKEN_TAG_DISPATCH and data:
        num_pairs = data[0]
        excludes = data[2 + 2 * num_pairs :]  # [m, id, ...]
        return data[1 : 1 + 2 * num_pairs : 2] + excludes[1:]
    return []


Expr = tuple[int, list[int]]  # (type, data)
Rule = tuple[str, int]  # (name, body expr id)


def _read(grammar: Any) -> tuple[list[Expr], list[Rule], int] | None:
    """The grammar's expressions, rules and root rule id, as serialized; None for another
    layout."""
    serialized = json.loads(grammar.serialize_json())
    if serialized.get("__VERSION__") != _LAYOUT:
        return None
    data, starts = serialized["grammar_expr_data"], serialized["grammar_expr_indptr"]
    exprs = []
    for start, end in zip(starts, [*starts[1:], len(data)], strict=True):
        if end - start < 2 or data[start + 1] != end - start - 2:
            return None
        exprs.append((data[start], data[start + 2 : end]))
    rules = [(rule[0], rule[1]) for rule in serialized["rules"]]
    return exprs, rules, serialized["root_rule_id"]


def _ending_nodes(exprs: list[Expr], rules: list[Rule]) -> set[int]:
    """The nodes (expression i is node i, rule r node len(exprs) + r) that derive a finite
    text: each node waits on its children, all of them (a sequence) or one (a choice), and a
    node that ends tells those waiting on it, once per edge (a child may stand twice)."""
    num_exprs = len(exprs)
    waiting_on: list[list[int]] = [[] for _ in range(num_exprs + len(rules))]
    missing = []  # per node: children still to end before it does
    for node, (kind, data) in enumerate(exprs):
        needed, children = _requirement(kind, data, num_exprs)
        for child in children:
            waiting_on[child].append(node)
        missing.append(needed)
    for rule, (_, body) in enumerate(rules):
        waiting_on[body].append(num_exprs + rule)
        missing.append(1)
    ended = [node for node, m in enumerate(missing) if m == 0]
    ends = set(ended)
    while ended:
        for parent in waiting_on[ended.pop()]:
            if parent in ends:
                continue
            missing[parent] -= 1
            if missing[parent] == 0:
                ends.add(parent)
                ended.append(parent)
    return ends


def _requirement(kind: int, data: list[int], num_exprs: int) -> tuple[int, list[int]]:
    """How many of which nodes an expression needs to end: each of a sequence's, one of a
    choice's or a rule's, none for text, the empty string, a character class, a repetition that
    may be absent and whatever this does not read. One of none never ends: an empty choice
    (xgrammar writes one only as a tag dispatch's excludes, which this does not read) and a
    character class that matches no character."""
    if kind == _SEQUENCE:
        return len(data), list(data)
    if kind == _CHOICES:
        return 1, list(data)
    if kind == _RULE_REF or (kind == _REPEAT and data[1] > 0):
        return 1, [num_exprs + data[0]]
    if kind == _CHARACTER_CLASS and _matches_nothing(data):
        return 1, []
    return 0, []


def _matches_nothing(character_class: list[int]) -> bool:
    """Whether a class `[is_negative, lower0, upper0, ...]` matches no code point."""
    negative, bounds = character_class[0], character_class[1:]
    if len(bounds) % 2:  # not a layout this reads
        return False
    ranges = sorted(zip(bounds[::2], bounds[1::2], strict=True))
    if not negative:
        return not ranges
    covered = -1  # every code point up to this one is excluded
    for lower, upper in ranges:
        if lower > covered + 1:
            return False
        covered = max(covered, upper)
    return covered >= _MAX_CODE_POINT


def _reachable_nodes(exprs: list[Expr], rules: list[Rule], root: int) -> list[int]:
    """The nodes the root reaches (where the matcher may lead the model), breadth first from
    the root."""
    num_exprs = len(exprs)
    start = num_exprs + root
    seen, queue, found = {start}, deque([start]), []
    while queue:
        node = queue.popleft()
        found.append(node)
        if node >= num_exprs:
            nexts = [rules[node - num_exprs][1]]
        else:
            nexts = _entered(*exprs[node], num_exprs)
        for child in nexts:
            if child not in seen:
                seen.add(child)
                queue.append(child)
    return found


def _entered(kind: int, data: list[int], num_exprs: int) -> list[int]:
    """The nodes the matcher may enter from an expression."""
    if kind in (_SEQUENCE, _CHOICES):
        return list(data)
    if kind == _RULE_REF or (kind == _REPEAT and data[2] != 0):
        return [num_exprs + data[0]]
    if kind == _TAG_DISPATCH:  # after its tag, each pair's rule
        return [num_exprs + rule for rule in data[1:-2:2]]
    if kind == _TOKEN_TAG_DISPATCH and data:  # after its token, each pair's rule
        return [num_exprs + rule for rule in data[2 : 2 + 2 * data[0] : 2]]
    return []
