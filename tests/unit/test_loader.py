"""The GGUF cache key follows the file's content, so every checkout shares one conversion; the
dtype `auto` follows the hardware."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from shared.engine.loader import generation_eos_ids, parse_dtype, read_safetensors
from shared.engine.model_config import ModelConfig
from shared.engine.model_files import FINGERPRINT_SPAN, gguf_fingerprint
from tests.helpers import tiny_hf_model


def write_file(path, size: int, seed: int = 0):
    path.write_bytes(bytes((i * 31 + seed) % 251 for i in range(size)))
    return path


def test_same_content_at_another_path_and_time_shares_the_key(tmp_path):
    original = write_file(tmp_path / "model.gguf", 3 * FINGERPRINT_SPAN)
    copy_dir = tmp_path / "other-venv"
    copy_dir.mkdir()
    copy = copy_dir / "model.gguf"
    shutil.copyfile(original, copy)
    os.utime(copy, (0, 0))
    assert gguf_fingerprint(original) == gguf_fingerprint(copy)


def test_a_changed_header_tail_or_size_changes_the_key(tmp_path):
    size = 3 * FINGERPRINT_SPAN
    base = gguf_fingerprint(write_file(tmp_path / "base.gguf", size))
    for name, position in (("head.gguf", 10), ("tail.gguf", size - 10)):
        data = bytearray((tmp_path / "base.gguf").read_bytes())
        data[position] ^= 0xFF
        (tmp_path / name).write_bytes(bytes(data))
        assert gguf_fingerprint(tmp_path / name) != base, name
    assert gguf_fingerprint(write_file(tmp_path / "short.gguf", size - 1)) != base


def test_a_file_smaller_than_the_span_is_hashed_whole(tmp_path):
    small = write_file(tmp_path / "small.gguf", 1000)
    other = write_file(tmp_path / "other.gguf", 1000, seed=1)
    assert gguf_fingerprint(small) != gguf_fingerprint(other)


@pytest.mark.parametrize(
    "amx,avx512_bf16,expected",
    [
        (False, False, torch.float32),  # AVX2 only: bfloat16 would be emulated, and slower
        (False, True, torch.bfloat16),
        (True, False, torch.bfloat16),
        (True, True, torch.bfloat16),
    ],
)
def test_auto_dtype_is_bfloat16_where_the_cpu_computes_it(monkeypatch, amx, avx512_bf16, expected):
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    assert parse_dtype("auto", "cpu") == expected
    assert parse_dtype("float32", "cpu") == torch.float32  # an explicit choice stands
    assert parse_dtype("bfloat16", "cpu") == torch.bfloat16


@pytest.mark.parametrize(
    "capability,expected",
    [
        ((7, 5), torch.float32),  # a T4: torch emulates bfloat16 there, slower than float32
        ((7, 0), torch.float32),  # a V100
        ((8, 0), torch.bfloat16),  # an A100
        ((9, 0), torch.bfloat16),  # an H100
    ],
)
def test_auto_dtype_is_bfloat16_where_the_gpu_computes_it(monkeypatch, capability, expected):
    """torch's `is_bf16_supported()` counts emulation too (true on a T4 or a V100), so `auto`
    took bfloat16 on GPUs that do not compute it, against what --dtype's help promises."""

    def is_bf16_supported(including_emulation: bool = True) -> bool:  # as torch answers it
        return including_emulation or capability[0] >= 8

    monkeypatch.setattr(torch.cuda, "is_bf16_supported", is_bf16_supported)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert parse_dtype("auto", "cuda") == expected
    assert parse_dtype("auto", "cuda:1") == expected


def test_auto_dtype_on_this_machine_matches_its_cpu_flags():
    flags = set()
    with open("/proc/cpuinfo") as cpuinfo:
        for line in cpuinfo:
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
                break
    native = bool(flags & {"amx_bf16", "amx_tile", "avx512_bf16"})
    assert parse_dtype("auto") == (torch.bfloat16 if native else torch.float32)


def test_a_wrong_dtype_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        parse_dtype("int4")


def weights_read(directory) -> dict[str, torch.Tensor]:
    return dict(read_safetensors(directory))


def test_the_weights_are_the_files_transformers_reads(tmp_path):
    """Mistral's repositories ship `consolidated.safetensors` (the same weights under Mistral's
    names) beside the shards: every `*.safetensors` was read, and the load failed on names that
    match no layer. Sharded checkpoints are read through their index."""
    hf = tiny_hf_model("mistral", seed=3)
    hf.save_pretrained(tmp_path / "whole")
    state = {name: tensor.clone() for name, tensor in hf.state_dict().items()}
    save_file({"tok_embeddings.weight": state["model.embed_tokens.weight"]},
              str(tmp_path / "whole" / "consolidated.safetensors"))  # fmt: skip
    assert weights_read(tmp_path / "whole").keys() == state.keys()
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="20KB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    save_file({"tok_embeddings.weight": state["model.embed_tokens.weight"]},
              str(tmp_path / "sharded" / "consolidated.safetensors"))  # fmt: skip
    read = weights_read(tmp_path / "sharded")
    assert read.keys() == state.keys()
    assert all(torch.equal(read[name], state[name]) for name in state)


def test_a_whole_checkpoint_is_read_before_an_index_beside_it(tmp_path):
    """transformers reads `model.safetensors` where both it and an index lie (its
    `save_pretrained` of a whole model over a sharded one deletes the shards and leaves their
    index): the index was read first, and the load refused the shards it named as missing."""
    tiny_hf_model("llama", seed=3).save_pretrained(tmp_path, max_shard_size="20KB")
    whole = tiny_hf_model("llama", seed=4)
    whole.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors.index.json").is_file()
    read = weights_read(tmp_path)
    assert all(torch.equal(read[name], tensor) for name, tensor in whole.state_dict().items())


@pytest.mark.parametrize(
    "index, message",
    [
        ('{"weight_map": {"a": "../elsewhere.safetensors"}}', "names shards not in"),
        ('{"weight_map": {"a": "gone.safetensors"}}', "names shards not in"),
        ("[1]", "is not a safetensors index"),
        ("{", "is not a safetensors index"),
    ],
)
def test_a_bad_index_is_named(tmp_path, index, message):
    (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises((ValueError, FileNotFoundError), match=message):
        weights_read(tmp_path)


def test_a_directory_without_weights_says_what_it_looked_for(tmp_path):
    save_file({"x": torch.zeros(1)}, str(tmp_path / "consolidated.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index"):
        weights_read(tmp_path)


def test_the_generation_configs_end_ids_stop_generation_too(tmp_path):
    """Qwen2.5-Instruct lists <|endoftext|> in generation_config.json beside config.json's
    <|im_end|> (early Llama-3-Instruct snapshots, <|eot_id|>): transformers stops on both,
    tandem ran on to max_tokens."""
    config = ModelConfig.from_hf(tiny_hf_model("llama").config)  # eos 2
    assert generation_eos_ids(tmp_path, config) == ()
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": [2, 7, 9, 7]}')
    assert generation_eos_ids(tmp_path, config) == (7, 9)
    (tmp_path / "generation_config.json").write_text('{"eos_token_id": 11}')
    assert generation_eos_ids(tmp_path, config) == (11,)
    # A file that does not say them readably adds none (the model served before it was read).
    for bad in ('{"eos_token_id": [3, 1000]}', '{"eos_token_id": [2, null]}', "[", "[1]"):
        (tmp_path / "generation_config.json").write_text(bad)
        assert generation_eos_ids(tmp_path, config) == ()
