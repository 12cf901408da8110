"""The prefix cache's host tier and think-time retention as units: eviction order (with a fake
clock), the byte budget never exceeded, swapped sequences taking their room back first,
refcounts and KV contents through random demotions and promotions (hypothesis), and the cache
events the scheduler hears (a block moving to host RAM stays servable; one dropped is evicted)."""

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from services.worker.cache_events import CacheEventStream
from shared.engine.block_manager import BlockManager
from shared.engine.host_tier import HostTier
from shared.engine.kv_cache import KVCache, bytes_per_block
from shared.engine.prefix_blocks import take_prefix
from shared.engine.prefix_cache import Eviction, PrefixCache
from shared.engine.retention import RetentionLru
from shared.engine.swap import SwapSpace
from tests.helpers import TINY_KV_CONFIG

BLOCK = 4
CONFIG = TINY_KV_CONFIG
BPB = bytes_per_block(CONFIG, BLOCK, torch.float32)  # 256 bytes


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_retention_lru_evicts_unprotected_first_and_expired_protection_counts_as_none():
    clock = FakeClock()
    lru = RetentionLru(clock)
    lru.add("turn-a", retain_until=130.0)
    lru.add("x")
    lru.add("turn-b", retain_until=131.0)
    lru.add("y")
    assert [lru.pop_victim(), lru.pop_victim()] == ["x", "y"]  # unprotected, oldest first
    assert lru.victim() == "turn-a"  # every key protected: the least recently used goes
    lru.add("z")
    clock.now = 130.5  # turn-a's protection lapsed; it is older than z
    assert [lru.pop_victim(), lru.pop_victim(), lru.pop_victim()] == ["turn-a", "z", "turn-b"]
    with pytest.raises(KeyError):
        lru.victim()
    lru.add("w", retain_until=200.0)
    lru.add("w")  # used again and released without protection: plain, most recent
    assert lru.retain_until("w") is None and len(lru) == 1


def cached_manager(num_blocks: int, clock=None) -> BlockManager:
    return BlockManager(num_blocks, BLOCK, PrefixCache(clock=clock or FakeClock()))


def test_a_finished_turns_blocks_are_evicted_last_until_their_deadline():
    clock = FakeClock()
    bm = cached_manager(4, clock)
    cache = bm.prefix_cache
    ids = bm.allocate(4)
    for h, block_id in enumerate(ids):
        cache.insert(h, block_id)
    bm.free(ids[:2], retain_until=clock.now + 30)  # a finished turn, think time 30 s
    bm.free(ids[2:])  # a one-off prompt, released later
    assert cache.retain_until(ids[0]) == 130.0 and cache.num_retained == 2
    # The one-off goes first although more recent (a table's tail before its head).
    assert bm.allocate(2) == [ids[3], ids[2]]
    assert bm.allocate(1) == [ids[1]]  # under pressure the turn goes too: room is never refused
    cache.insert(7, ids[2])
    bm.free(ids[2:])  # ids[2] cached again (plain, more recent than ids[0]); ids[3] free
    clock.now = 131.0
    assert cache.num_retained == 0
    assert bm.allocate(2) == [ids[3], ids[0]]  # expired: plain LRU again, and it is the oldest
    bm.check_invariants()


def tier_manager(num_blocks: int, tier_blocks: int, swap_blocks: int | None = None, clock=None):
    """A block manager with a host tier of `tier_blocks` in a swap space of `swap_blocks`; every
    device block's KV is filled with its hash, so copies can be checked."""
    clock = clock or FakeClock()
    kv = KVCache(CONFIG, num_blocks, BLOCK)
    swap = SwapSpace((swap_blocks if swap_blocks is not None else tier_blocks) * BPB)
    tier = HostTier(tier_blocks * BPB, BPB, kv, swap, clock)
    bm = BlockManager(num_blocks, BLOCK, PrefixCache(clock=clock), tier)
    return bm, tier, kv, swap


def fill(kv: KVCache, block_id: int, value: float) -> None:
    keys, values = kv.read_blocks([block_id])
    kv.write_blocks([block_id], torch.full_like(keys, value), torch.full_like(values, -value))


def content(kv: KVCache, block_id: int) -> float:
    keys, values = kv.read_blocks([block_id])
    assert torch.all(keys == keys.flatten()[0]) and torch.equal(values, -keys)
    return float(keys.flatten()[0])


def computed(bm: BlockManager, kv: KVCache, hashes: list[int], **free) -> list[int]:
    """Blocks named `hashes`, their KV computed (filled with the hash), then released one by
    one in that order (so the first is the least recently used: not a table, whose blocks go
    back last first)."""
    ids = bm.allocate(len(hashes))
    for h, block_id in zip(hashes, ids, strict=True):
        fill(kv, block_id, h)
        assert bm.prefix_cache.insert(h, block_id)
    for block_id in ids:
        bm.free([block_id], **free)
    return ids


def test_evicted_blocks_go_to_host_and_come_back_on_a_hit_with_their_kv():
    bm, tier, kv, _ = tier_manager(num_blocks=4, tier_blocks=8)
    computed(bm, kv, [10, 11, 12, 13])
    taken = bm.allocate(3)  # a newcomer needs room: 10, 11, 12 move to host RAM
    assert [tier.holds(h) for h in (10, 11, 12, 13)] == [True, True, True, False]
    assert tier.num_bytes == 3 * BPB and bm.prefix_cache.lookup(10) is None
    bm.free(taken)
    found, num_loaded = take_prefix(bm, [10, 11, 12, 13, 14])
    assert num_loaded == 3 and len(found) == 4  # 14 was never cached: the chain stops there
    assert [content(kv, b) for b in found] == [10, 11, 12, 13]
    assert not tier.holds(10) and bm.prefix_cache.lookup(10) == found[0]  # one tier at a time
    assert all(bm.ref_count(b) == 1 for b in found)
    # The first prompt admitted on them counts the copied-back ones as host hits, once.
    assert bm.prefix_cache.count_from_host(found) == 3
    assert bm.prefix_cache.count_from_host(found) == 0
    bm.free(found)
    bm.check_invariants()
    tier.check_invariants()


def test_a_copy_to_host_that_fails_loses_that_copy_not_the_blocks():
    """The host copy of an evicted block raising (host memory exhausted) escaped mid-allocation:
    the evicted ids were in no free queue, no cache and no table, and the pool shrank for good
    (a decode worker's free-block reports with it)."""
    bm, tier, kv, _ = tier_manager(num_blocks=4, tier_blocks=8)
    computed(bm, kv, [10, 11, 12, 13])

    def no_host_memory(block_ids):
        raise RuntimeError("out of host memory")

    kv.read_blocks = no_host_memory  # type: ignore[method-assign]
    taken = bm.allocate(3)  # evicts 10, 11, 12: their host copies fail, the blocks are reused
    assert len(taken) == 3 and tier.num_bytes == 0 and not tier.holds(10)
    assert tier.num_dropped_blocks == 3
    bm.free(taken)
    bm.check_invariants()
    tier.check_invariants()
    assert bm.num_free_blocks == 4


def test_an_evicted_block_that_cannot_fit_counts_as_dropped():
    """The swap space's room all promised to a swapped sequence, evicted blocks find no room
    in the tier: lost for good, as a copy that fails is, and they went uncounted (the count
    told of fewer losses than there were)."""
    bm, tier, kv, swap = tier_manager(num_blocks=4, tier_blocks=4, swap_blocks=4)
    swap.reserve(4 * BPB)
    computed(bm, kv, [10, 11, 12, 13])
    taken = bm.allocate(3)  # evicts 10, 11, 12: no room for any of them
    assert len(taken) == 3 and tier.num_blocks == 0
    assert (tier.num_demoted_blocks, tier.num_dropped_blocks) == (0, 3)
    # A tier with no room of its own drops what it is handed the same way.
    empty = HostTier(0, BPB, kv)
    empty.demote([Eviction(taken[0], 20), Eviction(taken[1], 21, retain_until=130.0)])
    assert (empty.num_blocks, empty.num_dropped_blocks) == (0, 2)
    tier.check_invariants()
    empty.check_invariants()


def test_the_tier_drops_least_recently_used_first_and_never_exceeds_its_budget():
    clock = FakeClock()
    bm, tier, kv, _ = tier_manager(num_blocks=2, tier_blocks=3, clock=clock)
    computed(bm, kv, [1, 2])
    computed(bm, kv, [3, 4], retain_until=clock.now + 30)  # evicts 1, 2 to host
    computed(bm, kv, [5, 6])  # evicts 3, 4 (retained: they still go, to host): host is full
    assert tier.hashes() == [2, 3, 4] and tier.num_bytes == 3 * BPB  # 1 was dropped, LRU
    bm.allocate(2)  # evicts 5, 6: the host drops 2, then 5 (unprotected ones first)
    assert tier.hashes() == [3, 4, 6]
    assert tier.num_bytes <= tier.capacity_bytes
    assert tier.num_dropped_blocks == 3
    tier.check_invariants()


def test_protected_blocks_outlive_unprotected_ones_in_the_host_tier():
    clock = FakeClock()
    bm, tier, kv, _ = tier_manager(num_blocks=2, tier_blocks=2, clock=clock)
    computed(bm, kv, [1, 2], retain_until=clock.now + 30)
    computed(bm, kv, [3, 4])  # 1, 2 (protected) to host
    # 3 to host: all it holds is protected, so the least recently used (1) goes; 4 to host:
    # now 3 is there unprotected, and goes before the protected 2.
    computed(bm, kv, [5, 6])
    assert tier.hashes() == [2, 4]
    clock2 = FakeClock()
    bm, tier, kv, _ = tier_manager(num_blocks=2, tier_blocks=3, clock=clock2)
    computed(bm, kv, [1, 2], retain_until=clock2.now + 30)
    computed(bm, kv, [3, 4])  # 1, 2 -> host (protected)
    computed(bm, kv, [5, 6])  # 3 -> host fills it; 4 needs room: 3 goes, not a protected one
    assert sorted(tier.hashes()) == [1, 2, 4]
    clock2.now += 31  # protection lapsed: plain LRU, so 1 (the oldest) goes next
    bm.allocate(1)
    assert tier.hashes() == [2, 4, 5]


def test_a_swap_out_takes_its_room_back_from_the_host_tier_lru_first():
    bm, tier, kv, swap = tier_manager(num_blocks=4, tier_blocks=4, swap_blocks=4)
    computed(bm, kv, [1, 2, 3, 4])
    held = bm.allocate(4)  # all four move to host RAM, filling the swap space
    assert tier.num_bytes == swap.capacity_bytes and swap.fits(4 * BPB)  # swap sees it all
    swap.reserve(3 * BPB)  # a preempted sequence needs 3 blocks' room
    assert tier.hashes() == [4]  # the tier gave back its least recently used blocks
    keys, values = torch.zeros(3 * BPB // 8), torch.zeros(3 * BPB // 8)
    swap.put("seq", keys, values)
    bm.free(held)  # these are not cached; a later eviction has no room in host RAM at all
    computed(bm, kv, [5, 6, 7, 8])
    bm.allocate(4)
    assert tier.num_bytes == BPB and swap.used_bytes + tier.num_bytes <= swap.capacity_bytes
    tier.check_invariants()
    swap.take("seq")  # room again: later evictions may use it
    bm.free(bm.allocate(0))
    tier.check_invariants()


def test_a_tier_larger_than_the_swap_space_is_refused():
    kv = KVCache(CONFIG, 2, BLOCK)
    with pytest.raises(ValueError, match="cannot exceed"):
        HostTier(2 * BPB, BPB, kv, SwapSpace(BPB))
    with pytest.raises(ValueError, match=">= 0"):
        HostTier(-1, BPB, kv)


def test_cache_events_report_what_either_tier_can_serve():
    bm, tier, kv, _ = tier_manager(num_blocks=2, tier_blocks=1)
    stream = CacheEventStream(bm.prefix_cache, full_every=100, host_tier=tier)
    assert stream.next_batch().full
    computed(bm, kv, [1, 2])
    batch = stream.next_batch()
    assert (batch.stored, batch.evicted) == ([1, 2], [])
    taken = bm.allocate(1)  # 1 moves to host: still servable, nothing to report as evicted
    batch = stream.next_batch()
    assert batch.evicted == [] and batch.stored == [1]
    bm.allocate(1)  # 2 moves to host, which drops 1 to make room: 1 is gone for good
    batch = stream.next_batch()
    assert batch.evicted == [1] and batch.stored == [2]
    bm.free(taken)
    found, num_loaded = take_prefix(bm, [2])  # back on the device: still servable
    assert num_loaded == 1 and stream.next_batch().evicted == []
    assert CacheEventStream(bm.prefix_cache, host_tier=tier).next_batch().stored == [2]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["alloc", "compute", "free", "hit", "swap", "unswap"]), st.integers(0, 9)
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.integers(1, 4), st.integers(0, 4))
@example(  # a swap-out shrinks the tier; evictions after it must stay within what is left
    [("compute", a) for a in (0, 2, 4, 6, 8)] + [("swap", 0), ("compute", 0), ("compute", 2)],
    2,
    0,
)
def test_random_operations_keep_refcounts_budget_and_kv_right(ops, tier_blocks, extra_swap):
    """Holders allocate, compute (name) and free blocks, hit chains of hashes across both tiers,
    and sequences swap out and in; after every operation the pool is partitioned, no referenced
    block is handed out, the tier is within its budget and the swap space's promise, and every
    cached block (in either tier) holds the KV of its hash."""
    clock = FakeClock()
    bm, tier, kv, swap = tier_manager(3, tier_blocks, tier_blocks + extra_swap, clock)
    holders: list[list[int]] = []
    swapped: list[str] = []
    for op, arg in ops:
        clock.now += 1
        if op == "alloc" and bm.can_allocate(1 + arg % 3):
            ids = bm.allocate(1 + arg % 3)
            assert not {b for h in holders for b in h} & set(ids)
            holders.append(ids)
        elif op == "compute" and bm.can_allocate(1):
            (block_id,) = bm.allocate(1)
            fill(kv, block_id, arg)
            if not bm.prefix_cache.insert(arg, block_id):
                fill(kv, block_id, -1)  # not named: its content is nobody's business
            if arg % 2:
                holders.append([block_id])
            else:  # a prompt computed and finished at once
                bm.free([block_id], retain_until=clock.now + arg % 3)
        elif op == "free" and holders:
            bm.free(holders.pop(arg % len(holders)), retain_until=clock.now + arg % 3)
        elif op == "hit":
            found, _ = take_prefix(bm, [arg, (arg + 1) % 10])
            if found:
                holders.append(found)
        elif op == "swap" and swap.fits(BPB):
            swap.reserve(BPB)
            swap.put(f"s{len(swapped)}-{arg}", torch.zeros(BPB // 8), torch.zeros(BPB // 8))
            swapped.append(f"s{len(swapped)}-{arg}")
        elif op == "unswap" and swapped:
            swap.take(swapped.pop())
        bm.check_invariants()
        tier.check_invariants()
        for block_id in range(bm.num_blocks):
            assert bm.ref_count(block_id) == sum(h.count(block_id) for h in holders)
        for h in range(10):
            block_id = bm.prefix_cache.lookup(h)
            if block_id is not None:
                assert content(kv, block_id) == h
            if tier.holds(h):
                keys, values = tier._kv[h]
                assert torch.all(keys == h) and torch.all(values == -h)
    for ids in holders:
        bm.free(ids)
    assert bm.num_free_blocks == bm.num_blocks
    bm.check_invariants()


def test_the_eviction_record_carries_the_protection():
    clock = FakeClock()
    cache = PrefixCache(clock=clock)
    cache.insert(5, 0)
    cache.release(0, retain_until=140.0)
    assert cache.evict_one() == Eviction(0, 5, 140.0)


def test_a_block_taken_and_given_back_keeps_its_protection():
    """A cached block's deadline went when a holder took it, and its release made it plain LRU:
    a newcomer not admitted after all, a decode worker's reservation refused or lapsed, took a
    returning conversation's think-time protection with them. Held, a block keeps its deadline;
    released, it has the later of that and its releaser's; one past by then protects nothing."""
    clock = FakeClock()
    bm = cached_manager(3, clock)
    cache = bm.prefix_cache
    ids = bm.allocate(3)
    for h, block_id in enumerate(ids):
        cache.insert(h, block_id)
    bm.free(ids[:1], retain_until=130.0)  # a finished turn
    bm.free(ids[1:2], retain_until=160.0)
    bm.free(ids[2:])  # a one-off prompt
    bm.take_cached([ids[0]])
    bm.take_cached([ids[0]])  # two holders: pins of a reservation, a newcomer's
    bm.check_invariants()
    bm.free([ids[0]])
    bm.free([ids[0]])  # both given back, without a deadline of their own
    assert cache.retain_until(ids[0]) == 130.0
    bm.take_cached(ids[:2])
    bm.free(ids[:2], retain_until=150.0)  # the turn came back and finished again
    assert [cache.retain_until(b) for b in ids[:2]] == [150.0, 160.0]  # the later of the two
    assert bm.allocate(1) == [ids[2]]  # the plain block goes first
    clock.now = 170.0
    bm.take_cached([ids[0]])
    bm.free([ids[0]])
    assert cache.retain_until(ids[0]) is None and cache.num_retained == 0
    bm.check_invariants()


def test_a_protected_block_back_from_the_host_tier_keeps_its_protection():
    clock = FakeClock()
    bm, tier, kv, _ = tier_manager(num_blocks=2, tier_blocks=4, clock=clock)
    computed(bm, kv, [1, 2], retain_until=clock.now + 30)
    bm.free(bm.allocate(2))  # 1 and 2 move to host RAM, still protected
    assert tier.retain_until(1) == 130.0
    found, num_loaded = take_prefix(bm, [1, 2])
    assert num_loaded == 2
    bm.free(found)  # the newcomer that brought them back was not admitted after all
    assert [bm.prefix_cache.retain_until(b) for b in found] == [130.0, 130.0]
    bm.check_invariants()
    tier.check_invariants()
