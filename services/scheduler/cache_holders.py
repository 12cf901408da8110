"""Which workers hold a cached block: the prefix index read backwards, so a cache-aware choice
compares only the workers that hold a prompt's prefix, not all of them.

A worker holds some prefix of a prompt exactly when it holds the prompt's first block (the
index counts leading blocks), so the holders of `hashes[0]` are the only workers whose cached
prefix, prefill wait or decode affinity differs from an idle cache's; the rest are ranked by
load (`worker_index.py`). The map is kept from the same heartbeats as the prefix index, and
never by copying its rules: after each batch it asks the index, through its public answers,
whether the worker holds each hash the batch named (and, after a full set, each it held before);
a gap makes the index forget the worker, and so does this map.
"""

from __future__ import annotations

from services.scheduler.prefix_index import PrefixIndex


class CacheHolders:
    def __init__(self, index: PrefixIndex):
        self.index = index
        self._held: dict[str, set[int]] = {}  # peer id -> the hashes it holds, as indexed
        self._holders: dict[int, set[str]] = {}  # hash -> the peers holding it

    def holders(self, block_hash: int) -> set[str]:
        return self._holders.get(block_hash, set())

    def forget(self, peer_id: str) -> None:
        for block_hash in self._held.pop(peer_id, set()):
            self._drop(block_hash, peer_id)

    def applied(
        self, peer_id: str, in_order: bool, full: bool, stored: list[int], evicted: list[int]
    ) -> None:
        """A heartbeat's batch went to the index (`in_order`: what its `apply` answered)."""
        if not in_order:  # a gap: the index forgot the worker's set
            self.forget(peer_id)
            return
        held = self._held.setdefault(peer_id, set())
        named = set(stored)
        named.update(evicted)
        if full:
            named |= held
        # Set operations over the whole batch, not a question per hash: a full set names every
        # block the worker holds (a hundred thousand and more on a large one, every few seconds).
        held_now = self.index.held_among(peer_id, named)
        for block_hash in held_now - held:
            held.add(block_hash)
            self._holders.setdefault(block_hash, set()).add(peer_id)
        for block_hash in (held & named) - held_now:
            held.discard(block_hash)
            self._drop(block_hash, peer_id)

    def _drop(self, block_hash: int, peer_id: str) -> None:
        peers = self._holders.get(block_hash)
        if peers is not None:
            peers.discard(peer_id)
            if not peers:
                del self._holders[block_hash]
