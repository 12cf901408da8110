"""Paged attention: the pure-torch reference against a naive per-sequence oracle, the Triton decode
kernel against the reference on the test device (in the interpreter on CPU tensors, compiled on
CUDA), and the input checks.

Every batch is built with awkward shapes: contexts that are not multiples of the block size,
one-token contexts, shuffled block ids, padded block-table entries pointing at live blocks, and
every cache slot no sequence owns filled with NaN, so that any leak of padding shows up.
"""

from dataclasses import dataclass, replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels.attention_reference import paged_attention_reference
from kernels.paged_attention import paged_attention, triton_decodes


@dataclass(frozen=True)
class Batch:
    query: torch.Tensor
    key_cache: torch.Tensor
    value_cache: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_context_len: int

    def args(self) -> tuple[torch.Tensor, ...]:
        return (
            self.query,
            self.key_cache,
            self.value_cache,
            self.block_tables,
            self.context_lens,
            self.query_start_loc,
        )

    def to(self, device: torch.device | str) -> "Batch":
        return replace(self, **{f: getattr(self, f).to(device) for f in TENSOR_FIELDS})

    def kwargs(self) -> dict[str, float | int]:
        return {
            "scale": self.scale,
            "max_query_len": self.max_query_len,
            "max_context_len": self.max_context_len,
        }


TENSOR_FIELDS = (
    "query",
    "key_cache",
    "value_cache",
    "block_tables",
    "context_lens",
    "query_start_loc",
)


def make_batch(
    seqs: list[tuple[int, int]],
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """`seqs` lists (context_len, query_len) per sequence, query_len <= context_len."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-ctx // block_size) for ctx, _ in seqs]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay NaN
    order = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(blocks_per_seq) + 1  # at least one padding column for every sequence
    # Padding entries point at a live block of another sequence: the kernels must not read past.
    block_tables = torch.full((len(seqs), max_blocks), order[0], dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    key_cache = torch.full(shape, float("nan"), dtype=dtype)
    value_cache = torch.full(shape, float("nan"), dtype=dtype)
    for i, ((ctx, _), num_used) in enumerate(zip(seqs, blocks_per_seq, strict=True)):
        ids, order = order[:num_used], order[num_used:]
        block_tables[i, :num_used] = torch.tensor(ids, dtype=torch.int32)
        positions = torch.arange(ctx)
        slots = torch.tensor(ids)[positions // block_size] * block_size + positions % block_size
        for cache in (key_cache, value_cache):
            values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
            cache.view(-1, num_kv_heads, head_dim)[slots] = values
    query_lens = [q for _, q in seqs]
    query_start_loc = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    query_start_loc[1:] = torch.tensor(query_lens).cumsum(0)
    query = torch.randn(sum(query_lens), num_heads, head_dim, generator=gen).to(dtype)
    return Batch(
        query=query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_tables=block_tables,
        context_lens=torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        query_start_loc=query_start_loc,
        scale=head_dim**-0.5,
        max_query_len=max(query_lens),
        max_context_len=max(ctx for ctx, _ in seqs),
    )


def naive_attention(batch: Batch) -> torch.Tensor:
    """Obviously correct: per sequence, gather its slots, repeat kv heads, dense causal softmax in
    float64, on the CPU."""
    batch = batch.to("cpu")
    num_heads = batch.query.shape[1]
    block_size, num_kv_heads, head_dim = batch.key_cache.shape[1:]
    group = num_heads // num_kv_heads
    keys = batch.key_cache.view(-1, num_kv_heads, head_dim).double()
    values = batch.value_cache.view(-1, num_kv_heads, head_dim).double()
    out = torch.zeros(batch.query.shape, dtype=torch.float64)
    for i, ctx in enumerate(batch.context_lens.tolist()):
        start, end = batch.query_start_loc[i].item(), batch.query_start_loc[i + 1].item()
        table = batch.block_tables[i].tolist()
        slots = [table[p // block_size] * block_size + p % block_size for p in range(ctx)]
        k = keys[slots].repeat_interleave(group, dim=1)  # [ctx, num_heads, head_dim]
        v = values[slots].repeat_interleave(group, dim=1)
        q = batch.query[start:end].double()
        scores = torch.einsum("qhd,khd->hqk", q, k) * batch.scale
        positions = torch.arange(ctx - (end - start), ctx)
        causal = torch.arange(ctx)[None, :] <= positions[:, None]
        probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v)
    return out.to(batch.query.dtype)


# (context_len, query_len) per sequence.
DECODE = [(17, 1), (1, 1), (33, 1), (16, 1), (5, 1)]
PREFILL = [(7, 7), (30, 12), (2, 2)]
MIXED = [(17, 1), (40, 9), (1, 1), (16, 16), (25, 1), (3, 2), (33, 33)]
BATCHES = {"decode": DECODE, "prefill": PREFILL, "mixed": MIXED}


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads", [(2, 2), (6, 2)])
@pytest.mark.parametrize("kind", sorted(BATCHES))
def test_reference_matches_naive(kind: str, num_heads: int, num_kv_heads: int, block_size: int):
    batch = make_batch(
        BATCHES[kind],
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=24,
        block_size=block_size,
    )
    out = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    assert not out.isnan().any()
    assert (out - naive_attention(batch)).abs().max() < 1e-5


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 40).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
        min_size=1,
        max_size=5,
    ),
    block_size=st.sampled_from([1, 2, 16]),
    kv_heads_and_group=st.sampled_from([(1, 1), (2, 3), (3, 1)]),
)
def test_reference_matches_naive_on_random_batches(
    seqs: list[tuple[int, int]], block_size: int, kv_heads_and_group: tuple[int, int]
):
    num_kv_heads, group = kv_heads_and_group
    batch = make_batch(
        seqs,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=8,
        block_size=block_size,
    )
    out = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert (out - naive_attention(batch)).abs().max() < 1e-5


def test_dispatcher_runs_the_reference_on_cpu():
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    expected = paged_attention_reference(*batch.args(), **batch.kwargs())
    torch.testing.assert_close(paged_attention(*batch.args(), **batch.kwargs()), expected)


def test_reference_accepts_a_strided_query():
    batch = make_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    # The model hands over a view of the fused QKV projection: rows are not contiguous.
    fused = torch.cat([batch.query.flatten(1), torch.randn(batch.query.shape[0], 5)], dim=1)
    strided = replace(batch, query=fused[:, : batch.query[0].numel()].view(batch.query.shape))
    assert not strided.query.is_contiguous()
    out = paged_attention_reference(*strided.args(), **strided.kwargs())
    assert (out - naive_attention(batch)).abs().max() < 1e-5


@pytest.mark.parametrize("shape", [MIXED, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_reference_in_16_bits(shape, dtype):
    half = make_batch(shape, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16, dtype=dtype)
    out = paged_attention_reference(*half.args(), **half.kwargs())
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), naive_attention(half).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(
    "block_size, head_dim, num_heads, num_kv_heads",
    [(1, 64, 3, 3), (16, 64, 6, 2), (32, 128, 6, 2), (16, 128, 4, 4)],
)
def test_triton_decode_matches_reference(
    block_size: int, head_dim: int, num_heads: int, num_kv_heads: int, device: torch.device
):
    batch = make_batch(
        DECODE,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    ).to(device)
    out = paged_attention(*batch.args(), **batch.kwargs(), use_triton=True)
    assert out.device.type == device.type and not out.isnan().any()
    expected = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert (out - expected).abs().max() < 1e-5


def test_triton_decode_with_smollm2_heads_and_long_contexts(device: torch.device):
    """SmolLM2-135M's layout (9 query heads on 3 KV heads, head_dim 64): a group that is not a
    power of two, and contexts spanning many tiles, ending mid-block and mid-tile."""
    seqs = [(300, 1), (1, 1), (129, 1), (64, 1), (257, 1)]
    batch = make_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16).to(device)
    out = paged_attention(*batch.args(), **batch.kwargs(), use_triton=True)
    assert (out.cpu() - naive_attention(batch)).abs().max() < 1e-5


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_triton_decode_in_half_precision(dtype: torch.dtype, device: torch.device):
    batch = make_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype)
    out = paged_attention(*batch.to(device).args(), **batch.kwargs(), use_triton=True)
    assert out.dtype == dtype
    torch.testing.assert_close(
        out.float().cpu(), naive_attention(batch).float(), atol=1e-2, rtol=1e-2
    )


def _good_batch() -> Batch:
    return make_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda b: {"query": b.query[..., :8]}, "head_dim"),
        (lambda b: {"query": torch.zeros(5, 5, 16)}, "multiple of num_kv_heads"),
        (lambda b: {"block_tables": b.block_tables.long()}, "block_tables must be int32"),
        (lambda b: {"context_lens": b.context_lens.long()}, "context_lens must be int32"),
        (lambda b: {"context_lens": b.context_lens[:-1]}, "context_lens must be"),
        (lambda b: {"query_start_loc": b.query_start_loc[:-1]}, "query_start_loc must be"),
        (lambda b: {"query": b.query.double()}, "dtype"),
        (lambda b: {"value_cache": b.value_cache.half()}, "dtype"),
        (lambda b: {"value_cache": b.value_cache[:-1]}, "key_cache and value_cache"),
        (
            lambda b: {"key_cache": b.key_cache.transpose(0, 1).contiguous().transpose(0, 1)},
            "must be contiguous",
        ),
        (lambda b: {"query": b.query[:-1]}, "one query per sequence"),
        (lambda b: {"max_context_len": 10_000}, "max_context_len"),
    ],
)
def test_bad_inputs_raise_value_error(change, message: str):
    batch = _good_batch()
    bad = replace(batch, **change(batch))
    for use_triton in (False, True):
        with pytest.raises(ValueError, match=message):
            paged_attention(*bad.args(), **bad.kwargs(), use_triton=use_triton)


def test_triton_refuses_prefill():
    batch = make_batch(PREFILL, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="decode only"):
        paged_attention(*batch.args(), **batch.kwargs(), use_triton=True)


def test_a_head_dim_the_triton_kernel_cannot_tile_takes_the_reference():
    assert triton_decodes(on_cuda=True, max_query_len=1, head_dim=64)
    assert not triton_decodes(on_cuda=True, max_query_len=1, head_dim=80)
    assert not triton_decodes(on_cuda=True, max_query_len=7, head_dim=64)
    assert not triton_decodes(on_cuda=False, max_query_len=1, head_dim=64)


def test_triton_refuses_a_head_dim_that_is_not_a_power_of_two():
    batch = make_batch(DECODE, num_heads=2, num_kv_heads=2, head_dim=24, block_size=16)
    with pytest.raises(ValueError, match="power-of-two head_dim"):
        paged_attention(*batch.args(), **batch.kwargs(), use_triton=True)
