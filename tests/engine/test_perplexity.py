"""The quality check's arithmetic, on the real model: our perplexity equals the one computed from
transformers' logits on the same windows, and float32 agrees with itself exactly."""

import math
import sys

import pytest
import torch
import torch.nn.functional as F

from loadtest.perplexity import (
    CORPUS,
    agreement,
    decode_perplexity,
    load_format,
    parse_args,
    perplexity,
)
from shared.engine import linear
from shared.engine.linear import half_weights_available, onednn_can_pack

pytestmark = pytest.mark.slow
WINDOW = 48


def hf_perplexity(hf_model, token_ids: list[int], window: int) -> float:
    total, count = 0.0, 0
    for start in range(0, len(token_ids) - 1, window):
        piece = token_ids[start : start + window]
        with torch.no_grad():
            logits = hf_model(torch.tensor([piece], device=hf_model.device)).logits[0, :-1]
        targets = torch.tensor(piece[1:], device=logits.device)
        total += F.cross_entropy(logits.float(), targets, reduction="sum").item()
        count += len(piece) - 1
    return math.exp(total / count)


def test_perplexity_equals_transformers(smollm2, smollm2_hf):
    token_ids = smollm2.tokenizer(CORPUS.read_text())["input_ids"][: 2 * WINDOW + 5]
    ours, num_scored = perplexity(smollm2, token_ids, WINDOW)
    assert num_scored == 2 * (WINDOW - 1) + 4  # the 5-token tail window counts too
    assert ours == pytest.approx(hf_perplexity(smollm2_hf, token_ids, WINDOW), rel=1e-4)
    assert 1.0 < ours < 1000.0  # a real model on plain English, not a uniform guess (~49,152)


def test_decode_perplexity_equals_the_prefill_one_in_float32(smollm2):
    """The same windows scored one decode step at a time (float32: the reference attention)."""
    token_ids = smollm2.tokenizer(CORPUS.read_text())["input_ids"][: 2 * WINDOW + 5]
    prefill, _ = perplexity(smollm2, token_ids, WINDOW)
    assert decode_perplexity(smollm2, token_ids, WINDOW) == pytest.approx(prefill, rel=1e-4)


def test_agreement_counts_the_shared_prefix():
    reference = [[1, 2, 3, 4], [5, 6]]
    assert agreement(reference, reference) == {"exact": 2, "of": 2, "mean_prefix_share": 1.0}
    assert agreement(reference, [[1, 2, 9, 4], [5]]) == {
        "exact": 0, "of": 2, "mean_prefix_share": (0.5 + 0.5) / 2,
    }  # fmt: skip


@pytest.mark.parametrize(
    "argv",
    [
        ["--dtypes", "float64"],
        ["--window", "1"],
        ["--text", "/nonexistent"],
        ["--decode-attention", "native"],
    ],
)
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args(argv)
    assert info.value.code == 2 and "error" in capsys.readouterr().err


@pytest.mark.skipif(
    not (half_weights_available() and onednn_can_pack(torch.bfloat16, "cpu")),
    reason="needs FBGEMM's float16 product and oneDNN bfloat16 packing",
)
@pytest.mark.parametrize(
    "name,dtype", [("fp16-weights", torch.float32), ("bfloat16-fp16-weights", torch.bfloat16)]
)
def test_fp16_weight_formats_read_float16_for_every_product(name, dtype):
    served = dict(linear.HALF_WEIGHT_MAX_ROWS)
    loaded = load_format(None, name)
    layer = loaded.model.layers[0].qkv
    assert isinstance(layer, linear.HalfWeightLinear) and loaded.model.dtype == dtype
    assert layer.max_half_rows == sys.maxsize
    assert served == linear.HALF_WEIGHT_MAX_ROWS  # the served thresholds are put back
