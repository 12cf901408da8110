"""Causal attention of a step's new tokens over the paged KV cache.

A batch flattens the new tokens of its sequences in order; sequence i owns query rows
`query_start_loc[i]:query_start_loc[i+1]`, which are the last q_i of its `context_lens[i]` tokens
(their K/V are already in the cache), and a query at position p sees the keys at positions 0..p.
Row i of `block_tables` lists sequence i's cache blocks in order; entries past its last block are
padding, and cache slots past its context may hold anything (even NaN) and never reach the output.

The pure-torch reference (`kernels/attention_reference.py`, planned per step by
`kernels/attention_plan.py`) is the CPU path and the test oracle.

The Triton kernel covers decode batches (every q_i == 1) on CUDA: one program per (sequence, kv
head) serves that kv head's group of query heads, walking the context in tiles through the block
table with an online softmax (running max and sum) accumulated in float32.
"""

from __future__ import annotations

import math

import torch

from kernels.attention_plan import AttentionPlan
from kernels.attention_reference import attend_prefill, paged_attention_reference
from kernels.cpu_decode_attention import CpuDecodeAttention
from kernels.optional_triton import tl, triton

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
    decode_kernel: CpuDecodeAttention | None = None,
) -> torch.Tensor:
    """Attention output `[num_tokens, num_heads, head_dim]` in the query's dtype.

    Every context length must be at least 1 (a sequence attends to its own new token at least);
    index values are not checked, as that would sync the device on every layer.

    `use_triton=None` picks the Triton decode kernel for decode batches on CUDA whose head size
    it tiles (`triton_decodes`); tests pass True to run it on CPU tensors under
    TRITON_INTERPRET=1. A plan made with `paged_decode` lists
    its decode rows for `decode_kernel` (`kernels.cpu_decode_attention`), and the reference
    attends its prefill groups.
    """
    _check_inputs(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        query_start_loc,
        scale=scale,
        max_query_len=max_query_len,
        max_context_len=max_context_len,
    )
    if plan is not None and plan.decode_rows is not None:
        return _with_decode_kernel(
            query, key_cache, value_cache, block_tables, context_lens, scale, plan, decode_kernel
        )
    if use_triton is None:
        use_triton = triton_decodes(query.is_cuda, max_query_len, query.shape[-1])
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


def triton_decodes(on_cuda: bool, max_query_len: int, head_dim: int) -> bool:
    """Whether the Triton kernel takes a batch: decode on CUDA, for the head sizes it can tile
    (a power of two; any other, as 80 or 100, takes the reference: the kernel's refusal ended
    every worker serving such a model at its first decode step)."""
    return on_cuda and max_query_len == 1 and _is_power_of_two(head_dim)


def _with_decode_kernel(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: AttentionPlan,
    decode_kernel: CpuDecodeAttention | None,
) -> torch.Tensor:
    if decode_kernel is None:
        raise ValueError("a plan with decode rows needs the decode kernel that reads them")
    output = query.new_empty(query.shape)
    decode_kernel(
        query,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        plan.decode_rows,
        output,
        scale=scale,
    )
    for group in plan.prefill:
        output[group.output_rows] = attend_prefill(query, key_cache, value_cache, group, scale)
    return output


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
    scale: float,
    max_query_len: int,
    max_context_len: int,
) -> None:
    """Raise ValueError naming the first problem. Only the scale, shapes, dtypes and layouts are
    checked: reading the index tensors' values would cost a device sync on every layer."""
    if not (math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale}")
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
