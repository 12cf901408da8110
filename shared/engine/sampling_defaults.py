"""Defaults for the sampling fields a request leaves unset (vLLM's `--generation-config` and
`--override-generation-config`).

A field the request does not set takes, in this order:
1. the operator's `--default-sampling` value for it (`"temperature=0.7,top_p=0.9"`);
2. the model's generation config: `generation_config.json` beside its weights, read as vLLM reads
   it (only the sampling fields below; `do_sample` is ignored, as vLLM does). The default model's
   GGUF carries none, so it takes the values its authors use in the model card's example
   (temperature 0.2, top_p 0.9): at OpenAI's temperature 1.0 the 135M model rambles;
3. `SamplingParams`' own defaults, which are OpenAI's (temperature 1, top_p 1, no penalties).
`--generation-config none` skips the second source; a path names another file or directory.
What the request sets always wins.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from types import MappingProxyType
from typing import Any

from shared.errors import InvalidRequestError

# generation_config.json key -> SamplingParams field (the keys vLLM takes from it, but
# max_new_tokens: the API's max_tokens defaults depend on the endpoint and the prompt).
GENERATION_CONFIG_FIELDS: Mapping[str, str] = MappingProxyType(
    {
        "temperature": "temperature",
        "top_p": "top_p",
        "top_k": "top_k",
        "min_p": "min_p",
        "repetition_penalty": "repetition_penalty",
    }
)
# What --default-sampling may set: the numeric fields a model has a sensible default for.
DEFAULTABLE_FIELDS = frozenset(
    {*GENERATION_CONFIG_FIELDS.values(), "presence_penalty", "frequency_penalty"}
)
_INT_FIELDS = frozenset({"top_k"})
# SmolLM2-135M-Instruct's model card generates with these; its GGUF has no generation config.
DEFAULT_MODEL_SAMPLING: Mapping[str, float] = MappingProxyType({"temperature": 0.2, "top_p": 0.9})


def parse_default_sampling(text: str | None) -> dict[str, int | float]:
    """`"temperature=0.7,top_p=0.9"` as a dict, every value checked as `SamplingParams` checks
    it; raises ValueError naming the field and what is wrong."""
    values: dict[str, int | float] = {}
    for item in (text or "").split(","):
        if not item.strip():
            continue
        name, sep, raw = (part.strip() for part in item.partition("="))
        if not sep:
            raise ValueError(f"expected field=value, got {item.strip()!r}")
        if name not in DEFAULTABLE_FIELDS:
            allowed = ", ".join(sorted(DEFAULTABLE_FIELDS))
            raise ValueError(f"{name!r} is not a sampling field with a default (one of {allowed})")
        if name in values:
            raise ValueError(f"{name!r} is given twice")
        values[name] = _number(name, raw)
    checked(values)
    return values


def _number(name: str, raw: str) -> int | float:
    try:
        value = int(raw) if name in _INT_FIELDS else float(raw)
    except ValueError:
        kind = "an integer" if name in _INT_FIELDS else "a number"
        raise ValueError(f"{name} must be {kind}, got {raw!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {raw!r}")
    return value


def checked(values: Mapping[str, Any]) -> Mapping[str, Any]:
    """`values` if `SamplingParams` accepts them all, else ValueError naming the field."""
    from shared.engine.sampling_params import SamplingParams

    try:
        SamplingParams(**values)
    except InvalidRequestError as error:
        raise ValueError(f"{error.param} {error.message}") from None
    return values


def read_generation_config(path: Path) -> dict[str, Any]:
    """The sampling fields of a generation_config.json (a file, or a directory holding one);
    {} when there is none. A file that is there but unreadable is an error, not a silent {}."""
    file = path / "generation_config.json" if path.is_dir() else path
    if not file.is_file():
        return {}
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{file}: not a readable JSON generation config ({error})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{file}: a generation config must be a JSON object")
    values = {
        field: config[key]
        for key, field in GENERATION_CONFIG_FIELDS.items()
        if config.get(key) is not None
    }
    try:
        return dict(checked(values))
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None


def model_sampling_defaults(model_dir: Path, is_default_model: bool, source: str = "auto") -> dict:
    """The model's own defaults (step 2 above): `source` is "auto" (the model's generation
    config), "none", or the path of a generation_config.json or of a directory holding one."""
    if source == "none":
        return {}
    if source != "auto":
        path = Path(source)
        if not path.exists():
            raise ValueError(f"generation config {source!r} does not exist")
        return read_generation_config(path)
    found = read_generation_config(model_dir)
    if not found and is_default_model:
        return dict(DEFAULT_MODEL_SAMPLING)
    return found


def sampling_defaults(
    model_dir: Path, is_default_model: bool, source: str = "auto", overrides: str | None = None
) -> Mapping[str, Any]:
    """Every default a request's unset sampling fields take: the model's, then the operator's."""
    merged = {
        **model_sampling_defaults(model_dir, is_default_model, source),
        **parse_default_sampling(overrides),
    }
    return MappingProxyType(dict(checked(merged)))
