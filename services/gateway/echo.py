"""Completions' `echo`: a choice's text, and its logprobs when asked, begin with the prompt's.

The prompt's logprobs are computed by the prefill (`SamplingParams.prompt_logprobs`) and come
with the choice's first token (`TokenDelta.prompt_logprobs`): the first event of the choice
carries the prompt before that token. The prompt's first token has no logprob (nothing comes
before it): null in the response, as OpenAI and vLLM answer. With `max_tokens` 0 the choice is
the prompt alone: the one token computed with it is left out, and the choice ends "length".
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from services.gateway.detokenizer import MAX_CHARACTER_TOKENS
from services.gateway.openai_shapes import TokenLogprob
from shared import wire

# Token id -> the TokenLogprob the client sees for it, with that logprob and alternatives,
# after the tokens before it (its text's context: `detokenizer.token_text`).
TokenView = Callable[[int, float | None, tuple[TokenLogprob, ...], Sequence[int]], TokenLogprob]


def echoed_text(tokenizer, prompt_text: str | None, prompt_token_ids: list[int]) -> str:
    """The prompt as the client sent it: its text, or its token ids' text (special tokens
    written out: they are part of what was sent)."""
    if prompt_text is not None:
        return prompt_text
    return tokenizer.decode(prompt_token_ids, skip_special_tokens=False)


def echoed_logprobs(
    prompt_token_ids: list[int], delta: wire.TokenDelta, view: TokenView
) -> list[TokenLogprob]:
    """One TokenLogprob per prompt token: the first with none, the rest with the delta's
    prompt logprobs (none either when the delta has none: a worker that did not compute them,
    such as one that resumed the request past its first token)."""
    logprobs = delta.prompt_logprobs or []
    tops = delta.prompt_top_logprobs or []
    entries = [view(prompt_token_ids[0], None, (), ())]
    for position, token in enumerate(prompt_token_ids[1:]):
        # (prompt_token_ids[position] is the token before this one)
        context = prompt_token_ids[max(0, position + 1 - MAX_CHARACTER_TOKENS) : position + 1]
        if position >= len(logprobs):
            entries.append(view(token, None, (), context))
            continue
        top = tops[position] if position < len(tops) else []
        alternatives = tuple(view(t, lp, (), context) for t, lp in top)
        entries.append(view(token, logprobs[position], alternatives, context))
    return entries
