"""Least-recently-used order with think-time protection: the eviction order of both cache tiers.

An agent's conversation pauses while its tool call runs, and plain LRU evicts that conversation's
KV first under a stream of other traffic, just before its next turn needs it. So a key may be
protected until a deadline (a decode worker's finished turn: `finished_retention_s`). The victim
is the least recently used key that is not protected (a protection past its deadline counts as
none); only when every key is protected does the least recently used protected key go. So
protection ranks keys, it never refuses room: a full pool still evicts.

Keys are added most recent last. Deadlines are expected in the order their keys are added (one
retention time, one clock), so the protected key with the earliest deadline is the oldest one; a
shorter protection added later only expires behind the longer ones before it (so does a deadline
a key keeps when used and added again, `prefix_cache.PrefixCache.release`). A deadline already
past when its key is added protects nothing: the key goes in unprotected.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)

Clock = Callable[[], float]


class RetentionLru(Generic[K]):
    def __init__(self, clock: Clock = time.monotonic):
        self.clock = clock
        self._ticks = itertools.count()  # recency: a larger tick was added later
        self._plain: OrderedDict[K, int] = OrderedDict()  # key -> tick, oldest first
        # Protected keys -> (tick, deadline), oldest (and so earliest deadline) first.
        self._protected: OrderedDict[K, tuple[int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._plain) + len(self._protected)

    def __contains__(self, key: object) -> bool:
        return key in self._plain or key in self._protected

    def __iter__(self) -> Iterator[K]:
        yield from self._plain
        yield from self._protected

    def add(self, key: K, retain_until: float | None = None) -> None:
        """Adds (or moves) `key` as the most recently used, protected until `retain_until`."""
        self.discard(key)
        tick = next(self._ticks)
        if retain_until is None or retain_until <= self.clock():
            self._plain[key] = tick
        else:
            self._protected[key] = (tick, retain_until)

    def discard(self, key: K) -> bool:
        return self._plain.pop(key, None) is not None or self._protected.pop(key, None) is not None

    def retain_until(self, key: K) -> float | None:
        """The key's protection deadline (None: unprotected or absent)."""
        entry = self._protected.get(key)
        return entry[1] if entry is not None else None

    def num_protected(self) -> int:
        """Keys whose protection has not expired yet."""
        now = self.clock()
        return sum(1 for _, deadline in self._protected.values() if deadline > now)

    def victim(self) -> K:
        """The key to evict next (raises KeyError when empty)."""
        if not self:
            raise KeyError("nothing to evict")
        protected = next(iter(self._protected.items()), None)
        if protected is not None and protected[1][1] > self.clock():
            protected = None  # the oldest protection holds, so every later one does
        plain = next(iter(self._plain.items()), None)
        if plain is None and protected is None:
            return next(iter(self._protected))  # all protected: the least recently used goes
        if plain is None or (protected is not None and protected[1][0] < plain[1]):
            return protected[0]
        return plain[0]

    def pop_victim(self) -> K:
        key = self.victim()
        self.discard(key)
        return key
