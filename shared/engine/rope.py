"""Rotary position embeddings, with the frequency-scaling variants Llama-family configs use.

The inverse frequencies depend only on the config; cos and sin are precomputed for every position
up to the model's context and looked up by position, so a batch that mixes sequences at different
positions costs one gather. Rotation is the "rotate half" form transformers' Llama uses (the two
halves of the head dimension form the complex pairs).

Variants: `default`, `linear` (positions divided by a factor), `llama3` (Llama 3.1's smooth
frequency-band scaling) and `yarn` (interpolation ramp plus an attention temperature folded into
cos/sin). `dynamic` NTK changes the frequencies with the running sequence length, which a paged
cache shared by sequences of different lengths cannot honour, so it is refused.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from shared.engine.model_config import check_rope_parameters


def inverse_frequencies(
    params: dict[str, Any], head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """Returns (inv_freq [head_dim/2], attention_scaling) for the config's rope parameters;
    ValueError for those `check_rope_parameters` refuses."""
    check_rope_parameters(params)
    rope_type = params.get("rope_type", "default")
    base = float(params.get("rope_theta", 10000.0))
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base**exponents)
    if rope_type == "default":
        return inv_freq, 1.0
    if rope_type == "linear":
        return inv_freq / params["factor"], 1.0
    if rope_type == "llama3":
        return _llama3(inv_freq, params), 1.0
    return _yarn(base, head_dim, params, max_position_embeddings)  # (the last type checked)


def _llama3(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = params["factor"]
    low_freq_factor = params["low_freq_factor"]
    high_freq_factor = params["high_freq_factor"]
    old_context_len = params["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, blended, scaled)


def _yarn(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = params.get("original_max_position_embeddings") or max_position_embeddings
    factor = params.get("factor") or max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    beta_fast = params.get("beta_fast") or 32
    beta_slow = params.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the ramp below would divide by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = interpolation * ramp + extrapolation * (1 - ramp)
    return inv_freq, float(attention_factor)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


class RotaryEmbedding:
    """cos/sin tables for positions [0, max_positions), applied to q and k in place of a module."""

    def __init__(
        self,
        params: dict[str, Any],
        head_dim: int,
        max_positions: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        max_position_embeddings: int | None = None,
    ):
        """`max_position_embeddings`: the model's (yarn derives its factor from it when none is
        given), which may differ from the positions served; by default `max_positions`."""
        inv_freq, scaling = inverse_frequencies(
            params, head_dim, max_position_embeddings or max_positions
        )
        positions = torch.arange(max_positions, dtype=torch.int64).float()
        freqs = torch.outer(positions, inv_freq)
        # [max_positions, head_dim]: each frequency appears for both halves (rotate-half layout).
        angles = torch.cat([freqs, freqs], dim=-1)
        self.cos = (angles.cos() * scaling).to(dtype=dtype, device=device)
        self.sin = (angles.sin() * scaling).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for the positions, [tokens, 1, head_dim]: once per step, for every layer."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)

    def __call__(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]; returns rotated copies."""
        cos, sin = self.lookup(positions)
        return apply_rotary(q, k, cos, sin)


def apply_rotary(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin
