"""The model's linear layers: each weight (and bias) prepared once, at load time, for the fastest
matrix product the device offers.

On the CPU, `F.linear` calls MKL's sgemm, which packs the whole weight into its working layout on
every call; at decode batch sizes (a few rows per step) that repacking is a large part of the
work. oneDNN can pack a weight once into its own blocked layout and multiply straight from it.
Measured on SmolLM2's 121 weight matrices (one decode step's worth), 2 threads of an AMD EPYC,
float32: 1 row 46 -> 27 ms, 8 rows 57 -> 26 ms, 32 rows 94 -> 53 ms, 512 rows 794 -> 644 ms;
bfloat16 gives the same bits as `F.linear`, 8 rows 26 -> 15 ms. float32 results differ from
`F.linear`'s in the last bits (another summation order, as between any two BLAS libraries).

So on CPUs with oneDNN the model keeps its weights packed (`OneDnnLinear`); on CUDA, and for
dtypes the CPU's oneDNN cannot pack (float16 without AVX512-FP16), plain `F.linear`
(`DenseLinear`). `backend="dense"` forces the latter anywhere, for comparisons.

`backend="fp16"` (`HalfWeightLinear`, float32 and bfloat16 models on the CPU): a decode step of
a few rows is bound by streaming the weights from memory, not by arithmetic, so for products of
at most `HALF_WEIGHT_MAX_ROWS[dtype]` rows the weights are read as float16 (FBGEMM's packed
float16 product, float32 in, out and accumulated, as llama.cpp's F16 files are used), and larger
products (prompt chunks, big batches), bound by arithmetic, keep the model dtype's oneDNN path,
which is faster there. Both copies are kept (float32 models: 1.5x the weights' memory; bfloat16:
2x). For float32 the float16 copy halves the bytes; for bfloat16 it streams as many bytes, but
oneDNN's bfloat16 product of 1-3 rows runs well below the memory's speed (SmolLM2's matrices,
one step's worth, one thread of an AVX512-BF16 EPYC: 1 row 25.1 ms in bfloat16 against 15.4
through the float16 copy, 2 rows 29.6 against 15.7, 3 rows 21.9 against 16.8, 4 rows even).
float32, measured on an AVX2 AMD EPYC, one thread, SmolLM2 decode steps at 256 tokens of
context (README, "Precision"): batch 1 113 -> 66 ms, 4 146 -> 97, 8 178 -> 165, 12 229 -> 230;
with float16 for every row count, 16 rows were even and 32 slower (485 -> 572), hence the
threshold. Quality: perplexity within 0.01% of float32 with every product through float16
(`loadtest.perplexity`), but not bit-identical: float32 alone is the reference against
transformers.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F

LINEAR_BACKENDS = ("auto", "onednn", "dense", "fp16")

# The batch size oneDNN picks its weight layout for. Measured at 1 to 256 rows: any hint from 8 to
# 128 gave the same speeds; a hint of 1 made every batch size slower (up to 1.4x at 8 rows).
_PACKING_BATCH_HINT = 32

# Rows up to which `HalfWeightLinear` reads float16 weights, by the model's dtype (measured:
# float32 12 rows faster, 16 even; bfloat16 3 rows faster, 4 even).
HALF_WEIGHT_MAX_ROWS = {torch.float32: 12, torch.bfloat16: 3}


@dataclass(frozen=True)
class DenseLinear:
    weight: torch.Tensor  # [out_features, in_features]
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


@dataclass(frozen=True)
class OneDnnLinear:
    packed: torch.Tensor  # the weight in oneDNN's blocked layout: an opaque `torch._mkldnn` tensor
    bias: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


@dataclass(frozen=True)
class HalfWeightLinear:
    """Activations in the model's dtype; weights read as float16 for products of few rows (see
    the doc), computed in float32 and handed back in the model's dtype."""

    packed: torch.Tensor  # the weight in the model's dtype, oneDNN-packed
    packed_half: torch.ScriptObject  # the float16 copy (and the bias), FBGEMM-packed
    bias: torch.Tensor | None
    max_half_rows: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() <= self.max_half_rows * x.shape[-1]:
            return torch.ops.quantized.linear_dynamic_fp16(x.float(), self.packed_half).to(x.dtype)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


Linear = DenseLinear | OneDnnLinear | HalfWeightLinear


def make_linear(
    weight: torch.Tensor, bias: torch.Tensor | None = None, backend: str = "auto"
) -> Linear:
    """`weight` [out_features, in_features] (and `bias`) as a callable linear layer on `backend`:
    `auto` packs for oneDNN where `onednn_can_pack` says so, `onednn` insists (ValueError where it
    cannot), `dense` never packs."""
    if backend not in LINEAR_BACKENDS:
        choices = ", ".join(LINEAR_BACKENDS)
        raise ValueError(f"linear backend must be one of {choices}, got {backend!r}")
    if backend == "fp16":
        return half_weight_linear(weight, bias)
    packable = onednn_can_pack(weight.dtype, weight.device)
    if backend == "onednn" and not packable:
        raise ValueError(f"oneDNN cannot pack {weight.dtype} weights on {weight.device} here")
    if backend == "dense" or not packable:
        return DenseLinear(weight, bias)
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKING_BATCH_HINT)
    return OneDnnLinear(packed, bias)


def half_weight_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> HalfWeightLinear:
    """The layer, its threshold `HALF_WEIGHT_MAX_ROWS[dtype]` as it is when the layer is made
    (so that a quality measurement can load a model whose every product reads float16)."""
    if weight.dtype not in HALF_WEIGHT_MAX_ROWS or not onednn_can_pack(weight.dtype, weight.device):
        raise ValueError(
            "fp16 weights need a float32 or bfloat16 model on a CPU with oneDNN, got "
            f"{weight.dtype} on {weight.device}"
        )
    if not half_weights_available():
        raise ValueError("fp16 weights need torch's FBGEMM float16 product, absent here")
    weight = weight.contiguous()
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
    packed_half = torch.ops.quantized.linear_prepack_fp16(
        weight.float(), None if bias is None else bias.float()
    )
    return HalfWeightLinear(packed, packed_half, bias, HALF_WEIGHT_MAX_ROWS[weight.dtype])


@functools.cache
def half_weights_available() -> bool:
    """Whether this torch build has FBGEMM's float16-weight product (x86 CPUs)."""
    try:
        packed = torch.ops.quantized.linear_prepack_fp16(torch.ones(4, 4), None)
        out = torch.ops.quantized.linear_dynamic_fp16(torch.ones(1, 4), packed)
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 4), 4.0)))


def onednn_can_pack(dtype: torch.dtype, device: torch.device | str) -> bool:
    """Whether weights of this dtype on this device can be packed for oneDNN: CPU only, and
    decided by trying (which dtypes pack depends on the CPU and on torch's build)."""
    return torch.device(device).type == "cpu" and _onednn_packs(dtype)


@functools.cache
def _onednn_packs(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    weight = torch.ones(4, 4, dtype=dtype)
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, _PACKING_BATCH_HINT)
        out = OneDnnLinear(packed)(torch.ones(1, 4, dtype=dtype))
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return bool(torch.equal(out, torch.full((1, 4), 4.0, dtype=dtype)))
