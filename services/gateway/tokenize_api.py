"""`POST /tokenize` and `POST /detokenize`: the served model's tokenizer over HTTP, in the shape
of vLLM's extension (agent frameworks call it to fit a conversation into the context first).

`/tokenize` takes the body a client would send to `/v1/completions` (with `prompt`) or to
`/v1/chat/completions` (with `messages`, and `tools` if it has them), goes through the same
parser and the same tokenization (the chat template, tools rendered as generation renders them),
and answers the prompt's token ids: `count` is the `prompt_tokens` that request's usage would
report. Its other fields (sampling, `max_tokens`) are validated as those endpoints do and
change nothing; `model` may be left out. A text or chat prompt longer than the context is
counted, not refused: `max_model_len` in the answer tells the caller whether it fits.
`return_token_strs: true` adds each token's string as the tokenizer's vocabulary writes it.

`/detokenize` takes `tokens` (ids) and answers their text, special tokens included: the exact
text those ids stand for, where a completion's text leaves special tokens out.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.gateway.generation import Generator
from services.gateway.openai_protocol import (
    ApiError,
    bad_request,
    is_int,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)

TOKENIZE_ONLY_FIELDS = ("return_token_strs",)


def tokenize(generator: Generator, body: Any) -> dict[str, Any]:
    """The /tokenize answer for `body`; raises ApiError (400, 404 for another model)."""
    body = _with_model(body, generator.model_name)
    return_token_strs = body.pop("return_token_strs", None)
    if return_token_strs is not None and not isinstance(return_token_strs, bool):
        raise bad_request("return_token_strs", "must be true or false")
    # (JSON null is "not given": the field is left out of what the endpoint's parser reads.)
    given = [name for name in ("prompt", "messages") if body.get(name) is not None]
    if len(given) == 2:
        raise bad_request("prompt", "give `prompt` (a completion's) or `messages`, not both")
    if not given:
        raise bad_request(None, "`prompt` (a completion's) or `messages` (a chat's) is required")
    chat = given == ["messages"]
    body.pop("prompt" if chat else "messages", None)
    parse = parse_chat_request if chat else parse_completion_request
    token_ids = generator.tokenize(parse(body, generator.model_name, generator.max_model_len))
    answer: dict[str, Any] = {
        "count": len(token_ids),
        "max_model_len": generator.max_model_len,
        "tokens": token_ids,
    }
    if return_token_strs:
        answer["token_strs"] = generator.tokenizer.convert_ids_to_tokens(token_ids)
    return answer


def detokenize(generator: Generator, body: Any) -> dict[str, Any]:
    """The /detokenize answer for `body`; raises ApiError (400, 404 for another model)."""
    body = _with_model(body, generator.model_name)
    unknown = sorted(set(body) - {"model", "tokens"})
    if unknown:
        raise bad_request(unknown[0], f"unknown field `{unknown[0]}`")
    token_ids = body.get("tokens")
    if not isinstance(token_ids, list) or not all(is_int(t) for t in token_ids):
        raise bad_request("tokens", "`tokens` is required and must be a list of token ids")
    vocab_size = generator.vocab_size
    if any(not 0 <= t < vocab_size for t in token_ids):
        raise bad_request("tokens", f"token ids must be in [0, {vocab_size})")
    return {"prompt": generator.tokenizer.decode(token_ids, skip_special_tokens=False)}


def _with_model(body: Any, served_model: str) -> dict[str, Any]:
    """A copy of the body with `model` filled in when left out, checked when given."""
    if not isinstance(body, Mapping):
        raise ApiError(400, "the request body must be a JSON object")
    model = served_model if body.get("model") is None else body["model"]
    if not isinstance(model, str) or not model:
        raise bad_request("model", "`model` must be a string")
    if model != served_model:
        raise model_not_found(model)
    return {**body, "model": model}
