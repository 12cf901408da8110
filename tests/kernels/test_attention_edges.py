"""Paged attention at the edges of what the engine produces: grouped-query ratios of 1, 3 and 8,
block sizes 8 and 32, head sizes that are not powers of two, blocks shared between sequences (a
cached prefix), 16-bit logits past float16's range, and a `max_context_len` below a real context.
Each case is checked against the naive float64 oracle of `test_paged_attention`.
"""

from dataclasses import replace

import pytest
import torch

from kernels.attention_reference import paged_attention_reference
from kernels.paged_attention import paged_attention
from tests.kernels.test_paged_attention import DECODE, MIXED, Batch, make_batch, naive_attention

# A long context beside one-token ones, one ending exactly on a block boundary at either size.
SKEWED_DECODE = [(64, 1), (1, 1), (8, 1), (70, 1)]
# Prompt chunks starting mid-sequence (cached tokens before them) beside whole prompts and decodes.
SKEWED_MIXED = [(64, 20), (1, 1), (9, 3), (32, 32), (70, 1)]


def _share_first_block(batch: Batch) -> Batch:
    """The last sequence's first block becomes the first sequence's, as a shared cached prefix."""
    tables = batch.block_tables.clone()
    tables[-1, 0] = tables[0, 0]
    return replace(batch, block_tables=tables)


def _tolerance(dtype: torch.dtype) -> float:
    return {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(3, 3), (9, 3), (8, 1)])
@pytest.mark.parametrize("block_size", [8, 32])
def test_triton_decode_on_skewed_batches_with_a_shared_prefix(
    block_size: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype, device: torch.device
):
    batch = make_batch(
        SKEWED_DECODE,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=32,
        block_size=block_size,
        dtype=dtype,
    )
    batch = _share_first_block(batch)
    out = paged_attention(*batch.to(device).args(), **batch.kwargs(), use_triton=True)
    error = (out.cpu().double() - naive_attention(batch).double()).abs().max()
    assert error < _tolerance(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [80, 96])
@pytest.mark.parametrize("seqs", [SKEWED_DECODE, SKEWED_MIXED], ids=["decode", "mixed"])
def test_reference_with_head_sizes_that_are_not_powers_of_two(
    seqs: list[tuple[int, int]], head_dim: int, dtype: torch.dtype
):
    batch = make_batch(
        seqs, num_heads=8, num_kv_heads=1, head_dim=head_dim, block_size=16, dtype=dtype
    )
    batch = _share_first_block(batch)
    out = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert (out.double() - naive_attention(batch).double()).abs().max() < _tolerance(dtype)


def _logits_past_float16(seqs: list[tuple[int, int]]) -> Batch:
    """float16 queries and keys of +-40: every raw dot product q.k is a multiple of 1600 up to
    64 * 1600 = 102400, past float16's largest finite 65504, and the key at position 3 of the
    first sequence reaches it; scaled (by 1/8) every logit is finite in float16."""
    batch = make_batch(
        seqs, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16
    )
    key_cache = batch.key_cache.sign() * 40  # NaN slots (no sequence's) stay NaN
    key_cache[batch.block_tables[0, 0], 3] = 40
    return replace(batch, query=torch.full_like(batch.query, 40), key_cache=key_cache)


@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_reference_survives_raw_scores_past_the_float16_range(seqs: list[tuple[int, int]]):
    batch = _logits_past_float16(seqs)
    out = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert not out.isnan().any()
    assert (out.double() - naive_attention(batch).double()).abs().max() < 2e-3


def test_triton_survives_raw_scores_past_the_float16_range(device: torch.device):
    batch = _logits_past_float16(DECODE)
    out = paged_attention(*batch.to(device).args(), **batch.kwargs(), use_triton=True)
    assert (out.cpu().double() - naive_attention(batch).double()).abs().max() < 2e-3


@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_a_max_context_len_below_a_context_is_refused(seqs: list[tuple[int, int]]):
    """It sizes the reference's gather: below a real context, that context would be cut short."""
    batch = make_batch(seqs, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    understated = replace(batch, max_context_len=16)
    longest = max(ctx for ctx, _ in seqs)
    with pytest.raises(ValueError, match=f"max_context_len 16 is below a context of {longest}"):
        paged_attention(*understated.args(), **understated.kwargs())


@pytest.mark.parametrize("scale", [0.0, -0.125, float("nan"), float("inf")])
def test_a_scale_that_is_not_positive_and_finite_is_refused(scale: float):
    batch = make_batch(DECODE, num_heads=4, num_kv_heads=2, head_dim=16, block_size=16)
    for use_triton in (False, True):
        with pytest.raises(ValueError, match="scale must be a positive finite number"):
            paged_attention(
                *batch.args(), **replace(batch, scale=scale).kwargs(), use_triton=use_triton
            )
