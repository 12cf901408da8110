"""KV writes: the reference against a per-token loop, the Triton kernel against the reference (on
the test device: in the interpreter on CPU tensors, compiled on CUDA), and the input checks."""

import pytest
import torch

from kernels.kv_write import write_kv, write_kv_reference

NUM_KV_HEADS, HEAD_DIM = 3, 8


def _caches(num_blocks: int, block_size: int, **placement) -> tuple[torch.Tensor, torch.Tensor]:
    # Distinct sentinels show that untouched slots stay untouched.
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    return torch.full(shape, -7.0, **placement), torch.full(shape, -9.0, **placement)


def _strided_kv(num_tokens: int, seed: int = 0, **placement) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V as the model produces them: strided views into one fused projection. `placement`
    (dtype, device) applies to the projection, so the views stay strided."""
    gen = torch.Generator().manual_seed(seed)
    width = NUM_KV_HEADS * HEAD_DIM
    fused = torch.randn(num_tokens, 5 + 2 * width, generator=gen).to(**placement)
    key = fused[:, 5 : 5 + width].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    value = fused[:, 5 + width :].view(num_tokens, NUM_KV_HEADS, HEAD_DIM)
    return key, value


def _shuffled_slots(num_tokens: int, num_slots: int, num_padding: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    slots = torch.randperm(num_slots, generator=gen)[:num_tokens]
    slots[torch.randperm(num_tokens, generator=gen)[:num_padding]] = -1
    return slots


@pytest.mark.parametrize("block_size", [1, 16])
def test_reference_matches_a_per_token_loop(block_size: int):
    num_blocks, num_tokens = max(4, 24 // block_size), 11
    key, value = _strided_kv(num_tokens)
    slots = _shuffled_slots(num_tokens, num_blocks * block_size, num_padding=3)
    key_cache, value_cache = _caches(num_blocks, block_size)
    expected_k, expected_v = key_cache.clone(), value_cache.clone()
    for token, slot in enumerate(slots.tolist()):
        if slot >= 0:
            expected_k[slot // block_size, slot % block_size] = key[token]
            expected_v[slot // block_size, slot % block_size] = value[token]
    write_kv_reference(key, value, key_cache, value_cache, slots)
    assert torch.equal(key_cache, expected_k)
    assert torch.equal(value_cache, expected_v)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_matches_reference(block_size: int, dtype: torch.dtype, device: torch.device):
    num_blocks, num_tokens = max(4, 24 // block_size), 11
    key, value = _strided_kv(num_tokens, dtype=dtype, device=device)
    assert not key.is_contiguous()
    slots = _shuffled_slots(num_tokens, num_blocks * block_size, num_padding=3).to(device)
    expected = _caches(num_blocks, block_size, dtype=dtype, device=device)
    write_kv_reference(key, value, *expected, slots)
    written = _caches(num_blocks, block_size, dtype=dtype, device=device)
    write_kv(key, value, *written, slots, use_triton=True)
    assert torch.equal(written[0], expected[0])
    assert torch.equal(written[1], expected[1])


def test_all_padding_and_empty_batches_write_nothing(device: torch.device):
    for num_tokens in (0, 4):
        key, value = _strided_kv(num_tokens, device=device)
        slots = torch.full((num_tokens,), -1, device=device)
        for use_triton in (False, True):
            key_cache, value_cache = _caches(2, 4, device=device)
            write_kv(key, value, key_cache, value_cache, slots, use_triton=use_triton)
            assert (key_cache == -7.0).all() and (value_cache == -9.0).all()


def _bad(**changes) -> dict[str, torch.Tensor]:
    key, value = _strided_kv(4)
    key_cache, value_cache = _caches(2, 4)
    args = {
        "key": key,
        "value": value,
        "key_cache": key_cache,
        "value_cache": value_cache,
        "slot_mapping": torch.arange(4),
    }
    return {**args, **{name: change(args[name]) for name, change in changes.items()}}


@pytest.mark.parametrize(
    "args, message",
    [
        (_bad(value=lambda v: v[:3]), "key and value"),
        (_bad(key=lambda k: k[:, :2], value=lambda v: v[:, :2]), "num_kv_heads, head_dim"),
        (_bad(value_cache=lambda c: c[:1]), "key_cache and value_cache"),
        (_bad(slot_mapping=lambda s: s.int()), "slot_mapping must be int64"),
        (_bad(slot_mapping=lambda s: s[:2]), "slot_mapping must be"),
        (_bad(key=lambda k: k.double()), "dtype"),
        (_bad(key_cache=lambda c: c.transpose(2, 3).contiguous().transpose(2, 3)), "contiguous"),
        (_bad(key=lambda k: k.transpose(1, 2).contiguous().transpose(1, 2)), "unit stride"),
    ],
)
def test_bad_inputs_raise_value_error(args: dict[str, torch.Tensor], message: str):
    for use_triton in (False, True):
        with pytest.raises(ValueError, match=message):
            write_kv(**args, use_triton=use_triton)
