"""The pure-torch paged attention: the CPU path and the test oracle of the Triton kernel.

A plan (`kernels/attention_plan.py`) splits the batch into groups of decode sequences (one new
token) and prefill sequences (a run of new tokens, possibly after cached context). Each group
gathers its sequences' blocks into a padded `[seqs, blocks * block_size, kv_heads, head_dim]` copy
(one `index_select`, then positions past each context zeroed) and runs one masked
`scaled_dot_product_attention` with `enable_gqa`, so K/V are never repeated per query head.
Prefill pads every sequence's queries to the group's longest, masks causally, and drops the padded
rows. (Measured on 2 CPU threads at SmolLM2's shapes: for decode batches of 8 to 64, `enable_gqa`
beat folding a kv head's query heads into the query axis by 5-15%, and explicit matmul + softmax,
per kv head or batched, by 15% or more, in float32. The gather is a memory-bound copy: at batch 32
it moves ~25 MB.) On the CPU, 16-bit decode runs as two `bmm` over the gathered context as it
lies instead (see `_attend_decode_16bit`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from kernels.attention_plan import AttentionGroup, AttentionPlan, plan_attention


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    scale: float,
    max_query_len: int,
    max_context_len: int,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Pure-torch paged attention, vectorized per group (decode, prefill); see the module doc.

    `plan` (from `plan_attention` on the same batch) saves rebuilding the gather indices and
    masks: they depend only on the batch, so a model builds them once per step, not per layer.
    """
    if query.shape[0] == 0:
        return torch.empty_like(query)
    if plan is None:
        plan = plan_attention(
            block_tables,
            context_lens,
            query_start_loc,
            block_size=key_cache.shape[1],
            max_query_len=max_query_len,
            max_context_len=max_context_len,
        )
    if plan.is_plain_decode:
        return _attend_decode(query, key_cache, value_cache, plan.decode[0], scale)
    output = query.new_empty(query.shape)
    for group in plan.decode:
        rows = group.query_rows
        output[rows] = _attend_decode(query[rows], key_cache, value_cache, group, scale)
    for group in plan.prefill:
        output[group.output_rows] = attend_prefill(query, key_cache, value_cache, group, scale)
    return output


def _gather_context(
    key_cache: torch.Tensor, value_cache: torch.Tensor, group: AttentionGroup
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sequence's K and V as `[num_seqs, padded_len, num_kv_heads, head_dim]`, positions
    past its context zeroed."""
    gathered = []
    for cache in (key_cache, value_cache):
        context = cache.index_select(0, group.block_ids)
        flat = context.view(group.num_seqs * group.padded_len, cache[0, 0].numel())
        flat.index_fill_(0, group.padding_rows, 0)
        gathered.append(context.view(group.num_seqs, group.padded_len, *cache.shape[2:]))
    return gathered[0], gathered[1]


def _attend_decode(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """One query per sequence: query `[seqs, heads, dim]`."""
    out_dtype = query.dtype
    if not query.is_cuda and query.dtype != torch.float32:
        return _attend_decode_16bit(query, key_cache, value_cache, group, scale)
    key, value = _gather_context(key_cache, value_cache, group)
    out = F.scaled_dot_product_attention(
        query[:, :, None, :],
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=group.mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[:, :, 0, :].to(out_dtype)


def _attend_decode_16bit(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """Decode attention for 16-bit tensors on the CPU, as two batched matmuls in the tensors'
    dtype with the softmax in float32. torch's CPU flash kernel is 3-8x slower in bfloat16, and
    upcasting the gathered K/V to float32 first costs a full copy per layer (measured at 1 thread,
    32 sequences of 512 tokens: 4.6 ms here, 6.6 ms upcast + flash, 19 ms flash in bfloat16).

    The gathered K and V are used as they lie, `[seqs, ctx, kv_heads * head_dim]`, and the
    query is spread block-diagonally over the same `kv_heads * head_dim` axis instead: query
    head `q` of kv head `h` holds its vector in columns `h * head_dim ...` and zeros elsewhere,
    so one `bmm` gives every head's scores against its own kv head only (GQA repeats nothing),
    and the second `bmm` gives each query head a row across all kv heads, of which the diagonal
    block is its output. The matmuls do kv_heads times the multiply-adds, which costs nothing
    here: decode attention is bound by memory, and any other arrangement of K and V for `bmm` is
    one more copy of the whole context per layer (seen as a permute copy, a sixth of a decode
    step at batch 8; this way attention ran 2x faster at 32 x 512 tokens, bit-identical).

    The scores come out of `bmm` in the tensors' dtype, where unscaled (head_dim**0.5 times
    larger) float16 scores reach infinity, hence NaN probabilities, at logits of a few thousand
    (5,790 at head_dim 128). So the query is scaled first by the power of two nearest the scale,
    which rounds nothing, and the scores by the rest in float32.
    """
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    group_size = num_heads // num_kv_heads
    exact_scale = 2.0 ** round(math.log2(scale))
    key, value = _gather_context(key_cache, value_cache, group)
    key = key.view(num_seqs, group.padded_len, num_kv_heads * head_dim)
    value = value.view(num_seqs, group.padded_len, num_kv_heads * head_dim)
    spread = query.new_zeros(num_seqs, num_kv_heads, group_size, num_kv_heads, head_dim)
    spread.diagonal(dim1=1, dim2=3).copy_(
        (query * exact_scale).view(num_seqs, num_kv_heads, group_size, head_dim).permute(0, 2, 3, 1)
    )
    spread = spread.view(num_seqs, num_heads, num_kv_heads * head_dim)
    scores = torch.bmm(spread, key.transpose(1, 2)).float() * (scale / exact_scale)
    scores += group.bias[:, 0]
    probs = scores.softmax(-1).to(query.dtype)
    rows = torch.bmm(probs, value).view(num_seqs, num_kv_heads, group_size, num_kv_heads, head_dim)
    own = rows.diagonal(dim1=1, dim2=3)  # [seqs, group_size, head_dim, kv_heads]
    return own.permute(0, 3, 1, 2).reshape(num_seqs, num_heads, head_dim)


def attend_prefill(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    group: AttentionGroup,
    scale: float,
) -> torch.Tensor:
    """Causal attention of each sequence's run of queries over its gathered context; returns the
    outputs of the real query rows, in `group.output_rows` order."""
    key, value = _gather_context(key_cache, value_cache, group)
    num_heads, head_dim = query.shape[1:]
    out_dtype = query.dtype
    padded = query.index_select(0, group.query_rows)
    padded, key, value = _compute_dtype(padded, key, value)
    padded = padded.view(group.num_seqs, group.max_query_len, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        padded.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        attn_mask=None if group.causal else group.mask,
        is_causal=group.causal,
        scale=scale,
        enable_gqa=True,
    )
    return out.transpose(1, 2)[group.real].to(out_dtype)


def _compute_dtype(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """16-bit prefill attention runs in float32 on the CPU: torch's CPU flash kernel is several
    times slower in bfloat16, and a prompt's many queries amortize the upcast copies."""
    if tensors[0].is_cuda or tensors[0].dtype == torch.float32:
        return tensors
    return tuple(t.float() for t in tensors)
