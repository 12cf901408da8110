"""The shape of a Llama-family model, read from a Hugging Face config.

Llama, SmolLM, Mistral and Qwen2 share one decoder: RMSNorm, rotary embeddings, grouped-query
attention and a SwiGLU MLP. They differ in a handful of fields, which this dataclass names. Anything
the forward in `model.py` does not implement is refused here, by name, rather than run wrong.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from shared.config import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")
# The rotary variants `rope.py` computes (`dynamic` NTK changes the frequencies with the running
# length, which one cache shared by sequences of different lengths cannot honour).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The keys each one needs besides `rope_type` (transformers requires them too: its KeyError,
# raised wherever a service read the config, was a traceback). The original positions of llama3
# and yarn default to max_position_embeddings.
REQUIRED_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor",),
}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    # Qwen2 puts a bias on the q, k and v projections (not o); Llama's `attention_bias` on all four.
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    # Rotary parameters in transformers' v5 form: at least `rope_theta` and `rope_type`.
    rope_parameters: dict[str, Any] = field(default_factory=lambda: {"rope_type": "default"})
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral's sliding window: a token attends to the `attention_window` before it. Full
    # attention equals it over contexts that fit the window, so the engine serves up to that.
    attention_window: int | None = None

    def __post_init__(self) -> None:
        check_model_type(self.model_type)
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )

    @property
    def rope_theta(self) -> float:
        return float(self.rope_parameters.get("rope_theta", 10000.0))

    @property
    def context_len(self) -> int:
        """The positions the model serves (`context_len`)."""
        return context_len(self.max_position_embeddings, self.rope_parameters)

    @classmethod
    def from_hf(cls, hf_config: Any) -> ModelConfig:
        """Builds the config from a transformers `PretrainedConfig` (v5 `rope_parameters` form);
        ValueError for what the forward does not implement."""
        c = hf_config
        check_served(c)
        num_heads = c.num_attention_heads
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // num_heads
        qkv_bias, o_bias, mlp_bias = _biases(c)
        window = attention_window(c)
        return cls(
            model_type=c.model_type,
            vocab_size=c.vocab_size,
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_layers=c.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(c, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            rms_norm_eps=float(c.rms_norm_eps),
            max_position_embeddings=c.max_position_embeddings,
            tie_word_embeddings=bool(getattr(c, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=mlp_bias,
            rope_parameters=dict(_rope_parameters(c)),
            bos_token_id=getattr(c, "bos_token_id", None),
            eos_token_ids=_as_tuple(getattr(c, "eos_token_id", None)),
            attention_window=window,
        )


def _biases(hf_config: Any) -> tuple[bool, bool, bool]:
    """(q/k/v, o, MLP) biases, as each family's transformers module builds its projections:
    Llama's `attention_bias` and `mlp_bias`; Qwen2's q/k/v always, nothing else; Mistral's none.
    The fields mean nothing to the others (a Mistral config.json naming `attention_bias` loads
    without biases in transformers, where they were asked of the checkpoint and refused)."""
    if hf_config.model_type == "qwen2":
        return True, False, False
    if hf_config.model_type == "mistral":
        return False, False, False
    attention_bias = bool(getattr(hf_config, "attention_bias", False))
    return attention_bias, attention_bias, bool(getattr(hf_config, "mlp_bias", False))


def check_served(hf_config: Any) -> None:
    """ValueError naming what the forward does not compute: a model type, a quantized
    checkpoint, an activation other than SiLU, rotary parameters `rope.py` does not implement.
    Fields are read with transformers' defaults, so a config.json's own fields do as well as a
    transformers config (`check_config_json`: a gateway refuses what its workers would). Rope
    parameters were checked only as the model was built, after every weight was read: past the
    workers' check before loading, a traceback minutes later."""
    # The type before any field is read: another family names them otherwise (GPT-2's
    # n_layer), and an AttributeError on one was raised where the type should have been named.
    check_model_type(getattr(hf_config, "model_type", None))
    _refuse_quantized(hf_config)
    activation = getattr(hf_config, "hidden_act", "silu")
    if activation not in ("silu", "swish"):  # (the MLP's gate is SiLU: model.py)
        raise ValueError(f"hidden_act {activation!r} is not supported (only silu)")
    check_rope_parameters(_rope_parameters(hf_config))


def check_rope_parameters(params: dict[str, Any]) -> None:
    """ValueError unless `rope.py` computes these rotary parameters (transformers' v5 form)."""
    rope_type = params.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_type {rope_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_ROPE_TYPES)})"
        )
    missing = [key for key in REQUIRED_ROPE_KEYS.get(rope_type, ()) if key not in params]
    if missing:
        raise ValueError(
            f"rope_type {rope_type!r} needs {', '.join(map(repr, missing))} in its rope "
            "parameters (rope_scaling / rope_parameters)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:  # (every dimension rotates: rope.py)
        raise ValueError("partial_rotary_factor other than 1.0 is not supported")


def check_model_type(model_type: str | None) -> None:
    """ValueError naming a model type the forward does not implement (`resolve_model_dir`
    checks a model's config.json with it too, before anything reads the rest)."""
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model_type {model_type!r} is not supported (supported: "
            f"{', '.join(SUPPORTED_MODEL_TYPES)})"
        )


def _refuse_quantized(hf_config: Any) -> None:
    """The forward multiplies plain weight matrices: FP8, AWQ, GPTQ or bitsandbytes weights
    (packed integers, or values beside their scales) were refused only after every tensor was
    read, with every projection of every layer named missing or unused."""
    quantization = getattr(hf_config, "quantization_config", None)
    if not quantization:
        return
    if isinstance(quantization, dict):
        method = quantization.get("quant_method")
    else:
        method = getattr(quantization, "quant_method", None)
    raise ValueError(
        f"quantized checkpoints (quantization_config's quant_method {str(method)!r}) are not "
        "supported: serve the model's unquantized weights, or a GGUF file (dequantized on load)"
    )


def attention_window(hf_config: Any) -> int | None:
    """The sliding window some layer of a transformers config attends over, if any: Mistral
    applies one whenever it is set (4096 by default); Qwen2 in the layers its `layer_types`
    name sliding (with `use_sliding_window`, those from `max_window_layers` on). The forward
    attends fully, which equals the window over contexts that fit it: the engine serves up to
    that."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:
        return None
    if hf_config.model_type == "mistral":
        return int(window)
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        slides = "sliding_attention" in layer_types
    else:
        slides = bool(getattr(hf_config, "use_sliding_window", False)) and getattr(
            hf_config, "max_window_layers", 0
        ) < getattr(hf_config, "num_hidden_layers", 0)
    return int(window) if slides else None


def context_len(max_position_embeddings: int, rope_parameters: dict[str, Any]) -> int:
    """The positions a model serves: its `max_position_embeddings`, or as far as linear or yarn
    rope scaling stretches the original positions (Qwen2.5's long-context setting keeps 32,768
    and adds yarn, factor 4: 131,072, as transformers and vLLM serve it). Llama 3's scaling
    states the stretched length itself."""
    if rope_parameters.get("rope_type") not in ("linear", "yarn"):
        return max_position_embeddings
    factor = float(rope_parameters.get("factor") or 1.0)
    original = rope_parameters.get("original_max_position_embeddings") or max_position_embeddings
    return max(max_position_embeddings, int(original * factor))


def served_context_len(hf_config: Any, asked: int | None = None) -> int:
    """The longest context served: `asked` (a max_model_len setting) or the model's, within its
    attention window (past it, full attention's answers differ from the model's). The gateway
    and the engine both take it, so a prompt refused by one is refused by the other. An
    `asked` past the model's positions is refused (ConfigError): the gateway took prompts the
    workers' engines, which serve at most the model's, then failed."""
    model_len = context_len(hf_config.max_position_embeddings, _rope_parameters(hf_config))
    if asked is not None and asked > model_len:
        raise ConfigError(
            f"max_model_len (--max-model-len / TANDEM_MAX_MODEL_LEN) is {asked}, past the "
            f"model's context of {model_len} tokens (max_position_embeddings, with its rope "
            "scaling)"
        )
    longest = asked or model_len
    window = attention_window(hf_config)
    return min(longest, window) if window else longest


def _rope_parameters(c: Any) -> dict[str, Any]:
    params = getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {}
    if not isinstance(params, dict):  # (a config.json's own value: `check_config_json`)
        raise ValueError(f"rope parameters must be an object, got {params!r:.200}")
    params = dict(params)
    params.setdefault("rope_type", params.pop("type", "default"))
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(c, "rope_theta", 10000.0)
    # A config.json may hold it beside the rope fields; transformers moves it in, as here.
    if getattr(c, "partial_rotary_factor", None) is not None:
        params.setdefault("partial_rotary_factor", c.partial_rotary_factor)
    return params


def _as_tuple(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
