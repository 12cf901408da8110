"""OpenAI's bounds on a request's `metadata` (chat, completions, Responses, batches): one rule
for the gateway and the batch service, each raising its own error with the text given here."""

from __future__ import annotations

from typing import Any

MAX_PAIRS = 16
MAX_KEY_CHARS = 64
MAX_VALUE_CHARS = 512


def metadata_problem(metadata: Any) -> str | None:
    """What is wrong with a `metadata` value, for the client; None when nothing is (JSON null,
    no metadata, included)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_PAIRS:
        return f"`metadata` must be an object of at most {MAX_PAIRS} pairs"
    for key, value in metadata.items():
        if len(key) > MAX_KEY_CHARS or not isinstance(value, str):
            return f"`metadata` keys are at most {MAX_KEY_CHARS} characters, values strings"
        if len(value) > MAX_VALUE_CHARS:
            return f"`metadata` values are at most {MAX_VALUE_CHARS} characters"
    return None
