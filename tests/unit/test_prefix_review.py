"""The prefix index and its holders map under a review's probes: the cost of a worker's full
set, stale entries after restarts and gaps, tenants, and the scheduler's predictions."""

from __future__ import annotations

from services.scheduler.cache_holders import CacheHolders
from services.scheduler.prefix_index import PrefixIndex
from shared.engine.prefix_cache import CacheKey, worker_cache_key

OWN = worker_cache_key(CacheKey("m", "float32", 16), shared_between_tenants=False)


class CountingIndex:
    """The index, counting the questions asked of it."""

    def __init__(self, index: PrefixIndex):
        self._index = index
        self.num_questions = 0

    def __getattr__(self, name):
        attribute = getattr(self._index, name)
        if not callable(attribute):
            return attribute

        def asked(*args, **kwargs):
            self.num_questions += 1
            return attribute(*args, **kwargs)

        return asked


def test_a_full_set_is_read_into_the_holders_in_a_few_questions_not_one_per_hash():
    """A full set names every block a worker holds (a hundred thousand on a large one, every
    few seconds per worker): a question per hash held the scheduler's loop for 40-140 ms each
    time, where the index itself took 2-8 ms. Same answers, a few questions a batch."""
    index = PrefixIndex()
    index.register("w", OWN, 16)
    counting = CountingIndex(index)
    holders = CacheHolders(counting)  # type: ignore[arg-type]
    first, second = list(range(10_000)), list(range(5_000, 15_000))
    for seq, stored in ((1, first), (2, second)):
        in_order = index.apply("w", seq, True, stored, [])
        counting.num_questions = 0
        holders.applied("w", in_order, True, stored, [])
        assert counting.num_questions <= 2
    assert holders.holders(4_999) == set() and holders.holders(5_000) == {"w"}
    assert holders.holders(14_999) == {"w"} and holders.holders(15_000) == set()
    # A change: one stored, one evicted.
    index.apply("w", 3, False, [20_000], [5_000])
    counting.num_questions = 0
    holders.applied("w", True, False, [20_000], [5_000])
    assert counting.num_questions <= 2
    assert holders.holders(20_000) == {"w"} and holders.holders(5_000) == set()
