"""The prefix cache as pure integers: the hash chain, LRU eviction, and the block manager's
refcounts under random operations (hypothesis)."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_chain import block_hash
from shared.engine.block_manager import BlockManager
from shared.engine.prefix_cache import CacheKey, PrefixCache, chain_hashes, root_hash

KEY = CacheKey("smollm2", "float32", 4)


def test_chain_names_full_blocks_only_and_depends_on_everything_before():
    root = root_hash(KEY)
    hashes = list(chain_hashes(root, list(range(10)), 4))
    assert len(hashes) == 2  # the 2 tokens of the third block are not a full block
    assert hashes[0] == block_hash(root, [0, 1, 2, 3])
    assert hashes[1] == block_hash(hashes[0], [4, 5, 6, 7])
    # Same second block after a different first one: a different hash.
    other = list(chain_hashes(root, [9, 1, 2, 3, 4, 5, 6, 7], 4))
    assert other[1] != hashes[1]
    # Continuing a chain from its last hash gives the same hashes.
    assert list(chain_hashes(hashes[0], [4, 5, 6, 7], 4)) == hashes[1:]


@pytest.mark.parametrize(
    "other",
    [
        CacheKey("other-model", "float32", 4),
        CacheKey("smollm2", "bfloat16", 4),
        CacheKey("smollm2", "float32", 8),
        CacheKey("smollm2", "float32", 4, scheme="v0"),
    ],
)
def test_every_field_of_the_key_and_the_salt_change_the_root(other):
    assert root_hash(other) != root_hash(KEY)
    assert root_hash(KEY, "tenant-a") != root_hash(KEY)
    assert root_hash(KEY, "tenant-a") != root_hash(KEY, "tenant-b")
    assert root_hash(KEY, "tenant-a") == root_hash(KEY, "tenant-a")


def test_hashes_are_stable_across_processes():
    """The cluster compares hashes from different processes: never Python's salted hash()."""
    assert block_hash(0, [1, 2, 3]) == 0xEB57CDA0323EEEE1  # blake2b, fixed for good
    assert root_hash(KEY) == root_hash(CacheKey("smollm2", "float32", 4))


def cached_manager(num_blocks: int, max_unreferenced: int | None = None) -> BlockManager:
    return BlockManager(num_blocks, 4, PrefixCache(max_unreferenced))


def test_unreferenced_blocks_stay_cached_and_are_evicted_least_recent_first():
    bm = cached_manager(4)
    cache = bm.prefix_cache
    ids = bm.allocate(3)
    for h, block_id in zip((10, 11, 12), ids, strict=True):
        assert cache.insert(h, block_id)
    bm.free([ids[1]])
    bm.free([ids[0]])
    bm.free([ids[2]])  # unreferenced order: ids[1], ids[0], ids[2]
    assert bm.num_free_blocks == 4 and cache.num_cached_blocks == 3
    assert bm.allocate(1) != ids  # the never-used free block goes first
    assert bm.allocate(1) == [ids[1]]  # then the least recently released
    assert cache.lookup(11) is None and cache.lookup(10) == ids[0]
    bm.take_cached([ids[0]])  # a hit makes it referenced: not evictable
    assert bm.allocate(1) == [ids[2]]
    assert cache.take_events() == [
        ("stored", 10),
        ("stored", 11),
        ("stored", 12),
        ("evicted", 11),
        ("evicted", 12),
    ]
    bm.check_invariants()


def test_a_hash_names_one_block_and_the_bound_evicts_beyond_it():
    bm = cached_manager(4, max_unreferenced=1)
    cache = bm.prefix_cache
    a, b = bm.allocate(2)
    assert cache.insert(7, a)
    assert not cache.insert(7, b)  # computed twice at once: the second copy is not named
    assert not cache.insert(8, a)
    c = bm.allocate(1)[0]
    cache.insert(9, c)
    bm.free([a, b, c])  # a table: its head outlives its tail
    assert cache.num_unreferenced == 1 and cache.lookup(7) == a and cache.lookup(9) is None
    bm.check_invariants()


def test_a_freed_tables_cached_prefix_is_evicted_from_its_tail():
    """Freed head first, a table's first block was the first evicted, and the lookup of the
    next turn (which stops at its first miss) found nothing of a prefix mostly still cached."""
    bm = cached_manager(8, max_unreferenced=3)
    cache = bm.prefix_cache
    table = bm.allocate(4)
    for h, block_id in zip((20, 21, 22, 23), table, strict=True):
        assert cache.insert(h, block_id)
    bm.free(table)  # over the bound by one: one is evicted
    assert [cache.lookup(h) is not None for h in (20, 21, 22, 23)] == [True, True, True, False]
    bm.check_invariants()


def test_bad_bound_and_taking_an_uncached_block_refused():
    with pytest.raises(ValueError, match="max_unreferenced"):
        PrefixCache(-1)
    bm = cached_manager(2)
    with pytest.raises(ValueError, match="not cached"):
        bm.take_cached(bm.allocate(1))


OPS = st.lists(
    st.tuples(st.sampled_from(["alloc", "name", "free", "hit"]), st.integers(0, 50)),
    max_size=80,
)


@settings(max_examples=200, deadline=None)
@given(OPS, st.sampled_from([None, 0, 2]))
def test_refcounts_never_negative_and_no_referenced_block_reused(ops, bound):
    """Random holders allocate, name, free and hit blocks; after every operation the block sets
    partition the pool, and allocate never hands out a block somebody still holds."""
    bm = cached_manager(8, bound)
    cache = bm.prefix_cache
    holders: list[list[int]] = []
    for op, arg in ops:
        if op == "alloc" and bm.can_allocate(1 + arg % 3):
            ids = bm.allocate(1 + arg % 3)
            held = {b for h in holders for b in h}
            assert not held & set(ids), "a referenced block was handed out again"
            holders.append(ids)
        elif op == "name" and holders:
            ids = holders[arg % len(holders)]
            cache.insert(arg, ids[0])
        elif op == "free" and holders:
            bm.free(holders.pop(arg % len(holders)))
        elif op == "hit" and cache.lookup(arg) is not None:
            block_id = cache.lookup(arg)
            bm.take_cached([block_id])
            holders.append([block_id])
        bm.check_invariants()
        for block_id in range(bm.num_blocks):
            held = sum(h.count(block_id) for h in holders)
            assert bm.ref_count(block_id) == held
    for ids in holders:
        bm.free(ids)
    assert bm.num_free_blocks == 8
    bm.check_invariants()
