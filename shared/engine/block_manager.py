"""The KV block manager: integer block ids only, never tensors.

A pool of `num_blocks` ids. A sequence owns a list of ids (its block table) covering its tokens:
token i lives in block `block_ids[i // block_size]` at offset `i % block_size`. Blocks are
reference-counted so that a block may be shared (a forked sequence, a reused prefix); it returns
to the free pool when its last holder frees it.

With a prefix cache, a block whose last holder frees it stays in the cache (refcount 0,
unreferenced) when it is named by a hash; it counts as free, and is evicted, least recently used
first, only when the free queue runs dry. With a host tier (a second location behind the same
integer interface) every evicted block is handed to `host_tier.demote` before its id is reused,
and `load_from_host` brings a hash the tier holds back into a fresh block.

Invariants (checked by `check_invariants`, which the tests call after every operation):
- every id is either free (refcount 0, in the free queue exactly once), cached and unreferenced
  (refcount 0, not in the free queue) or used (refcount > 0);
- these three sets partition range(num_blocks).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from typing import Protocol

from shared.engine.prefix_cache import Eviction, PrefixCache


class HostStore(Protocol):
    """Where evicted cached blocks go (`host_tier.HostTier`): hashes and block ids only."""

    def holds(self, block_hash: int) -> bool: ...

    def retain_until(self, block_hash: int) -> float | None: ...

    def demote(self, evictions: Iterable[Eviction]) -> None: ...

    def promote(self, block_hash: int, block_id: int) -> bool: ...


class NoFreeBlocksError(RuntimeError):
    """The pool cannot supply the blocks asked for; nothing was allocated."""


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        prefix_cache: PrefixCache | None = None,
        host_tier: HostStore | None = None,
    ):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.prefix_cache = prefix_cache
        self.host_tier = host_tier if prefix_cache is not None else None

    @property
    def num_free_blocks(self) -> int:
        """Blocks a caller can allocate: the free ones and the unreferenced cached ones."""
        return len(self._free_ids) + self._num_unreferenced()

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    def _num_unreferenced(self) -> int:
        return self.prefix_cache.num_unreferenced if self.prefix_cache is not None else 0

    def num_blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold `num_tokens` tokens."""
        return -(-num_tokens // self.block_size)

    def num_new_blocks_for(self, block_ids: list[int], num_tokens: int) -> int:
        """Blocks a table holding `block_ids` must gain to hold `num_tokens` tokens."""
        return max(0, self.num_blocks_for(num_tokens) - len(block_ids))

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` free ids (refcount 1 each); all or nothing."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate {num_blocks} blocks")
        if num_blocks > self.num_free_blocks:
            raise NoFreeBlocksError(
                f"need {num_blocks} blocks, {self.num_free_blocks} free of {self.num_blocks}"
            )
        ids, evictions = [], []
        for _ in range(num_blocks):
            if self._free_ids:
                ids.append(self._free_ids.popleft())
            else:
                assert self.prefix_cache is not None  # num_free_blocks counted its unreferenced
                evictions.append(self.prefix_cache.evict_one())
                ids.append(evictions[-1].block_id)
        self._demote(evictions)  # before anyone can write the reused ids
        for block_id in ids:
            self._ref_counts[block_id] = 1
        return ids

    def _demote(self, evictions: list[Eviction]) -> None:
        if evictions and self.host_tier is not None:
            self.host_tier.demote(evictions)

    def load_from_host(self, block_hash: int) -> int | None:
        """A fresh block (refcount 1, named by `block_hash` in the prefix cache) holding the KV
        the host tier kept under that hash; None when the tier lacks it or the pool is full."""
        if self.host_tier is None or not self.host_tier.holds(block_hash):
            return None
        if not self.can_allocate(1):
            return None
        (block_id,) = self.allocate(1)
        retain_until = self.host_tier.retain_until(block_hash)  # (promote forgets it)
        # Making room may have evicted a device block into a full tier and dropped this hash.
        if not self.host_tier.promote(block_hash, block_id):
            self.free([block_id])
            return None
        assert self.prefix_cache is not None  # the tier exists only beside a cache
        named = self.prefix_cache.insert(block_hash, block_id, retain_until)
        assert named, "the caller looked the hash up on the device first"
        self.prefix_cache.mark_from_host(block_id)
        return block_id

    def grow(self, block_ids: list[int], num_tokens: int) -> list[int]:
        """Extends a block table in place so it holds `num_tokens` tokens; returns the new ids."""
        new_ids = self.allocate(self.num_new_blocks_for(block_ids, num_tokens))
        block_ids.extend(new_ids)
        return new_ids

    def share(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to blocks already in use (fork, prefix reuse)."""
        for block_id in block_ids:
            if self._ref_counts[block_id] <= 0:
                raise ValueError(f"block {block_id} is free and cannot be shared")
            self._ref_counts[block_id] += 1

    def take_cached(self, block_ids: Iterable[int]) -> None:
        """Adds a holder to cached blocks (found by hash), referenced or not."""
        assert self.prefix_cache is not None
        for block_id in block_ids:
            if self.prefix_cache.hash_of(block_id) is None:
                raise ValueError(f"block {block_id} is not cached")
            self.prefix_cache.touch(block_id)
            self._ref_counts[block_id] += 1

    def free(self, block_ids: Iterable[int], retain_until: float | None = None) -> None:
        """Drops one holder of each block; a block with no holder left returns to the pool, or
        stays cached when named (evicted after unprotected blocks until `retain_until`). A
        table's blocks go back last first, so its cached prefix is evicted from the tail and
        what stays is still a prefix (a lookup stops at its first miss: evicted head first, a
        little pressure made a whole conversation's blocks useless)."""
        cache = self.prefix_cache
        for block_id in reversed(list(block_ids)):
            count = self._ref_counts[block_id]
            if count <= 0:
                raise ValueError(f"block {block_id} freed twice")
            self._ref_counts[block_id] = count - 1
            if count == 1 and not (cache and cache.release(block_id, retain_until)):
                self._free_ids.append(block_id)
        if cache is not None:
            evictions = cache.overflow()
            self._demote(evictions)
            self._free_ids.extend(e.block_id for e in evictions)

    def ref_count(self, block_id: int) -> int:
        return self._ref_counts[block_id]

    def check_invariants(self) -> None:
        free = set(self._free_ids)
        assert len(free) == len(self._free_ids), "a block id is in the free queue twice"
        for block_id, count in enumerate(self._ref_counts):
            assert count >= 0, f"block {block_id} has a negative refcount"
            unreferenced = self.prefix_cache is not None and self.prefix_cache.is_unreferenced(
                block_id
            )
            assert not (unreferenced and block_id in free), f"block {block_id} free and cached"
            assert (count == 0) == (block_id in free or unreferenced), f"block {block_id}: {count}"
        if self.prefix_cache is not None:
            self.prefix_cache.check_invariants(self._ref_counts)
