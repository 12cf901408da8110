"""OpenAI's response shapes: completions, chat completions, their stream chunks, usage and
logprobs, as plain dicts in exactly the API's form, and server-sent events.

No sockets and no tokenizer here: the texts, token bytes and logprobs come in ready.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

FinishReason = Literal["stop", "length", "tool_calls"]
_MIN_LOGPROB = -9999.0  # JSON has no -inf; vLLM clamps to the same floor


@dataclass(frozen=True)
class TokenLogprob:
    """One token as the client sees it, with its logprob; `top` holds the best alternatives,
    best first (themselves TokenLogprobs with no `top`)."""

    text: str
    token_bytes: bytes  # the token's own bytes: part of a character when it splits one
    logprob: float | None  # None: an echoed prompt's first token (nothing predicted it)
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class ChoiceResult:
    """One finished choice of a non-streamed response."""

    index: int
    text: str
    finish_reason: FinishReason
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None = None  # None: not asked


def _logprob(value: float | None) -> float | None:
    """JSON has no -inf nor NaN (a NaN from a model's broken logits would have failed the
    answer's encoding): the floor stands for both."""
    if value is None:
        return None
    return value if value >= _MIN_LOGPROB else _MIN_LOGPROB  # (NaN compares false)


def usage_dict(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage; `cached_tokens` counts prompt tokens whose computation the prefix cache
    skipped (as OpenAI and vLLM report it)."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def completion_logprobs(tokens: Sequence[TokenLogprob], text_offset: int = 0) -> dict[str, Any]:
    """The legacy completions shape. `text_offset` is where the first token starts in the
    choice's text (non-zero for later stream chunks); offsets add up the tokens' texts.
    Each position's `top_logprobs` holds its own token too, as OpenAI's ("the API will always
    return the logprob of the sampled token, so there may be up to logprobs+1 elements") and
    vLLM's do: a client reads `top_logprobs[i][tokens[i]]` (`_top_logprobs`)."""
    offsets = []
    for token in tokens:
        offsets.append(text_offset)
        text_offset += len(token.text)
    return {
        "tokens": [token.text for token in tokens],
        "token_logprobs": [_logprob(token.logprob) for token in tokens],
        # (None: an echoed prompt's first token, which nothing predicted)
        "top_logprobs": [None if t.logprob is None else _top_logprobs(t) for t in tokens],
        "text_offset": offsets,
    }


def _top_logprobs(token: TokenLogprob) -> dict[str, float]:
    """A position's alternatives keyed by text, best first, its own token among them under its
    own text. Texts can repeat: tokens that hold part of a character read as the characters they
    complete, often none (""), so the halves of different characters meet. The sampled token
    keeps its text; an alternative whose text is taken is keyed by its bytes, as OpenAI keys
    tokens that are no whole characters (`bytes:\\xe4\\xbd`); one equal to another in both is
    the same token, its first (best) entry kept."""
    own = (token.text, token.token_bytes)
    top: dict[str, float] = {}
    for alternative in token.top:
        if (alternative.text, alternative.token_bytes) == own:
            top[token.text] = _logprob(token.logprob)  # (its place in the ranking)
            continue
        key = alternative.text
        if key == token.text or key in top:
            key = _bytes_key(alternative.token_bytes)
        top.setdefault(key, _logprob(alternative.logprob))
    top.setdefault(token.text, _logprob(token.logprob))
    return top


def _bytes_key(token_bytes: bytes) -> str:
    """OpenAI's text for a token that is no whole character: `bytes:` and its bytes escaped."""
    return "bytes:" + "".join(f"\\x{byte:02x}" for byte in token_bytes)


def _chat_token(token: TokenLogprob) -> dict[str, Any]:
    logprob = _logprob(token.logprob)
    return {"token": token.text, "logprob": logprob, "bytes": list(token.token_bytes)}


def chat_logprobs(tokens: Sequence[TokenLogprob]) -> dict[str, Any]:
    content = [
        {**_chat_token(token), "top_logprobs": [_chat_token(top) for top in token.top]}
        for token in tokens
    ]
    return {"content": content}


def _envelope(
    object_type: str, response_id: str, model: str, created: int, choices: list[dict[str, Any]]
) -> dict[str, Any]:
    return {
        "id": response_id,
        "object": object_type,
        "created": created,
        "model": model,
        "choices": choices,
    }


def _completion_choice(choice: ChoiceResult) -> dict[str, Any]:
    logprobs = None if choice.logprobs is None else completion_logprobs(choice.logprobs)
    return {
        "index": choice.index,
        "text": choice.text,
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }


def _chat_choice(choice: ChoiceResult) -> dict[str, Any]:
    logprobs = None if choice.logprobs is None else chat_logprobs(choice.logprobs)
    return {
        "index": choice.index,
        "message": {"role": "assistant", "content": choice.text},
        "logprobs": logprobs,
        "finish_reason": choice.finish_reason,
    }


def completion_response(
    response_id: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceResult],
    usage: dict[str, int],
) -> dict[str, Any]:
    body = [_completion_choice(choice) for choice in choices]
    return {**_envelope("text_completion", response_id, model, created, body), "usage": usage}


def chat_response(
    response_id: str,
    model: str,
    created: int,
    choices: Sequence[ChoiceResult],
    usage: dict[str, int],
) -> dict[str, Any]:
    body = [_chat_choice(choice) for choice in choices]
    return {**_envelope("chat.completion", response_id, model, created, body), "usage": usage}


def completion_chunk(
    response_id: str,
    model: str,
    created: int,
    index: int,
    text: str,
    finish_reason: FinishReason | None,
    logprobs: dict[str, Any] | None,
) -> dict[str, Any]:
    """One streamed piece of a choice; `logprobs` comes from completion_logprobs()."""
    choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope("text_completion", response_id, model, created, [choice])


def chat_chunk(
    response_id: str,
    model: str,
    created: int,
    index: int,
    delta_content: str | None,
    finish_reason: FinishReason | None,
    logprobs: dict[str, Any] | None,
    role_first: bool = False,
    tool_calls: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """One streamed piece of a choice. The choice's first chunk carries the role; the last may
    carry no content, only the finish reason. `logprobs` comes from chat_logprobs();
    `tool_calls` are deltas in OpenAI's streamed shape (each with its `index`)."""
    delta: dict[str, Any] = {"role": "assistant"} if role_first else {}
    if delta_content is not None:
        delta["content"] = delta_content
    if tool_calls:
        delta["tool_calls"] = tool_calls
    choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
    return _envelope("chat.completion.chunk", response_id, model, created, [choice])


def usage_chunk(
    response_id: str, model: str, created: int, usage: dict[str, int], *, chat: bool
) -> dict[str, Any]:
    """The last chunk of a stream asked with include_usage: no choices, only the usage."""
    object_type = "chat.completion.chunk" if chat else "text_completion"
    return {**_envelope(object_type, response_id, model, created, []), "usage": usage}


def completion_id() -> str:
    return f"cmpl-{uuid.uuid4().hex}"


def chat_completion_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


SSE_DONE = b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any] | str) -> bytes:
    """One server-sent event. A dict is sent as compact JSON (which never holds a newline); a
    string's lines each get their own `data:` field, as the SSE format requires."""
    if isinstance(data, str):
        payload = data
    else:
        payload = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    return ("".join(f"data: {line}\n" for line in payload.split("\n")) + "\n").encode()
