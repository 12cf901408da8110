import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shared.engine.block_manager import BlockManager, NoFreeBlocksError


def test_allocate_and_free_roundtrip():
    bm = BlockManager(num_blocks=8, block_size=4)
    ids = bm.allocate(3)
    assert len(set(ids)) == 3 and bm.num_free_blocks == 5
    bm.free(ids)
    assert bm.num_free_blocks == 8
    bm.check_invariants()


def test_allocation_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.allocate(3)
    with pytest.raises(NoFreeBlocksError):
        bm.allocate(2)
    assert bm.num_free_blocks == 1
    bm.check_invariants()


def test_grow_adds_only_missing_blocks():
    bm = BlockManager(num_blocks=10, block_size=4)
    table: list[int] = []
    assert len(bm.grow(table, 1)) == 1
    assert bm.grow(table, 4) == []
    assert len(bm.grow(table, 5)) == 1
    assert len(table) == 2 and bm.num_blocks_for(9) == 3


def test_shared_block_returns_after_last_holder():
    bm = BlockManager(num_blocks=2, block_size=4)
    ids = bm.allocate(1)
    bm.share(ids)
    assert bm.ref_count(ids[0]) == 2
    bm.free(ids)
    assert bm.num_free_blocks == 1
    bm.free(ids)
    assert bm.num_free_blocks == 2
    bm.check_invariants()


def test_double_free_and_sharing_free_block_refused():
    bm = BlockManager(num_blocks=2, block_size=4)
    ids = bm.allocate(1)
    bm.free(ids)
    with pytest.raises(ValueError, match="freed twice"):
        bm.free(ids)
    with pytest.raises(ValueError, match="is free"):
        bm.share(ids)


@pytest.mark.parametrize("num_blocks,block_size", [(0, 16), (4, 0)])
def test_bad_config(num_blocks, block_size):
    with pytest.raises(ValueError):
        BlockManager(num_blocks, block_size)


OPERATIONS = st.sampled_from(["new", "grow", "free", "share"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(OPERATIONS, st.integers(0, 40)), max_size=60))
def test_random_operations_keep_invariants(ops):
    bm = BlockManager(num_blocks=16, block_size=4)
    tables: list[list[int]] = []
    for op, n in ops:
        if op in ("new", "grow"):
            table = tables[n % len(tables)] if op == "grow" and tables else []
            target = len(table) * 4 + n % 9
            try:
                bm.grow(table, target)
            except NoFreeBlocksError:
                assert bm.num_new_blocks_for(table, target) > bm.num_free_blocks
            if op == "new" or not tables:
                tables.append(table)
        elif op == "free" and tables:
            bm.free(tables.pop(n % len(tables)))
        elif op == "share" and tables:
            table = tables[n % len(tables)]
            bm.share(table)
            tables.append(list(table))
        bm.check_invariants()
        assert bm.num_used_blocks == len({b for t in tables for b in t})
    for table in tables:
        bm.free(table)
    assert bm.num_free_blocks == 16
    bm.check_invariants()
