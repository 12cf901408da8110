"""What a worker tells the scheduler about its prefix cache: numbered batches of block hashes.

Every heartbeat carries one batch: the hashes stored and evicted since the previous one, or the
whole set (`full`) on the first heartbeat after HELLO and then every `FULL_EVERY` heartbeats.
Batches are numbered 1, 2, ... from the worker's start; the scheduler that sees a number skipped
(or a worker that registered again) forgets the worker's set until the next full one. A stale
index thus lasts a few seconds at most, and costs only a miss: the worker looks its cache up.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared.engine.prefix_cache import PrefixCache

FULL_EVERY = 20  # heartbeats between full sets (10 s at the default 0.5 s interval)


@dataclass(frozen=True)
class CacheBatch:
    seq: int
    full: bool
    stored: list[int]
    evicted: list[int]


class CacheEventStream:
    def __init__(self, cache: PrefixCache, full_every: int = FULL_EVERY):
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.cache = cache
        self.full_every = full_every
        self._seq = 0

    def next_batch(self) -> CacheBatch:
        self._seq += 1
        events = self.cache.take_events()
        if (self._seq - 1) % self.full_every == 0:
            return CacheBatch(self._seq, True, self.cache.hashes(), [])
        # Each hash's last event is its state now: the two lists are disjoint, so the receiver
        # may apply them in any order.
        last: dict[int, str] = {}
        for kind, block_hash in events:
            last[block_hash] = kind
        stored = [h for h, kind in last.items() if kind == "stored"]
        evicted = [h for h, kind in last.items() if kind == "evicted"]
        return CacheBatch(self._seq, False, stored, evicted)
