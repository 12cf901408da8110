"""`resolve_model_dir`: a --model tandem cannot read is a ConfigError naming the setting (one
line and exit status 2 at every command), not transformers' traceback."""

from __future__ import annotations

import json
import re

import pytest

from shared.config import ConfigError
from shared.engine.model_files import resolve_model_dir


@pytest.mark.parametrize(
    "content",
    [b"not a GGUF file", b"GGUF\x03\x00\x00\x00\x01"],  # (the second: its header cut short)
    ids=["not-gguf", "cut-short"],
)
def test_a_gguf_file_that_is_none_is_refused_naming_model(tmp_path, monkeypatch, content):
    """transformers' ValueError (struct.error, cut short) was a traceback at a standalone
    prefill, decode or gateway service."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^--model {re.escape(str(fake))}: "):
        resolve_model_dir(fake)


@pytest.mark.parametrize("content", ["{not json", "[]"])
def test_a_config_json_that_is_not_json_is_refused_naming_model(tmp_path, content):
    """transformers' OSError, read first by a service's AutoConfig or AutoTokenizer, was a
    traceback at a standalone prefill, decode or gateway service."""
    (tmp_path / "config.json").write_text(content)
    refusal = f"^--model {re.escape(str(tmp_path))}: .*config.json is not .*JSON"
    with pytest.raises(ConfigError, match=refusal):
        resolve_model_dir(tmp_path)


def test_a_model_type_not_served_is_refused_naming_model(tmp_path):
    """Refused by the workers' model config (`ModelConfig.from_hf`) alone, a gateway started
    alone took the model, and a standalone worker refused it in a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    refusal = f"^--model {re.escape(str(tmp_path))}: model_type 'gpt2' is not supported"
    with pytest.raises(ConfigError, match=refusal):
        resolve_model_dir(tmp_path)


@pytest.mark.parametrize(
    "fields, refusal",
    [
        ({"quantization_config": {"quant_method": "awq"}}, "quantized checkpoints"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, "rope_type 'dynamic'"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ({"rope_scaling": "yarn"}, "rope parameters must be an object"),
        # (transformers' KeyError, a traceback where a service reads the config)
        ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_type 'llama3' needs"),
        ({"rope_scaling": {"rope_type": "linear"}}, "rope_type 'linear' needs 'factor'"),
    ],
    ids=[
        "quantized",
        "gelu",
        "dynamic-rope",
        "partial-rope",
        "rope-not-object",
        "llama3-incomplete",
        "linear-incomplete",
    ],
)
def test_a_config_the_forward_does_not_compute_is_refused_naming_model(tmp_path, fields, refusal):
    """The workers' model config refused them, but a gateway (which reads config.json through
    `resolve_model_dir` alone) took the model and served a cluster whose workers never came."""
    config = {"model_type": "llama", "hidden_size": 64, "num_attention_heads": 4, **fields}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match=f"^--model {re.escape(str(tmp_path))}: {refusal}"):
        resolve_model_dir(tmp_path)


def write_tiny_gguf(
    path,
    architecture: str = "llama",
    weight_type=None,
    with_layer: bool = False,
    down_columns: int = 64,
) -> None:
    """A one-layer GGUF of `architecture` (hidden size 32, MLP 64), with a tokenizer: its
    embedding stored as `weight_type` (float32 by default) and its final norm, and with
    `with_layer` its layer's weights (random, float32; ffn_down `down_columns` wide) too."""
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGUFWriter

    writer = GGUFWriter(str(path), architecture)
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(32)
    writer.add_feed_forward_length(64)
    writer.add_head_count(2)
    writer.add_head_count_kv(2)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(16)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>", *(f"\u2581t{i}" for i in range(13))])
    writer.add_token_scores([0.0] * 16)
    writer.add_token_types([2, 3, 3, *[1] * 13])
    if weight_type is None:
        writer.add_tensor("token_embd.weight", np.zeros((16, 32), dtype=np.float32))
    else:
        block, block_bytes = GGML_QUANT_SIZES[weight_type]
        embedding = np.zeros((16, 128 // block * block_bytes), dtype=np.uint8)
        writer.add_tensor("token_embd.weight", embedding, embedding.shape, weight_type)
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    shapes = {"attn_norm": (32,), "ffn_norm": (32,), "ffn_down": (32, down_columns)}
    shapes |= {name: (32, 32) for name in ("attn_q", "attn_k", "attn_v", "attn_output")}
    shapes |= {name: (64, 32) for name in ("ffn_gate", "ffn_up")}
    random = np.random.default_rng(0)
    for name, shape in shapes.items() if with_layer else ():
        writer.add_tensor(f"blk.0.{name}.weight", random.standard_normal(shape, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_gguf_of_weights_transformers_cannot_dequantize_is_refused_naming_model(
    tmp_path, monkeypatch
):
    """gguf-py's NotImplementedError for a weight type it cannot dequantize (Q1_0 here) was a
    traceback at every service, where a .gguf that cannot be read is one line."""
    from gguf import GGMLQuantizationType

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, weight_type=GGMLQuantizationType.Q1_0)
    with pytest.raises(ConfigError, match=f"^--model {re.escape(str(path))}: .*Q1_0"):
        resolve_model_dir(path)


def test_a_gguf_of_a_model_type_not_served_is_refused_before_it_is_converted(tmp_path, monkeypatch):
    """It was dequantized into the cache first (float32 safetensors: four times a 4-bit
    file's size, minutes for a 7B model), and refused only then, its conversion left on disk."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_gguf(path, "qwen3")
    with pytest.raises(ConfigError, match=f"^--model {re.escape(str(path))}: .*'qwen3'"):
        resolve_model_dir(path)
    assert not any((tmp_path / "cache").glob("*/model.safetensors"))


@pytest.mark.parametrize("kind", ["partial", "misshapen"])
def test_a_gguf_that_lacks_weights_is_refused_naming_them(tmp_path, monkeypatch, kind):
    """transformers draws the weights a GGUF lacks at random (a warning in its log): the
    conversion cached them, and the model was served with them, its every answer noise. One
    shaped otherwise was its RuntimeError, a traceback at every service. A whole one converts
    (its tied output head is no missing weight)."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    bad, whole = tmp_path / f"{kind}.gguf", tmp_path / "whole.gguf"
    write_tiny_gguf(bad, with_layer=kind == "misshapen", down_columns=48)
    write_tiny_gguf(whole, "llama", with_layer=True)
    refusal = f"^--model {re.escape(str(bad))}: .*lacks .*'model.layers.0.mlp.down_proj.weight'"
    with pytest.raises(ConfigError, match=refusal):
        resolve_model_dir(bad)
    assert not any((tmp_path / "cache").glob(f"{kind}-*"))
    directory, name = resolve_model_dir(whole)
    assert name == "whole" and (directory / "model.safetensors").is_file()
