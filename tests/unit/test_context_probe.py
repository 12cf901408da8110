"""A prompt far past the context is refused from a prefix's tokens, never tokenized whole
(`services.gateway.context_probe`); one that is not is served as before; `/tokenize` still
counts a long text whole. The tokenizer is the real model's."""

from __future__ import annotations

import random

import pytest

from services.gateway import context_probe
from services.gateway.generation import Generator
from services.gateway.openai_protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.tokenize_api import tokenize
from shared.engine.model_files import resolve_model_dir
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import PlayedCluster

CONTEXT = 64  # probed past 32 * 64 = 2,048 characters; the prefix 16 * 64 = 1,024
WORDS = ("hello", "world", "the", "quick", "brown", "fox", "Ω", "日本", "émoji😀", "\n", "  ")


@pytest.fixture(scope="module")
def real_tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(resolve_model_dir(None)[0])


class SpiedTokenizer:
    """The real tokenizer, its direct calls' text lengths and its template calls recorded."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self.texts: list[int] = []
        self.templates: list[bool] = []  # each call's `tokenize`

    def __call__(self, text, **kwargs):
        self.texts.append(len(text))
        return self._tokenizer(text, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        self.templates.append(kwargs.get("tokenize", True))
        return self._tokenizer.apply_chat_template(*args, **kwargs)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)


def words(num_chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    parts, size = [], 0
    while size < num_chars:
        parts.append(rng.choice(WORDS) + " ")
        size += len(parts[-1])
    return "".join(parts)


def generator(tokenizer) -> Generator:
    return Generator(PlayedCluster({}), tokenizer, "m", CONTEXT, GatewayEvents(get_logger()))


def completion(text: str):
    return parse_completion_request({"model": "m", "prompt": text}, "m", CONTEXT)


def chat(text: str, num_messages: int = 6):
    step = len(text) // num_messages + 1
    messages = [
        {"role": "user" if i % 2 == 0 else "assistant", "content": text[at : at + step]}
        for i, at in enumerate(range(0, len(text), step))
    ]
    messages[-1]["role"] = "user"
    return parse_chat_request({"model": "m", "messages": messages}, "m", CONTEXT)


def test_a_completion_far_past_the_context_is_refused_from_its_prefix(real_tokenizer):
    spied = SpiedTokenizer(real_tokenizer)
    text = words(50_000)
    with pytest.raises(ApiError) as refused:
        generator(spied).prepare(completion(text), "cmpl")
    assert refused.value.status == 400 and refused.value.param == "prompt"
    assert "longer than this model's context of 64 tokens" in refused.value.message
    assert spied.texts and max(spied.texts) <= 16 * CONTEXT  # never the whole 50,000


def test_a_chat_far_past_the_context_is_refused_before_its_tokenization(real_tokenizer):
    spied = SpiedTokenizer(real_tokenizer)
    with pytest.raises(ApiError) as refused:
        generator(spied).prepare(chat(words(20_000)), "chatcmpl")
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert spied.templates == [False]  # rendered once to text, never tokenized whole
    assert max(spied.texts) <= 16 * CONTEXT


def test_a_long_text_of_long_tokens_is_tokenized_whole_and_served(real_tokenizer):
    """3,000 characters of '#' are some 40 tokens (up to 80 characters a token): the prefix
    is far from twice the context, so nothing is refused that fits."""
    spied = SpiedTokenizer(real_tokenizer)
    text = "#" * 3000
    generation = generator(spied).prepare(completion(text), "cmpl")
    assert generation.prompt_token_ids == real_tokenizer(text).input_ids
    assert len(generation.prompt_token_ids) < CONTEXT
    assert max(spied.texts) == len(text)


def test_a_prompt_under_the_bound_is_not_probed(real_tokenizer):
    spied = SpiedTokenizer(real_tokenizer)
    text = words(2000)  # (under 2,048 characters; past 64 tokens all the same)
    with pytest.raises(ApiError) as refused:
        generator(spied).prepare(completion(text), "cmpl")
    assert "leaves no room for output" in refused.value.message  # the exact count's refusal
    assert spied.texts == [len(text)]  # tokenized once, whole


def test_tokenize_counts_a_long_text_whole(real_tokenizer):
    text = words(50_000)
    body = {"model": "m", "prompt": text}
    answer = tokenize(generator(real_tokenizer), body)
    assert answer["count"] == len(real_tokenizer(text).input_ids) > 2 * CONTEXT


@pytest.mark.parametrize("seed", range(40))
def test_a_prefix_cut_where_it_is_cut_never_has_more_tokens_than_the_whole(real_tokenizer, seed):
    """What the refusal rests on, on the real tokenizer: the prefix's tokens are at most the
    whole text's (cut at the probe's boundary, across scripts, spaces and newlines)."""
    rng = random.Random(seed)
    text = words(rng.randrange(500, 6000), seed)
    cut = context_probe.word_boundary(text, rng.randrange(100, len(text)))
    encode = real_tokenizer
    prefix = encode(text[:cut], add_special_tokens=False).input_ids
    whole = encode(text, add_special_tokens=False).input_ids
    assert len(prefix) <= len(whole)
    assert whole[: len(prefix) - 1] == prefix[:-1]  # the same tokens, but perhaps the last


@pytest.mark.parametrize(
    ("text", "at", "expected"),
    [
        ("aaaa bbbb cccc", 12, 9),  # before " cccc"
        ("aaaa bbbb cccc", 9, 9),  # a space at the cut itself
        ("aaaa bbbb cccc", 8, 8),  # the only space is at the floor (half): none within
        ("aaaa  bbbb", 9, 9),  # the second space follows a space, the first is below half
        ("a" * 20, 10, 10),  # no space: the cut itself
        ("abc de", 5, 3),
    ],
)
def test_word_boundary(text, at, expected):
    assert context_probe.word_boundary(text, at) == expected
