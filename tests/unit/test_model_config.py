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
