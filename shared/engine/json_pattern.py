"""A JSON schema's `pattern` as a regex over the string's JSON text, for xgrammar.

A `pattern` describes a string's value, but xgrammar matches it against the string's JSON text,
writing what the pattern allows between the quotes as it is: a pattern that could match a quote,
a backslash or a control character let it write invalid JSON. `json_string_pattern` translates
the pattern so that each such character is written as its escape, and refuses the features whose
meaning the translation cannot keep (`constraint.py` calls it on every pattern of a schema).
"""

from __future__ import annotations

import functools
import re
from re import _constants as sre  # the parsed form of a regex (Python 3.11+)
from re import _parser as sre_parser
from typing import Any

from shared.errors import InvalidRequestError

Ranges = list[tuple[int, int]]  # code points, sorted, disjoint, inclusive
_MAX_CODE = 0x10FFFF
# What a JSON string must escape (the controls, `"` and `\`), and code points no UTF-8 text has.
_ESCAPED: Ranges = [(0x00, 0x1F), (0x22, 0x22), (0x5C, 0x5C)]
_SURROGATES: Ranges = [(0xD800, 0xDFFF)]
_SHORT_ESCAPES = {0x22: '"', 0x5C: "\\\\", 0x08: "b", 0x0C: "f", 0x0A: "n", 0x0D: "r", 0x09: "t"}
# JSON Schema's regexes are ECMA-262's: its classes, not Python's Unicode ones.
_DIGIT: Ranges = [(0x30, 0x39)]
_WORD: Ranges = [(0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A)]
_SPACE: Ranges = [(0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A)]
_SPACE += [(0x2028, 0x2029), (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000)]
_SPACE += [(0xFEFF, 0xFEFF)]
_LINE_ENDS: Ranges = [(0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)]  # what `.` leaves out
_REGEX_SYNTAX = frozenset("\\^$.|?*+()[]{}-/")
# xgrammar builds one automaton for a pattern where it can, in a time that grows with the square
# of the pattern's size with its repetitions written out (`^[A-Za-z]{2,2000}$` 0.8 s, `{2,8000}`
# over 25 s, `^(ab?){1,5000}$` 7 s), at the gateway (its event loop blocked) and again on the
# worker; within this bound, 0.1 s at most (measured). A character JSON may have to escape weighs
# more: its escapes are alternatives of several characters (`^.{1,1000}$` took 4.4 s).
MAX_PATTERN_SIZE = 1000
_ESCAPABLE_WEIGHT = 5


class _Untranslatable(Exception):
    """A pattern whose meaning the translation to the JSON text cannot keep; says why."""


def json_string_pattern(pattern: str, param: str) -> str:
    """`pattern` (matching a whole string's value, as xgrammar reads it) as a regex over that
    string's JSON text, between the quotes: a character JSON escapes becomes its escape (`\\"`,
    `\\\\`, `\\n` or `\\u000a`, ...), every other character stays as it is. The regex is written in
    printable ASCII (other characters as `\\uXXXX`), so xgrammar may still compile it as a regex
    over unescaped text: it then leaves out every escape, which allows less but nothing invalid.
    Lookarounds, back-references, `\\b`, inline flags, and `^`/`$` anywhere but at the ends are
    refused: they would be dropped, or mean something else over the escaped text; so is a
    pattern too large with its repetitions written out (MAX_PATTERN_SIZE)."""
    try:
        parsed = sre_parser.parse(python_spelling(pattern))
        if parsed.state.flags & ~re.UNICODE:
            raise _Untranslatable("inline flags such as `(?i)` cannot be enforced")
        translated = _sequence_regex(list(parsed), at_start=True, at_end=True)
        if (size := _expanded_size(list(parsed))) > MAX_PATTERN_SIZE:
            raise InvalidRequestError(
                param,
                f"is too costly to compile: {size} characters with its repetitions written out"
                f" (one that JSON may escape, such as `.`, counts {_ESCAPABLE_WEIGHT}); at most"
                f" {MAX_PATTERN_SIZE}. Bound a string's length with `maxLength` and no pattern,"
                f" or repeat less (pattern {pattern!r})",
            )
        return translated
    except (re.error, OverflowError) as error:  # (Overflow: a count of 2**32 - 1 or more)
        raise InvalidRequestError(param, f"is not a valid regex: {error}") from None
    except RecursionError:
        raise InvalidRequestError(param, "the regex nests too deep") from None
    except _Untranslatable as error:
        raise InvalidRequestError(param, f"{error} (pattern {pattern!r})") from None


_ECMA_ESCAPE = re.compile(r"\\u\{([0-9A-Fa-f]{1,6})\}|\\c([A-Za-z])")


def pattern_size(pattern: str) -> int:
    """The size `json_string_pattern` bounds (of a pattern it translated): its characters with
    its repetitions written out, as xgrammar's automaton holds them."""
    return _expanded_size(list(sre_parser.parse(python_spelling(pattern))))


def _expanded_size(items: list[tuple[Any, Any]]) -> int:
    size = 0
    for op, value in items:
        if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
            size += _ESCAPABLE_WEIGHT if _intersects(_char_set(op, value), _ESCAPED) else 1
        elif op is sre.BRANCH:
            size += sum(_expanded_size(list(branch)) for branch in value[1])
        elif op is sre.SUBPATTERN:
            size += _expanded_size(list(value[3]))
        elif op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # `*` and `+` are built once, `{n}` n times
            low, high, inner = value
            size += max(low if high == sre.MAXREPEAT else high, 1) * _expanded_size(list(inner))
    return size


def _intersects(ranges: Ranges, others: Ranges) -> bool:
    return any(low <= o_high and o_low <= high for low, high in ranges for o_low, o_high in others)


def python_spelling(pattern: str) -> str:
    """The ECMA-262 syntax Python's parser spells otherwise, in Python's spelling: named groups
    `(?<name>...)`, `\\u{1F600}`, `\\cJ` and the class of any character `[^]`."""
    parts, i, in_class = [], 0, False
    while i < len(pattern):
        char, rest = pattern[i], pattern[i : i + 3]
        if char == "\\":
            code = _ECMA_ESCAPE.match(pattern, i)
            if code is None:
                parts.append(pattern[i : i + 2])
                i += 2
                continue
            value = int(code[1], 16) if code[1] else ord(code[2]) % 32
            parts.append(f"\\U{value:08x}")
            i = code.end()
            continue
        if not in_class and rest == "[^]":
            parts.append(r"[\s\S]")
            i += 3
            continue
        if not in_class and rest == "(?<" and pattern[i + 3 : i + 4] not in ("=", "!"):
            parts.append("(?P<")
            i += 3
            continue
        in_class = (in_class and char != "]") or (not in_class and char == "[")
        parts.append(char)
        i += 1
    return "".join(parts)


def _sequence_regex(items: list[tuple[Any, Any]], at_start: bool, at_end: bool) -> str:
    """`at_start`/`at_end`: nothing can come before/after the sequence, so `^`/`$` may."""
    consuming = [i for i, (op, _) in enumerate(items) if op is not sre.AT]
    head, tail = (consuming[0], consuming[-1]) if consuming else (len(items), -1)
    return "".join(
        _item_regex(op, value, at_start and i <= head, at_end and i >= tail)
        for i, (op, value) in enumerate(items)
    )


def _item_regex(op: Any, value: Any, first: bool, last: bool) -> str:
    if op in (sre.LITERAL, sre.NOT_LITERAL, sre.ANY, sre.IN):
        return _set_regex(tuple(_char_set(op, value)))
    if op is sre.AT:
        if value in (sre.AT_BEGINNING, sre.AT_BEGINNING_STRING) and first:
            return ""  # the whole string is matched: `^` and `$` at its ends change nothing
        if value in (sre.AT_END, sre.AT_END_STRING) and last:
            return ""
        if value in (sre.AT_BOUNDARY, sre.AT_NON_BOUNDARY):
            raise _Untranslatable("`\\b` and `\\B` cannot be enforced")
        raise _Untranslatable("`^` and `$` can be enforced only at the ends of the pattern")
    if op is sre.BRANCH:
        _, branches = value
        return "(" + "|".join(_sequence_regex(list(b), first, last) for b in branches) + ")"
    if op is sre.SUBPATTERN:
        _, add_flags, del_flags, inner = value
        if add_flags or del_flags:
            raise _Untranslatable("inline flags such as `(?i:...)` cannot be enforced")
        return "(" + _sequence_regex(list(inner), first, last) + ")"
    if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # lazy or greedy: the same strings match
        low, high, inner = value
        atom = _sequence_regex(list(inner), False, False)
        if len(inner) != 1 or inner[0][0] in (sre.AT, sre.MAX_REPEAT, sre.MIN_REPEAT):
            atom = f"({atom})"  # (every other single item is written as one atom)
        return atom + _quantifier(low, high)
    if op in (sre.ASSERT, sre.ASSERT_NOT):
        raise _Untranslatable("lookahead and lookbehind (`(?=`, `(?!`, ...) cannot be enforced")
    if op in (sre.GROUPREF, sre.GROUPREF_EXISTS):
        raise _Untranslatable("back-references cannot be enforced")
    raise _Untranslatable(f"the regex feature {str(op).lower()} cannot be enforced")


def _quantifier(low: int, high: int) -> str:
    if high == sre.MAXREPEAT:
        return {0: "*", 1: "+"}.get(low, f"{{{low},}}")
    if (low, high) == (0, 1):
        return "?"
    return f"{{{low}}}" if low == high else f"{{{low},{high}}}"


def _char_set(op: Any, value: Any) -> Ranges:
    """The code points one character of the pattern may be."""
    if op is sre.LITERAL:
        return [(value, value)]
    if op is sre.NOT_LITERAL:
        return _complement([(value, value)])
    if op is sre.ANY:
        return _complement(_LINE_ENDS)
    ranges: Ranges = []
    negate = False
    for item, arg in value:
        if item is sre.NEGATE:
            negate = True
        elif item is sre.LITERAL:
            ranges.append((arg, arg))
        elif item is sre.RANGE:
            ranges.append(arg)
        elif item is sre.CATEGORY:
            ranges += _CATEGORIES[arg]
        else:
            raise _Untranslatable(f"the class item {str(item).lower()} cannot be enforced")
    ranges = _union(ranges)
    return _complement(ranges) if negate else ranges


@functools.lru_cache(maxsize=256)  # a pattern repeats its classes (`.`, `\S`, ...)
def _set_regex(ranges: tuple[tuple[int, int], ...]) -> str:
    """One character of `ranges` over the JSON text: as it is, or escaped, one atom."""
    kept = _complement(_union([*_complement(ranges), *_ESCAPED, *_SURROGATES]))
    escaped = [c for low, high in ranges for c in range(low, min(high, 0x5C) + 1)]
    escaped = [c for c in escaped if c < 0x20 or c in (0x22, 0x5C)]
    alternatives = [_class_regex(kept)] if kept else []
    if short := [_SHORT_ESCAPES[c] for c in escaped if c in _SHORT_ESCAPES]:
        alternatives.append("\\\\" + (short[0] if len(short) == 1 else f"[{''.join(short)}]"))
    for high in (0, 1):  # \u00XX, XX below 20 (both cases of a hex digit are JSON)
        low_digits = [c & 0xF for c in escaped if c >> 4 == high and c < 0x20]
        digits = [ord(d) for low in low_digits for d in f"{low:x}{low:X}"]
        if digits:
            alternatives.append(f"\\\\u00{high}{_class_regex(_union([(d, d) for d in digits]))}")
    if not alternatives:
        raise _Untranslatable("a character class matches no character")
    if kept and len(alternatives) == 1:
        return alternatives[0]
    return f"({'|'.join(alternatives)})"  # (an escape is several characters: grouped, one atom)


def _class_regex(ranges: Ranges) -> str:
    """A regex class of `ranges`: negated when they run to the last code point."""
    if ranges == [(ranges[0][0], ranges[0][0])]:
        return _char_regex(ranges[0][0])
    negate = ranges[-1][1] == _MAX_CODE
    listed = _complement(ranges) if negate else ranges
    body = "".join(
        _char_regex(low) if low == high else f"{_char_regex(low)}-{_char_regex(high)}"
        for low, high in listed
    )
    return f"[{'^' if negate else ''}{body}]"


def _char_regex(code: int) -> str:
    char = chr(code)
    if char in _REGEX_SYNTAX:
        return "\\" + char
    if 0x20 <= code <= 0x7E or code > 0xFFFF:
        return char
    return f"\\u{code:04x}"


def _union(ranges: Ranges) -> Ranges:
    merged: Ranges = []
    for low, high in sorted(ranges):
        if merged and low <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(high, merged[-1][1]))
        else:
            merged.append((low, high))
    return merged


def _complement(ranges: Ranges) -> Ranges:
    gaps, start = [], 0
    for low, high in _union(ranges):
        if low > start:
            gaps.append((start, low - 1))
        start = high + 1
    return [*gaps, (start, _MAX_CODE)] if start <= _MAX_CODE else gaps


_CATEGORIES = {
    sre.CATEGORY_DIGIT: _DIGIT,
    sre.CATEGORY_NOT_DIGIT: _complement(_DIGIT),
    sre.CATEGORY_WORD: _WORD,
    sre.CATEGORY_NOT_WORD: _complement(_WORD),
    sre.CATEGORY_SPACE: _SPACE,
    sre.CATEGORY_NOT_SPACE: _complement(_SPACE),
}
