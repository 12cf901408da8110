"""The prefix cache's second tier: evicted cached blocks' KV in host RAM, found again by hash.

When the device pool needs room it evicts unreferenced cached blocks (`prefix_cache.py`). With a
host tier, the block manager hands each evicted block to `demote` before the id is reused: its
keys and values are copied to host memory under the block's hash. A later prompt whose hash chain
continues here gets a fresh device block, the KV copied back (`promote`) and the block named in
the device cache again: a hit, at the cost of one copy instead of a prefill (as SGLang's HiCache
and vLLM's CPU offloading do). A block lives in one tier at a time; one that is promoted leaves
the host, and is demoted again (copied once more) if the device evicts it later.

Room. The tier lives in the swap space's host memory (`swap.py`), up to its own byte budget.
Preempted sequences come first: the tier only takes room the swap space has not promised, and a
swap-out that needs room takes it back (`shrink_to`), the tier dropping blocks in its eviction
order. That order is the device cache's (`retention.py`): least recently used first, blocks of a
finished turn still in their think-time retention last. A dropped block is gone for good: the
worker's next cache event batch reports its hash evicted (`services/worker/cache_events.py`).

The tier deals in hashes and block ids at its interface; the tensors stay inside.
"""

from __future__ import annotations

import time
from collections.abc import Iterable

import torch

from shared.engine.kv_cache import KVCache
from shared.engine.prefix_cache import Eviction
from shared.engine.retention import Clock, RetentionLru
from shared.engine.swap import SwapSpace
from shared.logs import get_logger

log = get_logger(component="host_tier")


class HostTier:
    def __init__(
        self,
        capacity_bytes: int,
        bytes_per_block: int,
        kv_cache: KVCache,
        swap_space: SwapSpace | None = None,
        clock: Clock = time.monotonic,
    ):
        if capacity_bytes < 0:
            raise ValueError(f"host tier capacity must be >= 0 bytes, got {capacity_bytes}")
        if swap_space is not None and capacity_bytes > swap_space.capacity_bytes:
            raise ValueError(
                f"the host tier ({capacity_bytes} bytes) lives in the swap space's host memory "
                f"and cannot exceed it ({swap_space.capacity_bytes} bytes)"
            )
        self.capacity_bytes = capacity_bytes
        self.bytes_per_block = bytes_per_block
        self.kv_cache = kv_cache
        self.swap_space = swap_space
        if swap_space is not None:
            swap_space.reclaim = self.shrink_to  # swap-outs take their room back
        self._order: RetentionLru[int] = RetentionLru(clock)  # hashes, eviction order
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # hash -> keys, values
        self._touched: list[int] = []  # hashes stored or dropped since `take_touched`
        self.num_demoted_blocks = 0  # since start: blocks copied in from the device
        self.num_promoted_blocks = 0  # since start: blocks copied back to the device
        self.num_dropped_blocks = 0  # since start: blocks dropped for good, or never taken in

    @property
    def num_bytes(self) -> int:
        return len(self._kv) * self.bytes_per_block

    @property
    def num_blocks(self) -> int:
        return len(self._kv)

    def limit_bytes(self) -> int:
        """The most bytes the tier may hold now: its budget, within the room of the swap space
        that no swapped sequence holds or was promised (the tier's own bytes are in that room)."""
        if self.swap_space is None:
            return self.capacity_bytes
        return min(self.capacity_bytes, self.swap_space.room_bytes)

    def holds(self, block_hash: int) -> bool:
        return block_hash in self._kv

    def hashes(self) -> list[int]:
        return list(self._kv)

    def retain_until(self, block_hash: int) -> float | None:
        """The held block's protection deadline (None: unprotected or not held)."""
        return self._order.retain_until(block_hash)

    def demote(self, evictions: Iterable[Eviction]) -> None:
        """Copies blocks the device evicted (their ids not yet reused) into host memory, making
        room by dropping older host blocks; one that cannot fit is dropped for good."""
        for eviction in evictions:
            block_hash = eviction.block_hash
            if block_hash in self._kv:  # computed again while held here: same KV, keep ours
                self._order.add(block_hash, eviction.retain_until)
                continue
            if not self._make_room(self.bytes_per_block):  # (room under a block: budget, or swap)
                self.num_dropped_blocks += 1  # its id is being reused: the block is gone
                continue
            try:
                keys, values = self.kv_cache.read_blocks([eviction.block_id])
                copy = (keys.cpu(), values.cpu())
            except (RuntimeError, MemoryError) as error:
                # The tier is a cache: a copy that fails (host memory exhausted) loses this
                # block's second life, never the block (its id is being reused by the caller).
                log.warning("a block's copy to host memory failed", error=str(error))
                self.num_dropped_blocks += 1
                continue
            self._kv[block_hash] = copy
            self._order.add(block_hash, eviction.retain_until)
            self._touched.append(block_hash)
            self.num_demoted_blocks += 1

    def promote(self, block_hash: int, block_id: int) -> bool:
        """Copies a held block's KV into device block `block_id` and forgets it here. False
        (nothing written) when the tier does not hold it."""
        entry = self._kv.pop(block_hash, None)
        if entry is None:
            return False
        self._order.discard(block_hash)
        self.kv_cache.write_blocks([block_id], *entry)
        self._touched.append(block_hash)
        self.num_promoted_blocks += 1
        return True

    def shrink_to(self, max_bytes: int) -> None:
        """Drops blocks in eviction order until the tier holds at most `max_bytes`."""
        while self._kv and self.num_bytes > max_bytes:
            self._drop(self._order.pop_victim())

    def take_touched(self) -> list[int]:
        """Hashes stored or dropped here since the last call (their state is `holds`)."""
        touched, self._touched = self._touched, []
        return touched

    def _make_room(self, num_bytes: int) -> bool:
        limit = self.limit_bytes()
        if num_bytes > limit:
            return False
        self.shrink_to(limit - num_bytes)
        return True

    def _drop(self, block_hash: int) -> None:
        del self._kv[block_hash]
        self._touched.append(block_hash)
        self.num_dropped_blocks += 1

    def check_invariants(self) -> None:
        assert set(self._order) == set(self._kv), "the eviction order and the store disagree"
        assert self.num_bytes <= self.capacity_bytes, "over the tier's budget"
        if self.swap_space is not None:
            space = self.swap_space
            assert space.used_bytes + space.reserved_bytes + self.num_bytes <= (
                space.capacity_bytes
            ), "the tier holds room promised to swapped sequences"
