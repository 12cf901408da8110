"""Writing a step's new keys and values into the paged KV cache.

The cache of one layer is a pair of tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. Seen
as `[num_blocks * block_size, num_kv_heads, head_dim]`, its rows are slots: the token at slot `s`
lives at block `s // block_size`, offset `s % block_size`, so writing is a row scatter driven by
`slot_mapping`. A negative slot marks a padding token that is not written.

`write_kv` checks its inputs once, then runs the Triton kernel on CUDA (one program per token,
copying all its heads) or the pure-torch reference elsewhere; the reference is also the kernel's
test oracle.
"""

import torch

from kernels.optional_triton import tl, triton


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    use_triton: bool | None = None,
) -> None:
    """Write `key`/`value` `[num_tokens, num_kv_heads, head_dim]` into the caches at `slot_mapping`.

    `use_triton=None` picks the Triton kernel exactly when the tensors are on CUDA; tests pass True
    to run it on CPU tensors under TRITON_INTERPRET=1.
    """
    _check_inputs(key, value, key_cache, value_cache, slot_mapping)
    if use_triton is None:
        use_triton = key.is_cuda
    if use_triton:
        _write_kv_triton(key, value, key_cache, value_cache, slot_mapping)
    else:
        write_kv_reference(key, value, key_cache, value_cache, slot_mapping)


def write_kv_reference(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Pure-torch write: one `index_copy_` per cache on its slot view, padding tokens dropped."""
    num_kv_heads, head_dim = key_cache.shape[2:]
    keep = slot_mapping >= 0
    if not bool(keep.all()):
        key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
    # A view, not a copy: the cache is contiguous (checked), so the writes land in it.
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key)
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value)


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    key_stride_token,
    key_stride_head,
    value_stride_token,
    value_stride_head,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    DIM_PAD: tl.constexpr,
):
    # One program per token. The sources may be strided views (K and V are slices of the fused QKV
    # projection) with a unit stride along head_dim; the caches are contiguous.
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:  # a padding token: nothing to write
        return
    heads = tl.arange(0, HEADS_PAD)[:, None]
    dims = tl.arange(0, DIM_PAD)[None, :]
    mask = (heads < NUM_KV_HEADS) & (dims < HEAD_DIM)
    dest = slot * (NUM_KV_HEADS * HEAD_DIM) + heads * HEAD_DIM + dims
    key_src = token * key_stride_token + heads * key_stride_head + dims
    value_src = token * value_stride_token + heads * value_stride_head + dims
    tl.store(key_cache_ptr + dest, tl.load(key_ptr + key_src, mask=mask), mask=mask)
    tl.store(value_cache_ptr + dest, tl.load(value_ptr + value_src, mask=mask), mask=mask)


def _write_kv_triton(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        DIM_PAD=triton.next_power_of_2(head_dim),
    )


def _check_inputs(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Raise ValueError naming the first problem. Slot values are not range-checked: that would need
    a device sync on every layer; the reference path fails on an out-of-range slot anyway."""
    if key.dim() != 3 or key.shape != value.shape:
        raise ValueError(
            "key and value must both be [num_tokens, num_kv_heads, head_dim], "
            f"got key {tuple(key.shape)} and value {tuple(value.shape)}"
        )
    if key_cache.dim() != 4 or key_cache.shape != value_cache.shape:
        raise ValueError(
            "key_cache and value_cache must both be [num_blocks, block_size, num_kv_heads, "
            f"head_dim], got {tuple(key_cache.shape)} and {tuple(value_cache.shape)}"
        )
    if key.shape[1:] != key_cache.shape[2:]:
        raise ValueError(
            f"key has (num_kv_heads, head_dim) = {tuple(key.shape[1:])} but the cache has "
            f"{tuple(key_cache.shape[2:])}"
        )
    if slot_mapping.shape != (key.shape[0],):
        raise ValueError(
            f"slot_mapping must be [num_tokens] = [{key.shape[0]}], got {tuple(slot_mapping.shape)}"
        )
    if slot_mapping.dtype != torch.int64:
        raise ValueError(f"slot_mapping must be int64, got {slot_mapping.dtype}")
    dtypes = {key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}
    if len(dtypes) != 1:
        names = sorted(map(str, dtypes))
        raise ValueError(f"key, value and the caches must share one dtype, got {names}")
    devices = {t.device for t in (key, value, key_cache, value_cache, slot_mapping)}
    if len(devices) != 1:
        raise ValueError(f"all tensors must be on one device, got {sorted(map(str, devices))}")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    if key.stride(2) != 1 or value.stride(2) != 1:
        raise ValueError("key and value must have unit stride along head_dim")
    if not slot_mapping.is_contiguous():
        raise ValueError("slot_mapping must be contiguous")
