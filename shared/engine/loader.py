"""Loading a model: its weights into tandem's Llama implementation at a dtype, on a device, with
the linear and decode-attention backends chosen; its tokenizer. Where its files come from (a
Hugging Face directory, a GGUF converted once into a cache) is `shared.engine.model_files`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from kernels import cpu_decode_attention
from kernels.cpu_decode_attention import CpuDecodeAttention
from shared.config import cache_dir
from shared.engine.linear import HALF_WEIGHT_MAX_ROWS, half_weights_available
from shared.engine.model import LlamaModel, load_hf_weights
from shared.engine.model_config import ModelConfig
from shared.engine.model_files import resolve_model_dir

# float32's greedy tokens equal transformers'. bfloat16 halves the bytes every decode step streams
# and runs about twice as fast where the hardware computes it natively, which `auto` (the default)
# picks; elsewhere bfloat16 is emulated and slower than float32, so `auto` keeps float32 there.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DTYPE_CHOICES = ("auto", *DTYPES)
QUANTIZATION_CHOICES = ("none", "fp16")
QUANTIZATION_HELP = (
    "none, or fp16: a float32 or bfloat16 model on the CPU reads its weights as float16 for "
    "products of a few rows (decode steps of small batches: FBGEMM's float16 product, float32 "
    "arithmetic; perplexity as float32's, tokens not bit-identical; a second copy of the weights)"
)


DECODE_ATTENTION_CHOICES = ("auto", "native", "reference")
DECODE_ATTENTION_HELP = (
    "decode attention of a bfloat16 model on the CPU: auto (the C kernel, compiled on first use "
    "with the system's C compiler, where one is found; else the torch reference), native (the C "
    "kernel or an error), reference (torch)"
)


def linear_backend_for(quantization: str, dtype: torch.dtype, device: torch.device) -> str:
    """The linear layers' backend (`shared.engine.linear`) for a quantization setting, refused
    with a clear ValueError where it cannot run."""
    if quantization not in QUANTIZATION_CHOICES:
        choices = ", ".join(QUANTIZATION_CHOICES)
        raise ValueError(f"quantization must be one of {choices}, got {quantization!r}")
    if quantization == "none":
        return "auto"
    if device.type != "cpu" or dtype not in HALF_WEIGHT_MAX_ROWS:  # the dtypes it serves
        raise ValueError(
            "quantization fp16 needs a float32 or bfloat16 model on the CPU, got "
            f"{dtype_name(dtype)} on {device} (set --dtype float32 or bfloat16)"
        )
    if not half_weights_available():
        raise ValueError("quantization fp16 needs torch's FBGEMM float16 product (x86 CPUs)")
    return "fp16"


DTYPE_HELP = (
    "weights, activations and KV cache: auto (bfloat16 where the CPU has AMX or AVX512-BF16 or "
    "the GPU computes bfloat16, else float32), float32 (greedy output equals transformers'), "
    "bfloat16, float16"
)


@dataclass
class LoadedModel:
    model: LlamaModel
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer
    path: Path  # the Hugging Face directory the weights came from (the cache, for a GGUF)
    name: str  # the name the API reports


def decode_kernel_for(
    setting: str, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> CpuDecodeAttention | None:
    """The decode attention kernel `setting` asks for (None: the torch reference); `native`
    raises ValueError where the kernel cannot serve the model or be built, `auto` then falls
    back to the reference."""
    if setting not in DECODE_ATTENTION_CHOICES:
        choices = ", ".join(DECODE_ATTENTION_CHOICES)
        raise ValueError(f"decode attention must be one of {choices}, got {setting!r}")
    if setting == "reference":
        return None
    shape = (config.num_heads, config.num_kv_heads, config.head_dim)
    if not cpu_decode_attention.supports(dtype, device, *shape):
        if setting == "native":
            raise ValueError(
                "the native decode attention serves bfloat16 models on the CPU with head_dim up "
                f"to {cpu_decode_attention.MAX_HEAD_DIM} and up to "
                f"{cpu_decode_attention.MAX_GROUP} query heads per KV head, got "
                f"{dtype_name(dtype)} on {device}, head_dim {config.head_dim}, "
                f"{config.num_heads // config.num_kv_heads} query heads per KV head"
            )
        return None
    try:
        return cpu_decode_attention.build(cache_dir() / "kernels")
    except cpu_decode_attention.KernelUnavailable as error:
        if setting == "native":
            raise ValueError(f"the native decode attention is unavailable: {error}") from None
        logging.getLogger(__name__).warning(
            "decode attention falls back to the torch reference: %s", error
        )
        return None


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files of a Hugging Face checkpoint, as transformers picks them:
    `model.safetensors`, else the shards `model.safetensors.index.json` names (an index beside
    a whole file is transformers' leftover: its `save_pretrained` of a whole model over a
    sharded one deletes the shards, not their index). Other files are left alone: Mistral's
    repositories ship `consolidated.safetensors` beside the shards, the same weights under
    Mistral's own names."""
    if (directory / "model.safetensors").is_file():
        return [directory / "model.safetensors"]
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"{index} is not a safetensors index: {error!r}") from None
        files = [directory / name for name in names]
        missing = [str(f) for f in files if not f.is_file() or f.parent != directory]
        if missing:
            raise FileNotFoundError(f"{index} names shards not in {directory}: {missing}")
        return files
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {directory}")


def read_safetensors(directory: Path):
    for file in safetensors_files(directory):
        with safe_open(str(file), framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 - safe_open is not a dict
                yield name, handle.get_tensor(name)


def parse_dtype(name: str, device: torch.device | str = "cpu") -> torch.dtype:
    """A dtype setting as a torch dtype; `auto` is resolved for the device."""
    if name == "auto":
        return torch.bfloat16 if native_bfloat16(torch.device(device)) else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
    return DTYPES[name]


def native_bfloat16(device: torch.device) -> bool:
    """Whether the device computes bfloat16 matrix products in hardware: a CUDA GPU of compute
    capability 8 (Ampere) or later, or a CPU with AMX tiles or AVX512-BF16 (oneDNN's fast bf16
    paths). Elsewhere (an AVX2-only CPU, a T4 or V100) bfloat16 is emulated and slower than
    float32 (`torch.cuda.is_bf16_supported()` counts emulation, so it is not the test)."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    checks = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
    return any(getattr(torch.cpu, check, lambda: False)() for check in checks)


def dtype_name(dtype: torch.dtype) -> str:
    return next(name for name, value in DTYPES.items() if value == dtype)


DEVICE_HELP = "where the model and its KV cache live: cpu, cuda or cuda:N"


def parse_device(name: str) -> torch.device:
    """A torch device from a setting, refused with a clear error before any weight is loaded:
    `cpu`, `cuda` or `cuda:N`, the CUDA ones only where torch sees that GPU."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        device = None
    if (
        device is None
        or device.type not in ("cpu", "cuda")
        or (device.type == "cpu" and device.index is not None)
    ):
        raise ValueError(f"device must be cpu, cuda or cuda:N, got {name!r}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {name!r}: torch sees no CUDA GPU on this machine")
        if (device.index or 0) >= torch.cuda.device_count():
            raise ValueError(f"device {name!r}: torch sees {torch.cuda.device_count()} CUDA GPU(s)")
    return device


def device_argument(name: str) -> str:
    """`parse_device` as an argparse `type=`: a bad device exits with status 2, naming the flag."""
    try:
        parse_device(name)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    return name


def generation_eos_ids(directory: Path, config: ModelConfig) -> tuple[int, ...]:
    """The end-of-sequence ids `generation_config.json` adds to the config's: transformers'
    `generate` and vLLM stop on these too (Qwen2.5-Instruct lists <|endoftext|> there beside
    config.json's <|im_end|>; early Llama-3-Instruct snapshots, <|eot_id|>). A file that does
    not say them readably is left out with a warning: the model served before it was read."""
    file = directory / "generation_config.json"
    if not file.is_file():
        return ()
    try:
        found = json.loads(file.read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError) as error:
        logging.getLogger(__name__).warning(
            "%s is unreadable (%r); its end ids are left out", file, error
        )
        return ()
    ids = [found] if type(found) is int else found if isinstance(found, list) else []
    if not all(type(i) is int and 0 <= i < config.vocab_size for i in ids):
        logging.getLogger(__name__).warning(
            "%s: eos_token_id %.200r is not the model's token ids; left out", file, found
        )
        return ()
    return tuple(i for i in dict.fromkeys(ids) if i not in config.eos_token_ids)


def load_model(
    model: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    linear_backend: str = "auto",
    decode_attention: str = "auto",
) -> LoadedModel:
    from transformers import AutoConfig, AutoTokenizer

    directory, name = resolve_model_dir(model)
    config = ModelConfig.from_hf(AutoConfig.from_pretrained(directory))
    config = dataclasses.replace(
        config, eos_token_ids=(*config.eos_token_ids, *generation_eos_ids(directory, config))
    )
    weights = load_hf_weights(
        config,
        read_safetensors(directory),
        dtype,
        device,
        max_positions=max_model_len,
        linear_backend=linear_backend,
        decode_kernel=decode_kernel_for(decode_attention, config, dtype, torch.device(device)),
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    return LoadedModel(weights, config, tokenizer, directory, name)
