"""`/tokenize` and `/detokenize` bodies (services.gateway.tokenize_api) against a stand-in
generator: JSON null is "not given" there as on the endpoints whose bodies they take."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import pytest

from services.gateway.openai_protocol import ApiError
from services.gateway.tokenize_api import detokenize, tokenize, tokenize_async

MODEL = "smollm2"


class _Tokenizer:
    def convert_ids_to_tokens(self, ids):
        return [f"t{i}" for i in ids]

    def decode(self, ids, skip_special_tokens=False):
        return " ".join(f"t{i}" for i in ids)


def _generator():
    return SimpleNamespace(
        model_name=MODEL,
        max_model_len=64,
        vocab_size=100,
        tokenizer=_Tokenizer(),
        tokenize=lambda request, *flags: request.prompt_token_ids or [7, 8, 9],
    )


@pytest.mark.parametrize(
    "body",
    [
        {"model": None, "prompt": [1, 2]},
        {"prompt": [1, 2], "messages": None},
        {"messages": [{"role": "user", "content": "Hi"}], "prompt": None},
        {"prompt": [1, 2], "return_token_strs": None},
    ],
)
def test_null_fields_are_not_given(body):
    answer = tokenize(_generator(), body)
    assert answer["count"] == len(answer["tokens"]) and "token_strs" not in answer


def test_detokenize_takes_a_null_model():
    assert detokenize(_generator(), {"model": None, "tokens": [1, 2]}) == {"prompt": "t1 t2"}


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "other", "prompt": [1]}, "model"),
        ({"model": 3, "prompt": [1]}, "model"),
        ({"prompt": [1], "messages": [{"role": "user", "content": "Hi"}]}, "prompt"),
        ({}, None),
        ({"prompt": [1], "return_token_strs": 1}, "return_token_strs"),
        ({"prompt": [1], "return_token_strs": 0}, "return_token_strs"),
    ],
)
def test_bad_bodies_are_refused(body, param):
    with pytest.raises(ApiError) as info:
        tokenize(_generator(), body)
    assert info.value.param == param and info.value.status in (400, 404)


def test_a_short_prompt_is_answered_and_rendered_inline():
    """(The stand-in has no threads to hand work to: a short prompt needs none.)"""
    body = {"prompt": "Hi", "return_token_strs": True}
    rendered = asyncio.run(tokenize_async(_generator(), body, json.dumps))
    assert json.loads(rendered) == tokenize(_generator(), body)
    assert asyncio.run(tokenize_async(_generator(), body)) == tokenize(_generator(), body)
