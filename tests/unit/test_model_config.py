"""`ModelConfig.from_hf`: a config the forward does not implement is refused by name."""

from __future__ import annotations

import pytest
from transformers import GPT2Config

from shared.engine.model_config import ModelConfig


def test_an_unsupported_model_type_is_refused_by_name_before_its_fields_are_read():
    """GPT-2's config names its fields otherwise (n_inner, n_layer): it failed with
    "AttributeError: 'GPT2Config' object has no attribute 'intermediate_size'"."""
    with pytest.raises(ValueError, match=r"^model_type 'gpt2' is not supported \(supported: "):
        ModelConfig.from_hf(GPT2Config())


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0},
        {"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [1.0] * 8},
        {"rope_type": "default", "partial_rotary_factor": 0.5},
    ],
    ids=["dynamic", "longrope", "partial"],
)
def test_rope_parameters_the_forward_does_not_compute_are_refused_by_the_config(rope):
    """They were refused only when the model was built, after every weight was read: a worker's
    check before loading (`ModelConfig.from_hf`) let them through, so the refusal came minutes
    later as a traceback."""
    from transformers import AutoConfig

    from tests.helpers import TINY_LLAMA

    config = AutoConfig.for_model("llama", **TINY_LLAMA, rope_parameters=rope)
    with pytest.raises(
        ValueError, match=r"(rope_type '\w+'|partial_rotary_factor) .*not supported"
    ):
        ModelConfig.from_hf(config)
