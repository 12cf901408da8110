"""Weight-only int8 against the served float32 path, on SmolLM2's matrix shapes: is it faster?

Issue 14 asked for `--quantization int8` (per-channel scales, like llama.cpp's Q8_0) where a kept
backend makes it faster. torch's CPU kernel for it is `aten._weight_int8pack_mm` (int8 weights,
one scale per output channel, activations in bfloat16 or float32). This times it against the
oneDNN-packed float32 layer the engine uses (`shared.engine.linear`), on the three shapes of a
decode step (attention/MLP projections and the 49,152-row lm_head), at serving batch sizes, in
alternation (medians), and reports the worst relative error of the int8 product.

    .venv/bin/python loadtest/int8_bench.py [--rows 1,8,32] [--repeats 30] [--threads 2]
"""

from __future__ import annotations

import argparse

import torch

from loadtest.engine_bench import paired_medians
from shared.engine.linear import make_linear

# (out_features, in_features) of SmolLM2-135M's matrices: MLP up, MLP down, lm_head.
SHAPES = ((1536, 576), (576, 1536), (49152, 576))


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 with one scale per output row (Q8_0's idea, per row instead of per 32)."""
    scales = weight.abs().amax(dim=1).clamp(min=1e-8) / 127
    return torch.round(weight / scales[:, None]).clamp(-127, 127).to(torch.int8), scales


def measure(shape: tuple[int, int], rows: int, repeats: int) -> dict[str, float]:
    out_features, in_features = shape
    weight = torch.randn(out_features, in_features) / in_features**0.5
    dense = make_linear(weight, None, "auto")
    quantized, scales = quantize_per_channel(weight)
    x = torch.randn(rows, in_features)
    x_bf16, scales_bf16 = x.bfloat16(), scales.bfloat16()
    fns = [
        lambda: dense(x),
        lambda: torch.ops.aten._weight_int8pack_mm(x_bf16, quantized, scales_bf16),
        lambda: torch.ops.aten._weight_int8pack_mm(x, quantized, scales),
    ]
    float32_s, int8_bf16_s, int8_f32_s = paired_medians(fns, repeats)
    exact = x @ weight.T
    error = (torch.ops.aten._weight_int8pack_mm(x, quantized, scales) - exact).norm() / exact.norm()
    return {"float32_ms": float32_s * 1e3, "int8_bf16_ms": int8_bf16_s * 1e3,
            "int8_f32_ms": int8_f32_s * 1e3, "relative_error": error.item()}  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", default="1,8,32", help="batch sizes (rows of activations)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    try:
        rows = [int(r) for r in args.rows.split(",")]
    except ValueError:
        parser.error(f"--rows must be comma-separated integers, got {args.rows!r}")
    if min(rows) < 1 or args.repeats < 1 or args.threads < 1:
        parser.error("--rows, --repeats and --threads must be at least 1")
    torch.set_num_threads(args.threads)
    print(f"{'shape':>12} {'rows':>4} {'float32':>9} {'int8/bf16':>10} {'int8/f32':>9} "
          f"{'f32/int8':>8} {'rel.err':>8}")  # fmt: skip
    for shape in SHAPES:
        for num_rows in rows:
            m = measure(shape, num_rows, args.repeats)
            speedup = m["float32_ms"] / m["int8_bf16_ms"]
            print(f"{shape[0]:>6}x{shape[1]:<5} {num_rows:>4} {m['float32_ms']:>7.3f}ms "
                  f"{m['int8_bf16_ms']:>8.3f}ms {m['int8_f32_ms']:>7.3f}ms {speedup:>7.2f}x "
                  f"{m['relative_error']:>8.4f}")  # fmt: skip


if __name__ == "__main__":
    main()
