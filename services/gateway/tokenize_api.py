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
vLLM's `add_special_tokens` (a text prompt's, default true) and `add_generation_prompt` (a
chat's assistant opening, default true) are taken too; set false, `count` is no longer the
usage's. A chat's special tokens are its template's: `add_special_tokens: true`
beside `messages` is refused, as is `add_generation_prompt` beside `prompt`.

`/detokenize` takes `tokens` (ids) and answers their text, special tokens included: the exact
text those ids stand for, where a completion's text leaves special tokens out.

A long prompt's answer (its tokenization, its token strings, its rendering) is computed off the
event loop, as a generation's tokenization is (`tokenize_async`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

from services.gateway.generation import Generator, tokenizes_off_loop
from services.gateway.openai_protocol import (
    ApiError,
    GenerationRequest,
    bad_request,
    is_int,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
)

TOKENIZE_ONLY_FIELDS = ("return_token_strs", "add_special_tokens", "add_generation_prompt")
T = TypeVar("T")


@dataclass(frozen=True)
class TokenizeOptions:
    """What /tokenize's own fields ask for."""

    return_token_strs: bool = False
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


def tokenize(generator: Generator, body: Any) -> dict[str, Any]:
    """The /tokenize answer for `body`; raises ApiError (400, 404 for another model)."""
    return _answer(generator, *_parse(generator, body))


async def tokenize_async(
    generator: Generator, body: Any, render: Callable[[dict[str, Any]], T] | None = None
) -> T | dict[str, Any]:
    """`tokenize`'s answer, or `render` of it (e.g. its JSON), computed off the event loop for
    a long prompt: the answer may hold millions of tokens and their strings."""
    request, options = _parse(generator, body)
    work = (generator, request, options, render)
    if not tokenizes_off_loop(request):
        return _rendered(*work)
    return await generator.off_loop(_rendered, *work)


def _parse(generator: Generator, body: Any) -> tuple[GenerationRequest, TokenizeOptions]:
    """The request `body` holds, and what its /tokenize fields ask for."""
    body = _with_model(body, generator.model_name)
    flags = {name: body.pop(name, None) for name in TOKENIZE_ONLY_FIELDS}
    for name, value in flags.items():
        if value is not None and not isinstance(value, bool):
            raise bad_request(name, "must be true or false")
    # (JSON null is "not given": the field is left out of what the endpoint's parser reads.)
    given = [name for name in ("prompt", "messages") if body.get(name) is not None]
    if len(given) == 2:
        raise bad_request("prompt", "give `prompt` (a completion's) or `messages`, not both")
    if not given:
        raise bad_request(None, "`prompt` (a completion's) or `messages` (a chat's) is required")
    chat = given == ["messages"]
    if chat and flags["add_special_tokens"]:
        raise bad_request(
            "add_special_tokens", "a chat's special tokens are its template's: only false here"
        )
    if not chat and flags["add_generation_prompt"] is not None:
        raise bad_request("add_generation_prompt", "applies to `messages`, not to `prompt`")
    body.pop("prompt" if chat else "messages", None)
    parse = parse_chat_request if chat else parse_completion_request
    options = TokenizeOptions(**{name: value for name, value in flags.items() if value is not None})
    return parse(body, generator.model_name, generator.max_model_len), options


def _rendered(
    generator: Generator,
    request: GenerationRequest,
    options: TokenizeOptions,
    render: Callable[[dict[str, Any]], T] | None,
) -> T | dict[str, Any]:
    answer = _answer(generator, request, options)
    return answer if render is None else render(answer)


def _answer(
    generator: Generator, request: GenerationRequest, options: TokenizeOptions
) -> dict[str, Any]:
    token_ids = generator.tokenize(
        request, options.add_special_tokens, options.add_generation_prompt
    )
    answer: dict[str, Any] = {
        "count": len(token_ids),
        "max_model_len": generator.max_model_len,
        "tokens": token_ids,
    }
    if options.return_token_strs:
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
        raise model_not_found(model, served_model)
    return {**body, "model": model}
