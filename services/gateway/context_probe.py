"""A prompt far longer than the model's context is refused from a prefix's tokens, before its
whole text is tokenized.

Tokenizing costs the gateway about a second of a thread per MiB of text (and the tokenizer holds
the GIL for part of it), all to refuse a prompt that could never run: a client sending 8 MiB
prompts kept a gateway core busy for seconds each. So a text more than `LONG_CHARS_PER_TOKEN`
characters per token of the context first has its first `PROBE_CHARS_PER_TOKEN` characters per
token tokenized; if those alone are twice the context, the whole is surely past it, and the
request is refused (400) naming how many tokens that prefix made.

Why a prefix's tokens bound the whole's: the cut is made before a space that follows a non-space,
where the tokenizers that split words at spaces before merging (GPT-2's byte-level BPE and its
descendants, SentencePiece's metaspace, WordPiece) make the same tokens of the prefix alone as
within the whole text; those that do not can differ only near the cut, by a few tokens, and the
margin (twice the context) is thousands. Tokens the whole may add (a BOS) only add. Otherwise the
prompt is tokenized whole, as any other. `/tokenize` never probes: counting a long text's tokens
is what it is for.
"""

from __future__ import annotations

from services.gateway.chat_prompt import chat_prompt_text
from services.gateway.openai_protocol import GenerationRequest, bad_request

PROBE_CHARS_PER_TOKEN = 16  # the prefix tokenized: 131,072 characters at a context of 8,192
LONG_CHARS_PER_TOKEN = 32  # a text longer than this per token of the context is probed
PAST_CONTEXTS = 2  # a prefix of this many contexts' tokens refuses the whole


def refuse_far_past_context(
    tokenizer, request: GenerationRequest, max_model_len: int, template_tools: bool
) -> None:
    """ApiError 400 when the request's prompt text is surely longer than the context (a prefix
    of it alone is twice that); nothing otherwise, and nothing tokenized for a short prompt. A
    chat long enough to probe is rendered here, and again by its tokenization if it passes."""
    longer_than = LONG_CHARS_PER_TOKEN * max_model_len
    text = _long_prompt_text(tokenizer, request, longer_than, template_tools)
    if text is None:
        return
    cut = word_boundary(text, PROBE_CHARS_PER_TOKEN * max_model_len)
    num_tokens = len(tokenizer(text[:cut], add_special_tokens=False).input_ids)
    if num_tokens >= PAST_CONTEXTS * max_model_len:
        raise bad_request(
            request.prompt_param,
            f"the prompt is longer than this model's context of {max_model_len} tokens: its "
            f"first {cut:,} characters alone are {num_tokens:,} tokens",
        )


def _long_prompt_text(
    tokenizer, request: GenerationRequest, longer_than: int, template_tools: bool
) -> str | None:
    """The text the prompt's tokens would be made of, if it is longer than `longer_than`
    characters (a chat's rendered by its template, only once its messages hold that many)."""
    if request.prompt_text is not None:
        return request.prompt_text if len(request.prompt_text) > longer_than else None
    if request.messages is None or not request.holds_more_text(longer_than):
        return None  # token ids (nothing to tokenize), or a chat too short to matter
    text = chat_prompt_text(tokenizer, request, template_tools)
    return text if len(text) > longer_than else None


def word_boundary(text: str, at: int) -> int:
    """Where to cut `text` at or before `at`: before a space that follows a non-space, within
    the last half; `at` itself if there is none (a few tokens move at most)."""
    floor = at // 2
    space = text.rfind(" ", floor, at + 1)
    while space > floor:
        if not text[space - 1].isspace():
            return space
        space = text.rfind(" ", floor, space)
    return at
