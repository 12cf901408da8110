"""The C queue index (`queue_index.c`) answers as the Python one (`queue_index.py`), question by
question.

Random sequences of the changes the fair queue makes (requests of every kind queued and taken
out, parties dropped when emptied, or left listed a while, counters moved) drive both indexes,
and after every change every question the policy asks is put to both, with the same answer
required: the same objects in the same order. Then the C type's guards: a walk over a heap that
changed raises instead of reading a moved array, and wrong input gets a clear error. And the
choice between them (`SchedulerLimits.indexes`), with and without a C compiler.
"""

from __future__ import annotations

import random

import pytest

from kernels.native_build import NativeUnavailable
from services.scheduler import native_indexes, queue_index_native
from services.scheduler.core import SchedulerLimits
from services.scheduler.fair_share import FairQueue, FairShareConfig, LengthRanges
from services.scheduler.queue_index import QueueIndex
from services.scheduler.queued import Party, QueuedRequest
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_index import DecodeRoom, PrefillRoom

CLASSES = ("short", "long", "bulk")


@pytest.fixture(scope="module")
def native_type():
    return queue_index_native.native_type()


class Twins:
    """Both indexes, the same changes, every answer compared."""

    def __init__(self, rng: random.Random, native_type: type):
        self.rng = rng
        self.python, self.native = QueueIndex(), native_type()
        self.parties = [Party(f"t{i}", c) for i in range(6) for c in CLASSES]
        self.num_added = 0
        self.now = 0.0

    def both(self, name: str, *args):
        ours = getattr(self.native, name)(*args)
        theirs = getattr(self.python, name)(*args)
        if name in (
            "queued",
            "by_arrival",
            "by_arrival_within",
            "parties_by_counter",
            "party_in_order",
        ):
            ours, theirs = list(ours), list(theirs)
        assert _same(ours, theirs), (name, args, ours, theirs)
        return theirs

    # -- changes --------------------------------------------------------------------------

    def add(self) -> None:
        rng = self.rng
        party = rng.choice(self.parties)
        self.now += rng.choice((0.0, 0.0, 0.5, 1.0, 3.0))  # ties in arrival are common
        item = QueuedRequest(
            request_id=f"r{self.num_added}",
            tenant=party.tenant,
            num_prompt_tokens=rng.choice((0, 1, 7, 16, 17, 300, 1024, 1025, 5000)),
            priority=rng.choice((0, 0, 0, 1, 2)),
            arrival=self.now,
            resumed=rng.random() < 0.1,
            bulk=party.class_name == "bulk",
        )
        self.num_added += 1
        counter = rng.choice((0.0, 0.0, 5.0, 12.5, self.now))  # ties in counters too
        self.both("add", party, item, counter)

    def discard(self) -> None:
        rng = self.rng
        known = [i.request_id for i in self.python.queued()]
        request_id = rng.choice(known) if known and rng.random() < 0.9 else "nobody"
        self.both("discard", request_id)
        for party in self.parties:
            if (
                self.python.backlogged(party)
                and self.python.party_size(party) == 0
                and rng.random() < 0.8  # else left listed a while, empty, as the policy may
            ):
                self.both("drop_party", party)

    def set_counter(self) -> None:
        listed = [p for p in self.parties if self.python.backlogged(p)]
        if listed:
            counter = self.rng.choice((0.0, 5.0, 12.5, 40.0))
            self.both("set_counter", self.rng.choice(listed), counter)

    # -- questions ------------------------------------------------------------------------

    def ask_everything(self) -> None:
        rng = self.rng
        assert len(self.native) == len(self.python)
        queued = self.both("queued")
        for item in queued:
            assert item.request_id in self.native
            self.both("sequence_of", item.request_id)
            self.both("party_of", item.request_id)
        assert "nobody" not in self.native
        self.both("num_queued_by_party")
        self.both("resumed_items")
        self.both("class_names")
        for party in self.parties:
            self.both("queued_tokens_of", party)
            if self.both("backlogged", party):
                if self.both("party_size", party):
                    self.both("first_of", party)
                    lengths = [i.num_prompt_tokens for i in self.python.party_in_order(party)]
                    exact = [min(lengths), max(lengths)]  # not widened only: exact
                    assert list(self.both("party_lengths", party)) == exact
                self.both("party_in_order", party)
        for bulk in (False, True):
            self.both("num_queued", bulk)
            self.both("num_queued_tokens", bulk)
            self.both("oldest", bulk)
            self.both("by_arrival", bulk)
            low = rng.choice((0, 1, 16, 1024))
            high = low + rng.choice((0, 15, 500, 10_000))
            self.both("by_arrival_within", bulk, _overlapping(low, high))
        for name in CLASSES + ("nameless",):
            self.both("num_parties", name)
        names = rng.sample(CLASSES, rng.randint(0, 3))
        self.both("min_counter", names)
        low = rng.choice((0, 1, 17, 1025))
        high = low + rng.choice((0, 100, 10_000))

        def meet(class_name: str, lo: int, hi: int) -> bool:
            return class_name == "bulk" or (lo <= high and low <= hi)

        self.both("least_served_party", names, meet)
        self.both("parties_by_counter", names, meet)


def _overlapping(low: int, high: int):
    return lambda lo, hi: lo <= high and low <= hi


def _same(ours, theirs) -> bool:
    """Equal, and the requests and parties in them the very objects given."""
    if isinstance(theirs, (list, tuple)):
        return (
            isinstance(ours, (list, tuple))
            and len(ours) == len(theirs)
            and all(_same(a, b) for a, b in zip(ours, theirs, strict=True))
        )
    if isinstance(theirs, dict):
        return isinstance(ours, dict) and list(ours.items()) == list(theirs.items())
    if isinstance(theirs, QueuedRequest):
        return ours is theirs
    return type(ours) is type(theirs) and ours == theirs


@pytest.mark.parametrize("seed", range(12))
def test_the_c_index_answers_as_the_python_one(seed, native_type):
    rng = random.Random(seed)
    twins = Twins(rng, native_type)
    for _ in range(400):
        change = rng.random()
        if change < 0.5:
            twins.add()
        elif change < 0.85:
            twins.discard()
        else:
            twins.set_counter()
        twins.ask_everything()


def test_the_c_index_keeps_its_answers_through_heap_rebuilds(native_type):
    """Thousands of changes: the lazy heaps fill with stale entries and are rebuilt many times
    (every `REBUILD_SLACK` stale entries past twice the live ones)."""
    rng = random.Random(99)
    twins = Twins(rng, native_type)
    for step in range(6000):
        if rng.random() < 0.5 or len(twins.python) < 5:
            twins.add()
        else:
            twins.discard()
        if rng.random() < 0.3:
            twins.set_counter()
        if step % 500 == 0:
            twins.ask_everything()
    twins.ask_everything()


def queued(request_id: str, tenant: str = "t", tokens: int = 10, arrival: float = 0.0):
    return QueuedRequest(request_id, tenant, tokens, priority=0, arrival=arrival)


@pytest.mark.parametrize("kind", ["python", "native"])
def test_a_party_whose_requests_at_its_bounds_left_is_passed_over_by_length(kind, native_type):
    """A walk for a short prompt passes over a party whose short requests were served: its
    bounds follow what it holds (once they only widened, and every such party was sorted in
    vain, a choice in thousands)."""
    index = QueueIndex() if kind == "python" else native_type()
    served, long_only = Party("served", "short"), Party("short-left", "short")
    for number, tokens in enumerate((10, 500, 2000)):
        index.add(served, queued(f"s{number}", "served", tokens), 0.0)
    index.add(long_only, queued("l0", "short-left", 20), 1.0)
    index.add(long_only, queued("l1", "short-left", 20), 1.0)
    assert list(index.party_lengths(served)) == [10, 2000]
    index.discard("s0")
    index.discard("s2")
    assert list(index.party_lengths(served)) == [500, 500]
    index.add(served, queued("s3", "served", 700), 0.0)  # widened from the exact bounds
    assert list(index.party_lengths(served)) == [500, 700]

    def short(class_name: str, low: int, high: int) -> bool:
        return low <= 100

    assert list(index.parties_by_counter(["short"], short)) == [long_only]
    assert index.least_served_party(["short"], short) is None  # served is first, too long
    index.discard("l0")  # at both bounds, one of two such: the bounds stay
    assert list(index.party_lengths(long_only)) == [20, 20]


@pytest.mark.parametrize("kind", ["python", "native"])
def test_when_no_queued_prompt_fits_the_lengths_no_one_is_chosen_and_a_fitting_one_is(kind):
    """A full decode pool asks for prompts shorter than any queued: no one is chosen (the
    choice then skips its walk over every party, by the length buckets' counts), and a range
    that reaches into a bucket finds the one request in it, past parties that have none."""
    queue = FairQueue(FairShareConfig(), kind)
    for number in range(60):
        tokens = 33 if number == 59 else (40, 64, 300, 1500)[number % 4]
        queue.push(queued(f"r{number}", f"t{number}", tokens, arrival=0.0))
    queue.charge(queue.party_for("t59", 33), num_prompt_tokens=10_000)  # served the most
    assert queue.pop_next(1.0, *[LengthRanges(((0, 32),))] * 2) is None  # (none overdue)
    assert len(queue) == 60
    fits = LengthRanges(((0, 39),))
    assert queue.pop_next(1.0, fits, fits).request_id == "r59"


def test_a_walk_over_a_changed_heap_raises_instead_of_reading_on(native_type):
    index = native_type()
    party = Party("t", "short")
    for number in range(5):
        index.add(party, queued(f"r{number}", arrival=number), 0.0)
    walk = index.by_arrival(False)
    assert next(walk).request_id == "r0"
    index.add(party, queued("late", arrival=9.0), 0.0)
    with pytest.raises(RuntimeError, match="changed during a walk"):
        next(walk)
    index.add(Party("u", "short"), queued("other", tenant="u"), 1.0)
    counters = index.parties_by_counter(["short"], lambda *_: True)
    assert next(counters) == party
    index.set_counter(party, 3.0)
    with pytest.raises(RuntimeError, match="changed during a walk"):
        next(counters)


def test_wrong_input_gets_a_clear_error_and_changes_nothing(native_type):
    index = native_type()
    party = Party("t", "short")
    index.add(party, queued("r1"), 0.0)
    with pytest.raises(ValueError, match="already queued"):
        index.add(party, queued("r1"), 0.0)
    with pytest.raises(TypeError, match="tuple of str"):
        index.add(("t", 7), queued("r2"), 0.0)
    with pytest.raises(TypeError, match="tuple of str"):
        index.add("t", queued("r2"), 0.0)
    with pytest.raises(AttributeError):
        index.add(party, object(), 0.0)
    with pytest.raises(TypeError):
        index.add(party, queued("r2"), "zero")
    with pytest.raises(ValueError, match="still has requests"):
        index.drop_party(party)
    with pytest.raises(KeyError):
        index.set_counter(Party("nobody", "short"), 1.0)
    with pytest.raises(KeyError):
        index.sequence_of("r9")
    with pytest.raises(ValueError, match="bits must be"):
        index.arrival_walk(False, 65)
    with pytest.raises(TypeError, match="takes no arguments"):
        native_type(1)
    assert len(index) == 1 and [i.request_id for i in index.queued()] == ["r1"]
    (item,) = index.queued()
    assert index.discard("r2") is None and index.discard("r1") == (party, item)


def test_the_fair_queue_takes_the_index_the_config_names(native_type):
    assert type(FairQueue(FairShareConfig(), "python")._index) is QueueIndex
    assert type(FairQueue(FairShareConfig(), "native")._index) is native_type
    queue = FairQueue(FairShareConfig())  # auto, with a compiler
    assert type(queue._index) is native_type and queue.index_kind == "native"
    with pytest.raises(ValueError, match="indexes must be one of auto, native, python"):
        FairQueue(FairShareConfig(), "rust")
    with pytest.raises(ValueError, match="indexes must be one of auto, native, python"):
        SchedulerLimits(indexes="C")


def test_without_a_compiler_auto_keeps_python_and_native_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    caches = (
        queue_index_native.native_type,
        native_indexes.native_decode_room,
        native_indexes.native_prefill_room,
        native_indexes._native_or_none,
    )
    for cache in caches:
        cache.cache_clear()
    try:
        for choose, python_type in (
            (queue_index_native.queue_index_type, QueueIndex),
            (native_indexes.decode_room_type, DecodeRoom),
            (native_indexes.prefill_room_type, PrefillRoom),
        ):
            with pytest.raises(NativeUnavailable, match="no C compiler"):
                choose("native")
            assert choose("auto") is python_type
        monkeypatch.delenv("CC")  # a compiler now: auto keeps its first answer for the process
        assert queue_index_native.queue_index_type("auto") is QueueIndex
        assert native_indexes.decode_room_type("auto") is DecodeRoom
        registry = WorkerRegistry(10.0, 60.0)  # the service's start line says which it runs
        assert registry.decode_room_kind == registry.prefill_room_kind == "python"
        assert not (tmp_path / "native").exists()  # and nothing was built on the way
    finally:
        for cache in caches:
            cache.cache_clear()


class QueueTwins:
    """Two fair queues, one choosing in C (`QueueIndex.choose`), one in Python over the Python
    index, fed the same requests, charges and time, asked for the same choices."""

    def __init__(self, rng: random.Random, policy: str):
        self.rng = rng
        config = dict(policy=policy, class_thresholds=(64,), max_wait_s=4.0, bulk_max_wait_s=10.0)
        self.python = FairQueue(FairShareConfig(**config), "python")
        self.native = FairQueue(FairShareConfig(**config), "native")
        self.native_choices = 0
        choose = self.native._native_choice

        def counted(*args):
            self.native_choices += 1
            return choose(*args)

        self.native._native_choice = counted
        self.now = 0.0
        self.num_pushed = 0

    def push(self) -> None:
        rng = self.rng
        self.now += rng.choice((0.0, 0.0, 0.3, 1.0, 2.5))
        item = QueuedRequest(
            request_id=f"r{self.num_pushed}",
            tenant=rng.choice(("a", "b", "c", "d")),
            num_prompt_tokens=rng.choice((1, 5, 30, 64, 65, 200, 900)),
            priority=rng.choice((0, 0, 0, 1)),
            arrival=self.now,
            resumed=rng.random() < 0.05,
            bulk=rng.random() < 0.3,
            num_cached_tokens=rng.choice((0, 0, 4)),
        )
        self.num_pushed += 1
        self.python.push(item)
        self.native.push(item)

    def lengths(self) -> LengthRanges:
        rng = self.rng
        pairs = [(0, 64), (65, 300), (0, 10), (100, 1000), (0, 1000)]
        interactive = tuple(rng.sample(pairs, rng.randint(0, 2)))
        bulk = tuple(rng.sample(pairs, rng.randint(0, 1)))
        return LengthRanges(interactive, bulk)

    def pop(self) -> None:
        rng = self.rng
        self.now += rng.choice((0.0, 0.5, 3.0))
        how = rng.random()
        if how < 0.6:  # as the core asks: the ranges are the test of admissibility
            lengths = self.lengths()
            args = (self.now, lengths, lengths)
        elif how < 0.8:  # any test, with a promise of lengths: some requests refused
            lengths = self.lengths()
            refused = {i.request_id for i in self.python if rng.random() < 0.5}
            args = (self.now, lambda i: lengths(i) and i.request_id not in refused, lengths)
        else:  # any test, no promise
            limit = rng.choice((10, 100, 1000))
            args = (self.now, lambda i: i.num_prompt_tokens <= limit, None)
        peeked = self.native.peek_next(*args)
        assert peeked is self.python.peek_next(*args)
        popped = self.native.pop_next(*args)
        assert popped is self.python.pop_next(*args) and popped is peeked
        assert self.native._last_was_aged == self.python._last_was_aged
        if popped is not None and rng.random() < 0.5:
            party = self.python.party_for(popped.tenant, popped.num_prompt_tokens, popped.bulk)
            tokens = rng.randint(1, 50)
            self.python.charge(party, num_output_tokens=tokens)
            self.native.charge(party, num_output_tokens=tokens)

    def remove(self) -> None:
        queued = [i.request_id for i in self.python]
        if queued:
            request_id = self.rng.choice(queued)
            assert self.native.remove(request_id) is self.python.remove(request_id)

    def compare(self) -> None:
        assert self.native.counters == self.python.counters
        assert self.native.virtual_time == self.python.virtual_time
        assert [i.request_id for i in self.native] == [i.request_id for i in self.python]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
@pytest.mark.parametrize("seed", range(8))
def test_the_c_choice_is_the_python_policys(seed, policy, native_type):
    """Every kind of choice: overdue requests (aging every other turn), bulk lines aged into the
    interactive choice or taking what it leaves, resumed requests first, the least-served party
    passed over when its first request does not fit, fcfs's head-of-line blocking."""
    rng = random.Random(seed)
    twins = QueueTwins(rng, policy)
    for _ in range(500):
        change = rng.random()
        if change < 0.45:
            twins.push()
        elif change < 0.9:
            twins.pop()
        else:
            twins.remove()
        twins.compare()
    assert twins.native_choices > 400  # (peek and pop) the C choice made them
