"""A request's body read as JSON, for the HTTP API and the RPC door alike: a 400 when it is not
JSON, or not text.

Python's parser takes a lone UTF-16 surrogate (`"\\ud800"`, or its bytes in UTF-8), which is no
character: the tokenizer (Rust strings) raised TypeError on it, the wire's encoding
UnicodeEncodeError, and the request failed with a 500. It is refused here, as pydantic's parser
(vLLM's) refuses it. Only a body that may hold one is checked again: one with a surrogate's
escape or bytes, or not in UTF-8 at all.
"""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.openai_protocol import ApiError

_SURROGATE_ESCAPE = r"\\u[dD][89a-fA-F]"
_MAY_HOLD_SURROGATES_TEXT = re.compile(_SURROGATE_ESCAPE)
# (and the UTF-8 bytes of a surrogate, ED A0-BF, which the parser lets through; a NUL byte
# is a body in UTF-16 or UTF-32, where neither pattern would show)
_MAY_HOLD_SURROGATES_BYTES = re.compile(_SURROGATE_ESCAPE.encode() + rb"|\xed[\xa0-\xbf]|\x00")


def load_json_body(raw: str | bytes | bytearray) -> Any:
    """The JSON value `raw` holds; ApiError 400 when it is not valid JSON text."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError) as error:  # (ints over 4,300 digits, deep nesting too)
        raise ApiError(400, f"the body is not valid JSON: {error}") from None
    pattern = _MAY_HOLD_SURROGATES_TEXT if isinstance(raw, str) else _MAY_HOLD_SURROGATES_BYTES
    if pattern.search(raw) is not None:
        _refuse_lone_surrogates(body)
    return body


def _refuse_lone_surrogates(body: Any) -> None:
    try:
        json.dumps(body, ensure_ascii=False).encode()  # (a string of keys and values, in C)
    except UnicodeEncodeError as error:
        code = ord(error.object[error.start])
        message = f"a lone UTF-16 surrogate (\\u{code:04x}) is no character"
        raise ApiError(400, f"the body is not valid JSON text: {message}") from None
