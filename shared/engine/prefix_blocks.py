"""A sequence's blocks and the prefix cache: a newcomer takes the longest run of cached blocks
its tokens start with (and skips computing them); blocks that become full and computed are named
in the cache for later sequences. Between the block manager (integer ids, refcounts) and the
prefix cache (hashes, LRU), which know nothing of sequences."""

from __future__ import annotations

from collections.abc import Iterable

from shared.engine.block_manager import BlockManager
from shared.engine.prefix_cache import chain_hashes
from shared.engine.sequence import Sequence


def _extend_hashes(seq: Sequence, block_size: int, num_blocks: int) -> None:
    """Extends `seq.block_hashes` to its first `num_blocks` full blocks (tokens never change, so
    hashes once computed stay valid through preemption)."""
    assert seq.cache_root is not None
    start = len(seq.block_hashes)
    if start >= num_blocks:
        return
    parent = seq.block_hashes[-1] if start else seq.cache_root
    token_ids = seq.token_ids_slice(start * block_size, num_blocks * block_size)
    seq.block_hashes.extend(chain_hashes(parent, token_ids, block_size))


def attach_cached_prefix(seq: Sequence, manager: BlockManager, max_loads: int | None = None) -> int:
    """Gives a sequence about to be prefilled from token 0 the longest run of cached blocks its
    tokens start with (at most `max_loads` of them copied back from the host tier), and counts
    them computed; returns the tokens so skipped. At least the last token is left to compute
    (its logits give the next token), so the block holding it is never taken from the cache and
    a cached block is never written."""
    cache = manager.prefix_cache
    if cache is None or seq.cache_root is None or seq.block_ids or seq.num_computed_tokens:
        return 0
    block_size = manager.block_size
    max_blocks = (seq.num_tokens - 1) // block_size
    _extend_hashes(seq, block_size, max_blocks)
    found, _ = take_prefix(manager, seq.block_hashes[:max_blocks], max_loads)
    seq.block_ids = found
    seq.num_registered_blocks = len(found)
    seq.num_computed_tokens = len(found) * block_size
    return seq.num_computed_tokens


def take_cached_prefix(manager: BlockManager, hashes: Iterable[int]) -> list[int]:
    """Takes the cached blocks named by the leading `hashes` (up to the first miss)."""
    return take_prefix(manager, hashes)[0]


def take_prefix(
    manager: BlockManager, hashes: Iterable[int], max_loads: int | None = None
) -> tuple[list[int], int]:
    """Takes the blocks named by the leading `hashes`, in the device cache or else copied back
    from the host tier (at most `max_loads` of those), up to the first miss. Returns the block
    ids and how many came from the host. A chain may alternate between the tiers: each hash is
    looked up in turn, since bringing one block back can evict a later one to the host."""
    cache = manager.prefix_cache
    found: list[int] = []
    num_loaded = 0
    if cache is None:
        return found, num_loaded
    for block_hash_ in hashes:
        block_id = cache.lookup(block_hash_)
        if block_id is not None:
            manager.take_cached([block_id])
        elif max_loads is None or num_loaded < max_loads:
            block_id = manager.load_from_host(block_hash_)
            if block_id is None:
                break
            num_loaded += 1
        else:
            break
        found.append(block_id)
    return found, num_loaded


def detach_blocks(seq: Sequence, manager: BlockManager) -> None:
    """Undoes `attach_cached_prefix` for a sequence that was not admitted after all."""
    manager.free(seq.block_ids)
    seq.block_ids = []
    seq.num_registered_blocks = 0
    seq.num_computed_tokens = 0


def cache_computed_blocks(seq: Sequence, manager: BlockManager) -> None:
    """Names the sequence's blocks that became full and computed, so later sequences find them."""
    cache = manager.prefix_cache
    if cache is None or seq.cache_root is None:
        return
    block_size = manager.block_size
    num_full = min(seq.num_computed_tokens // block_size, len(seq.block_ids))
    if num_full <= seq.num_registered_blocks:
        return
    _extend_hashes(seq, block_size, num_full)
    for index in range(seq.num_registered_blocks, num_full):
        cache.insert(seq.block_hashes[index], seq.block_ids[index])
    seq.num_registered_blocks = num_full
