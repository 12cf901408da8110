"""An answer written in slices is exactly the JSON `json.dumps` writes, whatever its lists."""

from __future__ import annotations

import json
import random

import pytest

from services.gateway import sliced_json
from services.gateway.sliced_json import SLICE_ITEMS, sliced_dumps

STRINGS = ("a", "Ġhello", "日本", "émoji😀", '"', "\\", "\n", "\u2028", "")


def compact(value) -> str:
    return json.dumps(value, ensure_ascii=False, allow_nan=False, separators=(",", ":"))


@pytest.mark.parametrize("length", [0, 1, SLICE_ITEMS - 1, SLICE_ITEMS, SLICE_ITEMS + 1, 50_001])
def test_a_sliced_answer_is_json_dumps_text(length):
    rng = random.Random(length)
    answer = {
        "count": length,
        "max_model_len": 8192,
        "tokens": [rng.randrange(49152) for _ in range(length)],
        "token_strs": [rng.choice(STRINGS) for _ in range(length)],
        "nested": {"list": list(range(5))},
        "none": None,
    }
    assert sliced_dumps(answer) == compact(answer)
    assert json.loads(sliced_dumps(answer)) == answer


def test_a_long_list_is_written_slice_by_slice(monkeypatch):
    """No single call writes more than a slice of a long list (the event loop's turn comes
    between calls)."""
    written: list[int] = []
    real = sliced_json._dumps

    def spied(value):
        written.append(len(value) if isinstance(value, list) else 0)
        return real(value)

    monkeypatch.setattr(sliced_json, "_dumps", spied)
    sliced_dumps({"tokens": list(range(3 * SLICE_ITEMS + 5))})
    assert max(written) == SLICE_ITEMS and sum(written) == 3 * SLICE_ITEMS + 5


def test_a_number_json_cannot_hold_is_refused_as_json_dumps_refuses_it():
    with pytest.raises(ValueError):
        sliced_dumps({"x": [float("nan")] * (SLICE_ITEMS + 1)})
