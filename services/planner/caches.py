"""A simulated worker's prefix cache: which prompt blocks it holds computed, and what its
heartbeats tell the scheduler about them.

Blocks are named as the real workers name them (`shared/engine/prefix_cache.py`: hashes chained
over the tokens from a root of the cache key and the tenant), so the real scheduler core's
prefix index and cache-aware placement read the simulated workers' batches as they read real
ones. What is simplified: the cache is a least-recently-used set of hashes of at most
`capacity` blocks (the worker's KV pool), beside the blocks its requests hold rather than
inside them (the real pool lends free blocks to the cache and takes them back under pressure),
and generated tokens are never cached (the simulator does not know them: a conversation's next
turn finds its previous prompt cached, not the answer it got).

Each heartbeat carries the hashes stored and evicted since the last one, numbered, and the
whole set on the first (as `services/worker/cache_events.py` sends them).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.engine.prefix_cache import CacheKey, prompt_chain, worker_cache_key

# Every simulated worker's cache key (the cluster's must agree): tenants keep their own blocks,
# as the real workers' default (`share_prefix_cache` off).
SIM_CACHE_KEY = worker_cache_key(CacheKey("simulated", "simulated", 0), False)


class SimCache:
    def __init__(self, block_size: int, capacity: int):
        if block_size < 1 or capacity < 0:
            raise ValueError("a cache needs block_size >= 1 and capacity >= 0")
        self.block_size = block_size
        self.capacity = capacity
        self._held: OrderedDict[int, None] = OrderedDict()  # least recently used first
        self._touched: set[int] = set()  # stored or evicted since the last heartbeat's batch
        self._seq = 0

    def __len__(self) -> int:
        return len(self._held)

    def prompt_hashes(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        """The chain of the full blocks before the one holding the last token, as the
        scheduler's index hashes a prompt."""
        return prompt_chain(SIM_CACHE_KEY, self.block_size, token_ids, salt)

    def num_cached_blocks(self, hashes: list[int]) -> int:
        """The leading blocks of the chain held, each touched (recently used)."""
        num_blocks = 0
        for h in hashes:
            if h not in self._held:
                break
            self._held.move_to_end(h)
            num_blocks += 1
        return num_blocks

    def store(self, hashes: list[int]) -> None:
        """The blocks were computed (or received) here: held, most recently used, the least
        recently used evicted past the capacity."""
        for h in hashes:
            if h in self._held:
                self._held.move_to_end(h)
                continue
            self._held[h] = None
            self._touched.add(h)
        while len(self._held) > self.capacity:
            h, _ = self._held.popitem(last=False)
            self._touched.add(h)

    def heartbeat_fields(self) -> dict:
        """This heartbeat's batch: the whole set first, then each hash touched since the last
        by its state now (stored and evicted in between is evicted: the index drops it)."""
        self._seq += 1
        full = self._seq == 1
        touched = sorted(self._touched)
        stored = list(self._held) if full else [h for h in touched if h in self._held]
        evicted = [] if full else [h for h in touched if h not in self._held]
        self._touched.clear()
        return dict(
            cache_events_seq=self._seq,
            cache_full=full,
            cache_stored=stored,
            cache_evicted=evicted,
        )
