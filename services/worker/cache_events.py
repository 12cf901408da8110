"""What a worker tells the scheduler about its prefix cache: numbered batches of block hashes.

Every heartbeat carries one batch: the hashes stored and evicted since the previous one, or the
whole set (`full`) on the first heartbeat after a HELLO (again) and then every `FULL_EVERY`
heartbeats.
Batches are numbered 1, 2, ... from the worker's start; the scheduler that sees a number skipped
(or a worker that registered again) forgets the worker's set until the next full one. A stale
index thus lasts a few seconds at most, and costs only a miss: the worker looks its cache up.

With a host tier the set is what the worker can serve from either tier: a block moving from the
device to host RAM (or back) is not news to the scheduler, one dropped from host RAM is evicted.
So a batch names each hash touched since the last one (by either tier) by its state now.
"""

from __future__ import annotations

from dataclasses import dataclass

from shared import wire
from shared.engine.host_tier import HostTier
from shared.engine.prefix_cache import PrefixCache

FULL_EVERY = 20  # heartbeats between full sets (10 s at the default 0.5 s interval)
# Hashes one heartbeat carries (the wire's bound on its lists, both lists together: a header
# past its bound was dropped by the scheduler as malformed, with the load it reported). A set
# larger (a big host tier) goes as its newest hashes: the scheduler's index then misses the
# older ones, which costs those prompts a lookup, never a wrong answer.
MAX_HASHES = wire.MAX_TOKEN_IDS


@dataclass(frozen=True)
class CacheBatch:
    seq: int
    full: bool
    stored: list[int]
    evicted: list[int]


class CacheEventStream:
    def __init__(
        self, cache: PrefixCache, full_every: int = FULL_EVERY, host_tier: HostTier | None = None
    ):
        if full_every < 1:
            raise ValueError(f"full_every must be >= 1, got {full_every}")
        self.cache = cache
        self.host_tier = host_tier
        self.full_every = full_every
        self._seq = 0
        self._full_next = False

    def servable(self, block_hash: int) -> bool:
        """The worker holds this block in one tier or the other."""
        if self.cache.lookup(block_hash) is not None:
            return True
        return self.host_tier is not None and self.host_tier.holds(block_hash)

    def resync(self) -> None:
        """The next batch is the whole set: the worker registered again, and the scheduler
        forgot its set (it waited for the next full one, up to `full_every` heartbeats)."""
        self._full_next = True

    def next_batch(self) -> CacheBatch:
        self._seq += 1
        touched = dict.fromkeys(block_hash for _, block_hash in self.cache.take_events())
        if self.host_tier is not None:
            touched.update(dict.fromkeys(self.host_tier.take_touched()))
        # (More changes than a heartbeat carries: the whole set, bounded, says it instead.)
        due = (self._seq - 1) % self.full_every == 0 or len(touched) > MAX_HASHES
        if due or self._full_next:
            self._full_next = False
            hashes = self.cache.hashes()
            if self.host_tier is not None:  # a block computed again while held there is in both
                # (Host blocks first: the device's are the newest.)
                hashes = list(dict.fromkeys(self.host_tier.hashes() + hashes))
            return CacheBatch(self._seq, True, hashes[-MAX_HASHES:], [])
        # Each touched hash by its state now: the two lists are disjoint, so the receiver may
        # apply them in any order.
        stored = [h for h in touched if self.servable(h)]
        evicted = [h for h in touched if not self.servable(h)]
        return CacheBatch(self._seq, False, stored, evicted)
