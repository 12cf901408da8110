"""The prefix cache: full KV blocks found again by a hash of everything before and in them.

A full block (exactly `block_size` tokens) is named by a hash chained over the previous block's
hash and the block's token ids, starting from a root that hashes the versioned cache key (model,
dtype, block size, hash scheme) and, unless tenants share the cache, the tenant or a per-request
`cache_salt`. Two sequences whose hashes agree up to block i have the same tokens in the same
positions before it under the same model, so block i holds the same keys and values in both: it
is computed once and shared read-only by reference count (a full block is never written again,
so copy-on-write is never needed).

`PrefixCache` deals in integers only. It maps hashes to block ids and keeps the cached blocks no
sequence references in least-recently-used order. Such a block is neither used nor free: the
block manager counts it as available and takes it back (`evict_one`) only when its free queue is
empty, so a cached block lives as long as the pool does not need the room. `max_unreferenced`
bounds how many unreferenced blocks the cache keeps (None: as many as the pool has). A block
released with a retention deadline (a decode worker's finished turn, whose conversation likely
returns after a tool call) is evicted only after every unprotected one (`retention.py`). A block
keeps its deadline while it is referenced, and its last holder's release gives it the later of
that and its own: a newcomer that takes a conversation's cached prefix and gives it back (not
admitted this step, a reservation refused or lapsed) leaves it as protected as it found it. With
a host tier (`host_tier.py`) an evicted block's KV moves to host RAM, with its deadline, and can
come back on a hit.

Stored and evicted hashes are recorded in order (`take_events`), so a worker can tell the cluster
scheduler which prefixes it holds.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from shared.engine.block_chain import chain_blocks, digest
from shared.engine.retention import Clock, RetentionLru

HASH_SCHEME = "blake2b64-chain-v1"  # change when the hash changes: old indexes must not match


@dataclass(frozen=True)
class CacheKey:
    """Everything besides the tokens that changes a block's KV; workers and the scheduler must
    agree on it or the hashes never match (refused at registration)."""

    model: str
    dtype: str
    block_size: int
    scheme: str = HASH_SCHEME

    def __str__(self) -> str:
        return f"{self.scheme}|{self.model}|{self.dtype}|{self.block_size}"


# A worker announces its key with whether tenants share its cache (the scheduler then hashes
# prompts without the tenant salt): "<key>|tenants:own" or "<key>|tenants:shared".
TENANTS_SEPARATOR = "|tenants:"


def worker_cache_key(key: CacheKey, shared_between_tenants: bool) -> str:
    return f"{key}{TENANTS_SEPARATOR}{'shared' if shared_between_tenants else 'own'}"


def root_hash(key: CacheKey, salt: str | None = None) -> int:
    """The parent hash of a sequence's first block: the cache key, plus the salt (tenant or
    `cache_salt`) that keeps one tenant's blocks from matching another's."""
    return root_hash_of(str(key), salt)


def root_hash_of(key_text: str, salt: str | None = None) -> int:
    """`root_hash` from the key's text, as workers send it to the scheduler."""
    salt_part = "" if salt is None else f"|salt:{salt}"
    return digest(f"{key_text}{salt_part}".encode())


def chain_hashes(
    root: int, token_ids: Sequence[int], block_size: int, parent: int | None = None, start: int = 0
) -> list[int]:
    """Hashes of the full blocks of `token_ids` from block index `start` on (whose parent hash is
    `parent`, or the root when `start` is 0)."""
    first = root if parent is None else parent
    num_blocks = max(0, len(token_ids) // block_size - start)
    return chain_blocks(first, token_ids, block_size, start, num_blocks)


def prompt_chain(
    worker_key: str, block_size: int, token_ids: Sequence[int], salt: str | None
) -> list[int]:
    """The chain of a prompt's full blocks before the one holding its last token (a worker
    always computes that one), as workers announcing `worker_key` (`worker_cache_key`) name
    them: salted by the tenant unless they share blocks between tenants. The scheduler's index
    hashes prompts with it, and so do the planner's simulated workers."""
    key_text, _, tenants = worker_key.rpartition(TENANTS_SEPARATOR)
    root = root_hash_of(key_text, None if tenants == "shared" else salt)
    num_blocks = max(0, (len(token_ids) - 1) // block_size)
    return chain_blocks(root, token_ids, block_size, 0, num_blocks)


class Eviction(NamedTuple):
    """A cached block the pool took back: its id (free now), its hash and its protection."""

    block_id: int
    block_hash: int
    retain_until: float | None = None


class PrefixCache:
    def __init__(self, max_unreferenced: int | None = None, clock: Clock = time.monotonic):
        if max_unreferenced is not None and max_unreferenced < 0:
            raise ValueError(f"max_unreferenced must be >= 0, got {max_unreferenced}")
        self.max_unreferenced = max_unreferenced
        self._block_of_hash: dict[int, int] = {}
        self._hash_of_block: dict[int, int] = {}
        # Cached blocks no sequence holds, in eviction order (least recently used and
        # unprotected first).
        self._unreferenced: RetentionLru[int] = RetentionLru(clock)
        # Referenced cached blocks' retention deadlines, kept for their release (`release`).
        self._held_deadlines: dict[int, float] = {}
        self._events: list[tuple[str, int]] = []  # ("stored" | "evicted", hash), in order
        # Blocks copied back from the host tier that no admitted prompt has counted yet: the
        # first to take one counts it as a host hit (a decode worker pins them for a turn it
        # prefills itself a moment later).
        self._from_host: set[int] = set()
        self.num_query_tokens = 0  # prompt tokens looked up
        self.num_hit_tokens = 0  # of them, found cached (in either tier)
        self.num_host_hit_tokens = 0  # of the hits, copied back from the host tier

    @property
    def num_cached_blocks(self) -> int:
        return len(self._block_of_hash)

    @property
    def num_unreferenced(self) -> int:
        return len(self._unreferenced)

    def lookup(self, block_hash_: int) -> int | None:
        return self._block_of_hash.get(block_hash_)

    def hash_of(self, block_id: int) -> int | None:
        return self._hash_of_block.get(block_id)

    def hashes(self) -> list[int]:
        """Every cached hash (a worker's full set, sent again after a gap)."""
        return list(self._block_of_hash)

    def is_unreferenced(self, block_id: int) -> bool:
        return block_id in self._unreferenced

    def insert(self, block_hash_: int, block_id: int, retain_until: float | None = None) -> bool:
        """Names a referenced, fully computed block by its hash (protected until `retain_until`
        once released, when given: a block back from the host tier keeps its deadline). False
        (and nothing changes) when the hash already names another block (two sequences computed
        the same prefix at once: the first stays cached, the second block is freed as usual) or
        the block is named."""
        if block_hash_ in self._block_of_hash or block_id in self._hash_of_block:
            return False
        self._block_of_hash[block_hash_] = block_id
        self._hash_of_block[block_id] = block_hash_
        if retain_until is not None:
            self._held_deadlines[block_id] = retain_until
        self._events.append(("stored", block_hash_))
        return True

    def touch(self, block_id: int) -> None:
        """A sequence takes a cached block: it is referenced again, so not evictable. Its
        protection is kept for its release."""
        deadline = self._unreferenced.retain_until(block_id)
        if self._unreferenced.discard(block_id) and deadline is not None:
            self._held_deadlines[block_id] = deadline

    def release(self, block_id: int, retain_until: float | None = None) -> bool:
        """The last holder of a block let it go. True when the cache keeps it (it is named),
        protected from eviction until the later of `retain_until` and the deadline it had when
        taken; the caller frees it otherwise. The caller then frees what `overflow` evicts."""
        held = self._held_deadlines.pop(block_id, None)
        if block_id not in self._hash_of_block:
            return False
        deadlines = [d for d in (held, retain_until) if d is not None]
        # Most recently used: evicted last.
        self._unreferenced.add(block_id, max(deadlines) if deadlines else None)
        return True

    def mark_from_host(self, block_id: int) -> None:
        self._from_host.add(block_id)

    def count_from_host(self, block_ids: list[int]) -> int:
        """How many of these blocks came from the host tier uncounted; they are counted now."""
        found = self._from_host.intersection(block_ids)
        self._from_host -= found
        return len(found)

    def retain_until(self, block_id: int) -> float | None:
        return self._unreferenced.retain_until(block_id)

    @property
    def num_retained(self) -> int:
        """Unreferenced blocks whose protection holds now."""
        return self._unreferenced.num_protected()

    def overflow(self) -> list[Eviction]:
        """Blocks evicted to keep within `max_unreferenced`; the caller frees them."""
        evicted = []
        while self.max_unreferenced is not None and len(self._unreferenced) > self.max_unreferenced:
            evicted.append(self.evict_one())
        return evicted

    def evict_one(self) -> Eviction:
        """Forgets the next unreferenced block in eviction order; its id is free now."""
        block_id = self._unreferenced.victim()
        retain_until = self._unreferenced.retain_until(block_id)
        self._unreferenced.discard(block_id)
        self._from_host.discard(block_id)
        block_hash_ = self._hash_of_block.pop(block_id)
        del self._block_of_hash[block_hash_]
        self._events.append(("evicted", block_hash_))
        return Eviction(block_id, block_hash_, retain_until)

    def record_query(
        self, num_query_tokens: int, num_hit_tokens: int, num_host_hit_tokens: int = 0
    ) -> None:
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens
        self.num_host_hit_tokens += num_host_hit_tokens

    def take_events(self) -> list[tuple[str, int]]:
        events, self._events = self._events, []
        return events

    def check_invariants(self, ref_counts: list[int]) -> None:
        assert len(self._block_of_hash) == len(self._hash_of_block)
        assert self._from_host <= self._hash_of_block.keys(), "an uncached block marked"
        for block_hash_, block_id in self._block_of_hash.items():
            assert self._hash_of_block[block_id] == block_hash_
        for block_id in self._unreferenced:
            assert block_id in self._hash_of_block, f"unreferenced block {block_id} not cached"
            assert ref_counts[block_id] == 0, f"block {block_id} referenced yet evictable"
        for block_id in self._hash_of_block:
            assert (ref_counts[block_id] == 0) == (block_id in self._unreferenced), block_id
        for block_id in self._held_deadlines:
            assert block_id in self._hash_of_block, f"uncached block {block_id} holds a deadline"
            assert ref_counts[block_id] > 0, f"unreferenced block {block_id} holds a deadline"
