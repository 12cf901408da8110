"""`load_hf_weights`: a checkpoint whose tensors do not have the shapes its config.json implies
is refused at load, naming them, as transformers refuses it ("size mismatch")."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from shared.engine.model import load_hf_weights
from shared.engine.model_config import ModelConfig
from tests.helpers import TINY_LLAMA, tiny_hf_model


@pytest.fixture(scope="module")
def hf_llama():
    return tiny_hf_model("llama", seed=3)


@pytest.mark.parametrize(
    "change, named",
    [
        # Split at the first step (a worker that registered, then failed every request).
        ({"num_kv_heads": 4}, "k_proj.weight"),
        ({"head_dim": 8}, "q_proj.weight"),
        # Ran: token ids up to 299 passed the engine's check and indexed past the embedding.
        ({"vocab_size": 300}, "embed_tokens.weight"),
        # Ran: the sampler drew ids past the vocabulary the engine checks tokens against.
        ({"vocab_size": 200}, "lm_head.weight"),
        ({"intermediate_size": 64}, "gate_proj.weight"),
        ({"hidden_size": 32}, "input_layernorm.weight"),
    ],
)
def test_weights_shaped_unlike_the_config_are_refused(hf_llama, change, named):
    config = dataclasses.replace(ModelConfig.from_hf(hf_llama.config), **change)
    with pytest.raises(ValueError, match=f"weights do not match the config: .*{named}"):
        load_hf_weights(config, hf_llama.state_dict().items())


def test_weights_shaped_as_the_config_says_load(hf_llama):
    config = ModelConfig.from_hf(hf_llama.config)
    model = load_hf_weights(config, hf_llama.state_dict().items())
    assert model.embed_tokens.shape == (config.vocab_size, config.hidden_size)


@pytest.mark.parametrize(
    "quantization",
    [
        {"quant_method": "fp8", "activation_scheme": "dynamic"},
        {"quant_method": "awq", "bits": 4, "group_size": 128},
    ],
)
def test_a_quantized_checkpoint_is_refused_by_name(quantization):
    """FP8, AWQ, GPTQ or bitsandbytes weights are not plain matrices: such a checkpoint was
    refused only after every tensor was read, with every projection of every layer listed as
    missing or unused (hundreds of names for a 7B model), never saying why."""
    from transformers import AutoConfig

    config = AutoConfig.for_model("llama", **TINY_LLAMA, quantization_config=quantization)
    method = quantization["quant_method"]
    with pytest.raises(ValueError, match=f"quantized checkpoints .*'{method}'.* not supported"):
        ModelConfig.from_hf(config)


def test_tied_embeddings_stored_as_the_lm_head_alone_load():
    """A tied checkpoint holds one tensor; transformers ties it whichever of the two names it is
    stored under. Stored as `lm_head.weight` alone, the load refused the embedding as missing."""
    hf = tiny_hf_model("llama", seed=3, tie_word_embeddings=True)
    state = dict(hf.state_dict())
    embedding = state.pop("model.embed_tokens.weight")
    state["lm_head.weight"] = embedding
    model = load_hf_weights(ModelConfig.from_hf(hf.config), state.items())
    assert torch.equal(model.embed_tokens, embedding)
    hidden = torch.randn(3, hf.config.hidden_size)
    assert torch.allclose(model.lm_head(hidden), hidden @ embedding.T, atol=1e-5)
