"""The model's linear layers (`shared.engine.linear`): oneDNN-packed weights against `F.linear`."""

import pytest
import torch
import torch.nn.functional as F

from shared.engine.linear import (
    HALF_WEIGHT_MAX_ROWS,
    DenseLinear,
    HalfWeightLinear,
    OneDnnLinear,
    half_weights_available,
    make_linear,
    onednn_can_pack,
)

needs_onednn = pytest.mark.skipif(
    not onednn_can_pack(torch.float32, "cpu"), reason="torch has no oneDNN on this CPU"
)
needs_half_weights = pytest.mark.skipif(
    not (half_weights_available() and onednn_can_pack(torch.float32, "cpu")),
    reason="torch has no FBGEMM float16 product or no oneDNN on this CPU",
)


def random_weights(out_features: int, in_features: int, dtype=torch.float32):
    gen = torch.Generator().manual_seed(out_features * 1000 + in_features)
    weight = torch.randn(out_features, in_features, generator=gen).to(dtype)
    bias = torch.randn(out_features, generator=gen).to(dtype)
    return weight, bias


@needs_onednn
def test_auto_packs_float32_on_the_cpu():
    weight, _ = random_weights(8, 8)
    assert isinstance(make_linear(weight), OneDnnLinear)
    assert isinstance(make_linear(weight, backend="dense"), DenseLinear)


@needs_onednn
@pytest.mark.parametrize("rows", [1, 3, 8, 33, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_matches_f_linear(rows, with_bias):
    """Awkward sizes (rows, and features that are not multiples of a vector width)."""
    weight, bias = random_weights(97, 61)
    bias = bias if with_bias else None
    x = torch.randn(rows, 61, generator=torch.Generator().manual_seed(rows))
    packed = make_linear(weight, bias, backend="onednn")
    torch.testing.assert_close(packed(x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)


@needs_onednn
def test_packed_takes_strided_and_empty_inputs():
    weight, bias = random_weights(16, 32)
    packed = make_linear(weight, bias, backend="onednn")
    strided = torch.randn(5, 64)[:, ::2]
    torch.testing.assert_close(packed(strided), F.linear(strided, weight, bias))
    assert packed(torch.empty(0, 32)).shape == (0, 16)


def test_bfloat16_packed_where_the_cpu_can():
    weight, bias = random_weights(40, 24, torch.bfloat16)
    x = torch.randn(6, 24).to(torch.bfloat16)
    layer = make_linear(weight, bias)
    expected_kind = OneDnnLinear if onednn_can_pack(torch.bfloat16, "cpu") else DenseLinear
    assert isinstance(layer, expected_kind)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias))


def test_no_packing_off_the_cpu():
    weight = torch.empty(4, 4, device="meta")
    assert not onednn_can_pack(torch.float32, "meta")
    assert isinstance(make_linear(weight), DenseLinear)
    with pytest.raises(ValueError, match="oneDNN cannot pack"):
        make_linear(weight, backend="onednn")


def test_unknown_backend_is_refused_by_name():
    weight, _ = random_weights(4, 4)
    with pytest.raises(ValueError, match="linear backend must be one of auto, onednn, dense"):
        make_linear(weight, backend="mkl")


@needs_half_weights
@pytest.mark.parametrize("with_bias", [False, True])
def test_fp16_weights_serve_few_rows_and_float32_the_rest(with_bias):
    """Up to the threshold the product is the float16-rounded weight's (float32 arithmetic);
    past it, the float32 oneDNN product, exactly."""
    weight, bias = random_weights(97, 61)
    bias = bias if with_bias else None
    layer = make_linear(weight, bias, backend="fp16")
    assert isinstance(layer, HalfWeightLinear)
    half_rounded = weight.half().float()
    limit = HALF_WEIGHT_MAX_ROWS[torch.float32]
    for rows in (1, 5, limit):
        x = torch.randn(rows, 61, generator=torch.Generator().manual_seed(rows))
        torch.testing.assert_close(layer(x), F.linear(x, half_rounded, bias), rtol=1e-5, atol=1e-4)
        assert not torch.allclose(layer(x), F.linear(x, weight, bias), rtol=0, atol=1e-6)
    x = torch.randn(limit + 1, 61)
    packed = make_linear(weight, bias, backend="onednn")
    assert torch.equal(layer(x), packed(x))


@needs_half_weights
def test_fp16_weights_count_rows_over_every_leading_dimension():
    weight, bias = random_weights(16, 32)
    layer = make_linear(weight, bias, backend="fp16")
    few = torch.randn(2, 3, 32)  # 6 rows: float16 weights
    torch.testing.assert_close(layer(few), F.linear(few, weight.half().float(), bias))
    many = torch.randn(2, HALF_WEIGHT_MAX_ROWS[torch.float32], 32)  # float32
    assert torch.equal(layer(many), make_linear(weight, bias, backend="onednn")(many))


def test_fp16_weights_need_a_float32_or_bfloat16_model_on_the_cpu():
    weight, _ = random_weights(8, 8, torch.float16)
    with pytest.raises(ValueError, match="fp16 weights need a float32 or bfloat16 model"):
        make_linear(weight, backend="fp16")
    with pytest.raises(ValueError, match="fp16 weights need a float32 or bfloat16 model"):
        make_linear(torch.empty(4, 4, device="meta"), backend="fp16")


@needs_half_weights
@pytest.mark.skipif(
    not onednn_can_pack(torch.bfloat16, "cpu"), reason="this CPU's oneDNN packs no bfloat16"
)
def test_fp16_weights_of_a_bfloat16_model_serve_few_rows_and_bfloat16_the_rest():
    """Up to the bfloat16 threshold: the float16-rounded weight's product in float32, handed
    back in bfloat16; past it, the bfloat16 oneDNN product, exactly."""
    weight, bias = random_weights(97, 61)
    weight, bias = weight.bfloat16(), bias.bfloat16()
    layer = make_linear(weight, bias, backend="fp16")
    limit = HALF_WEIGHT_MAX_ROWS[torch.bfloat16]
    assert layer.max_half_rows == limit
    half_rounded = weight.float().half().float()
    for rows in (1, limit):
        x = torch.randn(rows, 61, generator=torch.Generator().manual_seed(rows)).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16
        expected = F.linear(x.float(), half_rounded, bias.float()).bfloat16()
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=1e-2)
    x = torch.randn(limit + 1, 61).bfloat16()
    assert torch.equal(layer(x), make_linear(weight, bias, backend="onednn")(x))
