"""An answer's JSON written a slice at a time, so that a thread writing a huge one lets the
event loop run between slices.

`json.dumps` is one C call that holds the GIL until it returns: `/tokenize`'s answer for a
7 MiB text (some 3 million token ids and as many strings) took half a second of it, written in
a gateway thread while the event loop, which needs the GIL, answered no one. Here each long list
of the answer's top level is written `SLICE_ITEMS` items at a time, the interpreter free to hand
the GIL over between slices; the text is exactly `json.dumps`'s (compact, UTF-8 text).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

SLICE_ITEMS = 16_384  # a slice of ids or short strings: a few milliseconds of json.dumps
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def sliced_dumps(answer: Mapping[str, Any]) -> str:
    """`answer` as compact JSON text, its long top-level lists written in slices."""
    fields = (f"{_dumps(key)}:{_value(value)}" for key, value in answer.items())
    return "{" + ",".join(fields) + "}"


def _value(value: Any) -> str:
    if not isinstance(value, list) or len(value) <= SLICE_ITEMS:
        return _dumps(value)
    slices = (
        _dumps(value[start : start + SLICE_ITEMS])[1:-1]
        for start in range(0, len(value), SLICE_ITEMS)
    )
    return "[" + ",".join(slices) + "]"
