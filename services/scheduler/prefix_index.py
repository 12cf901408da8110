"""The scheduler's index of which worker holds which cached prefix, fed by the workers' events.

Workers name their cached KV blocks by hashes chained over the tokens
(`shared/engine/prefix_cache.py`), so the scheduler hashes a request's prompt the same way and
counts, per worker, how many of its leading blocks the worker holds: the prompt tokens that
worker would not compute. The index is a hint, never a promise: a worker looks its own cache up
when the request arrives, so a stale entry costs a miss, never a wrong answer.

Every worker's heartbeat carries a numbered batch of stored and evicted hashes, or its whole
set. The index applies a batch only when it follows the previous one; after a gap, or when a
worker registers again, it forgets that worker's set until the next full one arrives.

The cache key (model, dtype, block size, hash scheme) must be the same on every worker: the
first worker to register sets the cluster's, and a worker with another is refused (its hashes
would silently never match). The salt of a request's chain is its tenant, as the workers use.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from shared.engine.prefix_cache import prompt_chain


@dataclass
class WorkerCache:
    hashes: set[int] = field(default_factory=set)
    last_seq: int = 0
    synced: bool = False  # a full set has arrived and no batch was missed since


class PrefixIndex:
    def __init__(self) -> None:
        self.cache_key: str | None = None  # the cluster's, set by the first worker with a cache
        self.block_size = 0
        self._workers: dict[str, WorkerCache] = {}
        self.num_gaps = 0  # batches found missing (a drifting index made visible)

    def refusal(self, cache_key: str | None, peer_id: str | None = None) -> str | None:
        """Why a worker with this key may not join, or None. `peer_id`: the worker's, which may
        be registered already (restarted with another key before the scheduler saw it go): its
        HELLO replaces its old registration, so only the other workers' key counts."""
        if cache_key is None or self.cache_key is None or cache_key == self.cache_key:
            return None
        if peer_id is not None and all(other == peer_id for other in self._workers):
            return None  # no other worker keeps the cluster's key: this one sets the next
        return (
            f"prefix cache key {cache_key!r} differs from the cluster's {self.cache_key!r}: "
            "model, dtype, block size and hash scheme must agree, or no hash would ever match"
        )

    def register(self, peer_id: str, cache_key: str | None, block_size: int) -> None:
        """A worker said HELLO (again): its set is unknown until its next full one."""
        self.remove(peer_id)
        if cache_key is None:
            return
        assert self.refusal(cache_key) is None, "check refusal() first"
        self.cache_key = cache_key
        self.block_size = block_size
        self._workers[peer_id] = WorkerCache()

    def remove(self, peer_id: str) -> None:
        self._workers.pop(peer_id, None)
        if not self._workers:
            # No worker keeps a cache now: the next one sets the cluster's key (kept, a rollout
            # of another model, dtype or block size refused every new worker until a restart).
            self.cache_key = None

    def apply(
        self, peer_id: str, seq: int, full: bool, stored: list[int], evicted: list[int]
    ) -> bool:
        """One heartbeat's batch; False when it revealed a gap (the set is then forgotten)."""
        worker = self._workers.get(peer_id)
        if worker is None or seq == 0:
            return True
        gap = False
        if full:
            worker.hashes = set(stored)
            worker.synced = True
        elif worker.synced and seq == worker.last_seq + 1:
            worker.hashes.difference_update(evicted)
            worker.hashes.update(stored)
        elif worker.synced:
            gap = True
            self.num_gaps += 1
            worker.hashes = set()
            worker.synced = False
        worker.last_seq = seq
        return not gap

    def prompt_hashes(self, token_ids: Sequence[int], salt: str | None) -> list[int]:
        """The chain of a prompt's full blocks, as a worker of this cluster names them. The
        block holding the last token is left out: a worker always computes it."""
        if self.cache_key is None:
            return []
        return prompt_chain(self.cache_key, self.block_size, token_ids, salt)

    def num_cached_tokens(self, peer_id: str, hashes: list[int]) -> int:
        """Prompt tokens the worker holds as a cached prefix, as far as the index knows."""
        worker = self._workers.get(peer_id)
        if worker is None or not worker.synced:
            return 0
        num_blocks = 0
        for h in hashes:
            if h not in worker.hashes:
                break
            num_blocks += 1
        return num_blocks * self.block_size

    def held_among(self, peer_id: str, hashes: set[int]) -> set[int]:
        """Which of these hashes the worker holds, as far as the index knows: the hashes `h`
        with `num_cached_tokens(peer_id, [h]) > 0`, asked of a whole batch at once (a full set
        is a worker's every block, and a question per hash held the scheduler's loop for
        tenths of a second)."""
        worker = self._workers.get(peer_id)
        if worker is None or not worker.synced or self.block_size <= 0:
            return set()
        return hashes & worker.hashes

    def num_hashes(self, peer_id: str) -> int:
        worker = self._workers.get(peer_id)
        return len(worker.hashes) if worker is not None else 0
