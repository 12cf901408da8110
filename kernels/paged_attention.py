"""Causal attention of a step's new tokens over the paged KV cache.

A batch flattens the new tokens of its sequences in order; sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last q_i of its `context_lens[i]` tokens
(their K/V are already in the cache), and a query at position p sees the keys at positions 0..p.
Row i of `block_tables` lists sequence i's cache blocks in order; entries past its last block are
padding, and cache slots past its context may hold anything (even NaN) and never reach the output.

The pure-torch reference is the CPU path and the test oracle. It splits the batch into a decode
group (q_i == 1) and a prefill group (q_i > 1, possibly after cached context). Each group gathers
its sequences' blocks into a padded `[seqs, blocks * block_size, kv_heads, head_dim]` copy (one
`index_select`, then positions past each context zeroed) and runs one masked
`scaled_dot_product_attention` with `enable_gqa`, so K/V are never repeated per query head.
Prefill pads every sequence's queries to the longest, masks causally, and drops the padded rows.
(Measured on 2 CPU threads at SmolLM2's shapes: for decode batches of 8 to 64, `enable_gqa` beat
folding a kv head's query heads into the query axis by 5-15%, and explicit matmul + softmax, per kv
head or batched, by 15% or more. The gather is a memory-bound copy: at batch 32 it moves ~25 MB.)

The Triton kernel covers decode batches (every q_i == 1) on CUDA: one program per (sequence, kv
head) serves that kv head's group of query heads, walking the context in tiles through the block
table with an online softmax (running max and sum) accumulated in float32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_LOG2E = 1.4426950408889634
# Elements of one [group, tile, head_dim] product held by a Triton program at a time.
_TILE_ELEMENTS = 8192


def paged_attention(
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
    use_triton: bool | None = None,
    plan: AttentionPlan | None = None,
) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]` in the query's dtype.

    Every context length must be at least 1 (a sequence attends to its own new token at least);
    index values are not checked, as that would sync the device on every layer.

    `use_triton=None` picks the Triton decode kernel exactly for decode batches on CUDA; tests pass
    True to run it on CPU tensors under TRITON_INTERPRET=1.
    """
    _check_inputs(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        query_start_loc,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )
    if use_triton is None:
        use_triton = query.is_cuda and max_query_len == 1
    if not use_triton:
        return paged_attention_reference(
            query,
            key_cache,
            value_cache,
            block_tables,
            context_lens,
            query_start_loc,
            scale=scale,
            max_query_len=max_query_len,
            max_context_len=max_context_len,
            plan=plan,
        )
    if max_query_len != 1:
        raise ValueError(f"the Triton kernel does decode only, got max_query_len {max_query_len}")
    return _paged_decode_attention_triton(
        query, key_cache, value_cache, block_tables, context_lens, scale
    )


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
    if plan.prefill is None and plan.decode is not None and plan.decode.query_rows is None:
        return _attend_decode(query, key_cache, value_cache, plan.decode, scale)
    output = query.new_empty(query.shape)
    if plan.decode is not None:
        rows = plan.decode.query_rows
        output[rows] = _attend_decode(query[rows], key_cache, value_cache, plan.decode, scale)
    if plan.prefill is not None:
        output[plan.prefill.output_rows] = _attend_prefill(
            query, key_cache, value_cache, plan.prefill, scale
        )
    return output


@dataclass(frozen=True)
class AttentionGroup:
    """Sequences attended in one padded batch: how to gather their context, and the mask."""

    block_ids: torch.Tensor  # [num_seqs * num_blocks]: the blocks to gather, sequence by sequence
    num_seqs: int
    padded_len: int  # num_blocks * block_size: gathered positions per sequence
    padding_rows: torch.Tensor  # rows of the flat gather past each context, zeroed after the copy
    mask: torch.Tensor  # boolean SDPA mask, True where a query may see a key
    bias: torch.Tensor | None  # decode: the mask as float32 0 / -inf, [seqs, 1, 1, padded_len]
    query_rows: torch.Tensor | None  # decode: its rows of the query (None: all, in order);
    #                                  prefill: rows gathered into the padded [seqs, max_q] query
    output_rows: torch.Tensor | None  # prefill: the real query rows, in padded order
    real: torch.Tensor | None  # prefill: [seqs, max_q], which padded query rows are real
    max_query_len: int


@dataclass(frozen=True)
class AttentionPlan:
    decode: AttentionGroup | None  # sequences with one new token
    prefill: AttentionGroup | None  # sequences with a run of new tokens (prompt or chunk)


def plan_attention(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    block_size: int,
    max_query_len: int,
    max_context_len: int,
) -> AttentionPlan:
    """The batch-only part of the reference: computed once per step, used by every layer."""
    if max_query_len == 1:  # pure decode: query row i is sequence i's new token, no sync
        group = _group(block_tables, context_lens, block_size, max_context_len, None, 1)
        return AttentionPlan(decode=group, prefill=None)
    # Prefill or mixed: splitting by query length and sizing each group to its own longest context
    # costs device syncs (free on CPU) but keeps decode rows from being padded to a prompt's length.
    query_lens = query_start_loc[1:] - query_start_loc[:-1]
    is_decode = query_lens == 1
    decode_ids, prefill_ids = is_decode.nonzero()[:, 0], (~is_decode).nonzero()[:, 0]
    decode = prefill = None
    if decode_ids.numel() > 0:
        contexts = context_lens[decode_ids]
        rows = query_start_loc[decode_ids].long()
        decode = _group(
            block_tables[decode_ids], contexts, block_size, int(contexts.max()), rows, 1
        )
    if prefill_ids.numel() > 0:
        contexts = context_lens[prefill_ids]
        prefill = _group(
            block_tables[prefill_ids],
            contexts,
            block_size,
            int(contexts.max()),
            query_start_loc[prefill_ids].long(),
            max_query_len,
            query_lens[prefill_ids],
        )
    return AttentionPlan(decode=decode, prefill=prefill)


def _group(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    block_size: int,
    max_context_len: int,
    starts: torch.Tensor | None,
    max_query_len: int,
    query_lens: torch.Tensor | None = None,
) -> AttentionGroup:
    num_seqs = block_tables.shape[0]
    num_blocks = -(-max_context_len // block_size)
    padded_len = num_blocks * block_size
    device = context_lens.device
    # Only the columns that some sequence uses; whole blocks copy far faster than single slots.
    block_ids = block_tables[:, :num_blocks].reshape(-1)
    # Stale or NaN cache rows past a context must not reach the output through 0 * NaN, so they
    # are zeroed in the copy. They are a few rows per sequence: zeroing them by index is far
    # cheaper than a masked pass over the whole copy (broadcast masked_fill_ is slow on CPU).
    key_positions = torch.arange(padded_len, device=device)
    padding_rows = (key_positions >= context_lens[:, None]).view(-1).nonzero()[:, 0]
    if query_lens is None:  # decode
        mask = (key_positions < context_lens[:, None])[:, None, None, :]
        bias = torch.zeros(mask.shape, device=device).masked_fill_(~mask, float("-inf"))
        return AttentionGroup(
            block_ids, num_seqs, padded_len, padding_rows, mask, bias, starts, None, None, 1
        )
    offsets = torch.arange(max_query_len, device=device)
    real = offsets < query_lens[:, None]
    # Padded query rows repeat the first row: they stay in bounds, see a key, and are dropped.
    rows = torch.where(real, starts[:, None] + offsets, starts[:, None])
    positions = (context_lens - query_lens)[:, None] + offsets
    mask = (key_positions <= positions[:, :, None])[:, None]
    return AttentionGroup(
        block_ids,
        num_seqs,
        padded_len,
        padding_rows,
        mask,
        None,
        rows.reshape(-1),
        rows[real],
        real,
        max_query_len,
    )


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
    key, value = _gather_context(key_cache, value_cache, group)
    if not query.is_cuda and query.dtype != torch.float32:
        return _attend_decode_16bit(query, key, value, group.bias, scale)
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
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, bias: torch.Tensor, scale: float
) -> torch.Tensor:
    """Decode attention for 16-bit tensors on the CPU, as two batched matmuls in the tensors'
    dtype with the softmax in float32. torch's CPU flash kernel is 3-8x slower in bfloat16, and
    upcasting the gathered K/V to float32 first costs a full copy per layer (measured at 1 thread,
    32 sequences of 512 tokens: 4.6 ms here, 6.6 ms upcast + flash, 19 ms flash in bfloat16).
    Each kv head's group of query heads is folded into the query axis, so GQA repeats nothing."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = key.shape[2]
    folded = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    scores = torch.matmul(folded, key.permute(0, 2, 3, 1)).float() * scale + bias
    probs = scores.softmax(-1).to(query.dtype)
    out = torch.matmul(probs, value.transpose(1, 2))  # [seqs, kv_heads, group, head_dim]
    return out.reshape(num_seqs, num_heads, head_dim)


def _attend_prefill(
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
        attn_mask=group.mask,
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


@triton.jit
def _paged_decode_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    context_lens_ptr,
    scale_log2,  # softmax scale times log2(e): the kernel exponentiates with exp2
    query_stride_seq,
    query_stride_head,
    out_stride_seq,
    out_stride_head,
    block_tables_stride,
    BLOCK_SIZE: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    TILE: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    group = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    heads = kv_head * GROUP_SIZE + group
    is_head = group < GROUP_SIZE
    q_offsets = seq * query_stride_seq + heads[:, None] * query_stride_head + dims[None, :]
    q = tl.load(query_ptr + q_offsets, mask=is_head[:, None], other=0.0).to(tl.float32)
    q = q * scale_log2
    context_len = tl.load(context_lens_ptr + seq)

    # Online softmax in base 2: running max, running sum of exp2, and the unnormalized output.
    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    # Every tile starts below context_len, so it holds a visible key and the max stays finite.
    for start in range(0, context_len, TILE):
        positions = start + tl.arange(0, TILE)
        visible = positions < context_len
        table_offsets = seq * block_tables_stride + positions // BLOCK_SIZE
        block_ids = tl.load(block_tables_ptr + table_offsets, mask=visible, other=0)
        slots = block_ids.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
        kv_offsets = (slots * NUM_KV_HEADS + kv_head)[:, None] * HEAD_DIM + dims[None, :]
        # Masked loads read 0 for invisible slots, so NaN garbage there never enters the sums.
        k = tl.load(key_cache_ptr + kv_offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        v = tl.load(value_cache_ptr + kv_offsets, mask=visible[:, None], other=0.0).to(tl.float32)
        scores = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        scores = tl.where(visible[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, axis=1))
        correction = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(probs, axis=1)
        acc = acc * correction[:, None] + tl.sum(probs[:, :, None] * v[None, :, :], axis=1)
        running_max = new_max

    # An empty context (never scheduled) gives zeros instead of 0 / 0.
    acc = acc / tl.where(running_sum > 0, running_sum, 1.0)[:, None]
    out_offsets = seq * out_stride_seq + heads[:, None] * out_stride_head + dims[None, :]
    tl.store(out_ptr + out_offsets, acc.to(out_ptr.dtype.element_ty), mask=is_head[:, None])


def _paged_decode_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    num_seqs, num_heads, head_dim = query.shape
    if not _is_power_of_two(head_dim):
        raise ValueError(f"the Triton kernel needs a power-of-two head_dim, got {head_dim}")
    _, block_size, num_kv_heads, _ = key_cache.shape
    group_size = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group_size)
    # A power of two, as head_dim (checked) and group_pad are.
    tile = max(1, min(64, _TILE_ELEMENTS // (group_pad * head_dim)))
    output = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if num_seqs == 0:
        return output
    _paged_decode_attention_kernel[(num_seqs, num_kv_heads)](
        output,
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        output.stride(0),
        output.stride(1),
        block_tables.stride(0),
        BLOCK_SIZE=block_size,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        GROUP_SIZE=group_size,
        GROUP_PAD=group_pad,
        TILE=tile,
    )
    return output


def _check_inputs(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    *,
    max_query_len: int,
    max_context_len: int,
) -> None:
    """Raise ValueError naming the first problem. Only shapes, dtypes and layouts are checked:
    reading the index tensors' values would cost a device sync on every layer."""
    if query.dim() != 3:
        raise ValueError(
            f"query must be [num_tokens, num_heads, head_dim], got {tuple(query.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads, cache_head_dim = key_cache.shape[1:]
    if head_dim != cache_head_dim:
        raise ValueError(f"query head_dim {head_dim} differs from the cache's {cache_head_dim}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if query.dtype not in _DTYPES or {key_cache.dtype, value_cache.dtype} != {query.dtype}:
        raise ValueError(
            "query and the caches must share one dtype among float32, float16 and bfloat16, got "
            f"{query.dtype}, {key_cache.dtype} and {value_cache.dtype}"
        )
    _check_index_tensors(block_tables, context_lens, query_start_loc)
    tensors = (query, key_cache, value_cache, block_tables, context_lens, query_start_loc)
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if query.stride(2) != 1 or block_tables.stride(1) != 1 or context_lens.stride(0) != 1:
        raise ValueError(
            "query, block_tables and context_lens must have unit stride along their last dim"
        )
    num_seqs = block_tables.shape[0]
    if max_query_len == 1 and num_tokens != num_seqs:
        raise ValueError(
            f"a decode batch (max_query_len 1) needs one query per sequence, got {num_tokens} "
            f"queries for {num_seqs} sequences"
        )
    if max_context_len > block_tables.shape[1] * block_size:
        raise ValueError(
            f"max_context_len {max_context_len} exceeds block_tables' capacity of "
            f"{block_tables.shape[1]} blocks of {block_size}"
        )


def _check_index_tensors(
    block_tables: torch.Tensor, context_lens: torch.Tensor, query_start_loc: torch.Tensor
) -> None:
    if block_tables.dim() != 2:
        raise ValueError(
            f"block_tables must be [num_seqs, max_blocks], got {tuple(block_tables.shape)}"
        )
    num_seqs = block_tables.shape[0]
    expected_shapes = {
        "block_tables": (block_tables, block_tables.shape),
        "context_lens": (context_lens, (num_seqs,)),
        "query_start_loc": (query_start_loc, (num_seqs + 1,)),
    }
    for name, (tensor, shape) in expected_shapes.items():
        if tensor.dtype != torch.int32:
            raise ValueError(f"{name} must be int32, got {tensor.dtype}")
        if tensor.shape != shape:
            raise ValueError(
                f"{name} must be {list(shape)} for {num_seqs} sequences, got {list(tensor.shape)}"
            )


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0
