"""Review findings on what a client gets back and how requests are checked, where no existing
module fits: a batch of completion prompts' validation."""

from __future__ import annotations

import pytest

from services.gateway.batched_prompts import split_prompts
from services.gateway.openai_protocol import ApiError, parse_completion_request

MODEL = "m"


@pytest.mark.parametrize("prompt", [["a", 5], [[1, 2], 3], [None, "a"], [[1], {"a": 1}]])
def test_a_batch_mixing_prompts_and_other_values_names_what_a_batch_holds(prompt):
    """A list of two or more that is neither token ids nor prompts (strings, token lists) was
    handed to the one-prompt parser, which told an HTTP /v1/completions client that "a batch
    of prompts is taken by HTTP /v1/completions only": the very endpoint it called."""
    body = {"model": MODEL, "prompt": prompt}
    with pytest.raises(ApiError) as caught:
        bodies = split_prompts(body)
        for one in bodies if bodies is not None else [body]:
            parse_completion_request(one, MODEL, 8192)
    assert (caught.value.status, caught.value.param) == (400, "prompt")
    assert "HTTP /v1/completions only" not in caught.value.message


def test_token_ids_and_batches_still_split_as_before():
    assert split_prompts({"prompt": [1, 2, 3]}) is None  # one prompt of token ids
    assert split_prompts({"prompt": ["a"]}) is None
    bodies = split_prompts({"prompt": ["a", [1, 2]], "n": 2})
    assert bodies == [{"prompt": "a", "n": 2}, {"prompt": [1, 2], "n": 2}]
