"""The paged KV cache: per-layer block pools of keys and values.

Layer l's keys live in `key_caches[l]`, shaped [num_blocks, block_size, num_kv_heads, head_dim]
(values alike); block ids come from the `BlockManager`, which never sees these tensors. Sizing
from a memory budget lives here so the decode worker and the in-process engine agree on it.
"""

from __future__ import annotations

import torch

from shared.config import ConfigError
from shared.engine.model_config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block id costs across all layers, keys and values."""
    element_size = torch.empty((), dtype=dtype).element_size()
    per_layer = 2 * block_size * config.num_kv_heads * config.head_dim * element_size
    return per_layer * config.num_layers


def num_blocks_for_budget(
    config: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int
) -> int:
    """Blocks of `block_size` tokens that `budget_bytes` (a worker's --kv-cache-bytes) holds;
    ConfigError naming the setting and the bytes one block takes when not even one fits (it
    was a ValueError traceback, after the model had loaded)."""
    block_bytes = bytes_per_block(config, block_size, dtype)
    num_blocks = budget_bytes // block_bytes
    if num_blocks < 1:
        raise ConfigError(
            f"kv_cache_bytes (--kv-cache-bytes / TANDEM_KV_CACHE_BYTES): a KV budget of "
            f"{budget_bytes} bytes holds no block of {block_size} tokens: this model's take "
            f"{block_bytes} bytes each"
        )
    return int(num_blocks)


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        shape = (config.num_layers, num_blocks, block_size, config.num_kv_heads, config.head_dim)
        # One allocation per kind; per-layer views index into it (contiguous per layer).
        self._keys = torch.zeros(shape, dtype=dtype, device=device)
        self._values = torch.zeros(shape, dtype=dtype, device=device)
        self.key_caches = list(self._keys.unbind(0))
        self.value_caches = list(self._values.unbind(0))
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.key_caches[index], self.value_caches[index]

    def read_blocks(self, block_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of the blocks' keys and values, each [layers, blocks, block_size, heads, dim]."""
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._keys.device)
        return self._keys.index_select(1, index), self._values.index_select(1, index)

    def write_blocks(self, block_ids: list[int], keys: torch.Tensor, values: torch.Tensor) -> None:
        """Writes keys and values shaped as `read_blocks` returns them into the given blocks."""
        expected = (self._keys.shape[0], len(block_ids), *self._keys.shape[2:])
        for name, tensor in (("keys", keys), ("values", values)):
            if tuple(tensor.shape) != expected:
                raise ValueError(f"{name} shape {tuple(tensor.shape)} != expected {expected}")
            if tensor.dtype != self.dtype:
                raise ValueError(f"{name} dtype {tensor.dtype} != cache dtype {self.dtype}")
        index = torch.tensor(block_ids, dtype=torch.int64, device=self._keys.device)
        self._keys.index_copy_(1, index, keys.to(self._keys.device))
        self._values.index_copy_(1, index, values.to(self._values.device))
