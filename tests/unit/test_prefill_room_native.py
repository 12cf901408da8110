"""The C prefill room (`prefill_room.c`) answers as the Python one (`worker_index.PrefillRoom`),
question by question.

Two registries, one on each room, get the same random changes through the registry's own
methods (prefill workers registering, registering again, leaving; prompts small, big and of
batch lines assigned and released; measured rates reported, coming back to earlier ones; workers
stalling and recovering, so health by the clock comes and goes), and after every change both
are asked every question a dispatch asks of the room: whether a healthy worker takes a prompt of
each kind, the takers per rate in load order (every walk to its end), each worker's window
figures, and the candidates a placement compares. The same workers (by peer id) in the same
order, and the same figures, are required. Then the C type's guards: wrong input gets a clear
error and changes nothing, and a walk over a room that changed raises instead of walking moved
memory.
"""

from __future__ import annotations

import random

import pytest

from services.scheduler import native_indexes
from services.scheduler.cache_routing import RoutingWeights
from services.scheduler.candidates import prefill_candidates
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_state import WorkerState

PEERS = [f"p{i}" for i in range(10)]
RATES = (0.0, 400.0, 500.0, 520.0)
WINDOW_TOKENS = 64  # prompts over 32 tokens are big
PROGRESS_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def native_room():
    return native_indexes.native_prefill_room()


def new_worker(peer_id: str, rate: float, now: float) -> WorkerState:
    worker = WorkerState(
        peer_id=peer_id,
        role="prefill",
        identity=peer_id.encode(),
        address=None,
        num_total_blocks=100,
        block_size=16,
        max_num_seqs=8,
        last_heartbeat=now,
        last_progress=now,
    )
    worker.prefill_tokens_per_s = rate
    return worker


class Twins:
    """A registry on the Python room and one on the C room, the same changes, every answer
    compared."""

    def __init__(self, rng: random.Random, bulk_share: float = 0.5):
        self.rng = rng
        self.registries = [
            WorkerRegistry(60.0, PROGRESS_TIMEOUT_S, WINDOW_TOKENS, bulk_share, indexes=choice)
            for choice in ("python", "native")
        ]
        self.python, self.native = self.registries
        assert (self.python.prefill_room_kind, self.native.prefill_room_kind) == (
            "python",
            "native",
        )
        self.now = 0.0
        self.num_requests = 0
        self.num_questions = 0

    def workers(self, peer_id: str) -> list[WorkerState]:
        return [registry.get(peer_id) for registry in self.registries]

    def each(self, peer_id: str) -> zip:
        """Each registry with its own state of the worker."""
        return zip(self.registries, self.workers(peer_id), strict=True)

    def registered(self) -> list[str]:
        return sorted(w.peer_id for w in self.python.by_role("prefill"))

    # -- changes ------------------------------------------------------------------------------

    def step(self) -> None:
        rng = self.rng
        self.now += rng.choice((0.0, 0.1, 0.5, 2.0))
        peers = self.registered()
        roll = rng.random()
        if roll < 0.08 or not peers:
            self.register(rng.choice(PEERS))
        elif roll < 0.11:
            peer_id = rng.choice(peers)
            for registry in self.registries:
                registry.remove(peer_id)
        elif roll < 0.45:
            self.hold(rng.choice(peers))
        elif roll < 0.75:
            self.release(rng.choice(peers))
        elif roll < 0.88:
            rate = rng.choice(RATES)
            for registry, worker in self.each(rng.choice(peers)):
                registry.report_prefill_rate(worker, rate)
        else:
            steps_done, busy = rng.random() < 0.6, rng.random() < 0.8
            for worker in self.workers(rng.choice(peers)):
                worker.record_progress(worker.steps_completed + steps_done, busy, self.now)

    def register(self, peer_id: str) -> None:
        rate = self.rng.choice(RATES)
        for registry in self.registries:
            registry.add(new_worker(peer_id, rate, self.now))

    def hold(self, peer_id: str) -> None:
        self.num_requests += 1
        # Equal sums of small and big prompts (40 = 20 + 20, 64 = 32 + 32): ties on tokens held
        # that room (most first) must break.
        tokens = self.rng.choice((1, 8, 20, 32, 33, 40, 64, 200))
        bulk = self.rng.random() < 0.3
        for registry, worker in self.each(peer_id):
            registry.assign(worker, f"r{self.num_requests}", tokens, bulk)

    def release(self, peer_id: str) -> None:
        held = sorted(self.python.get(peer_id).request_ids)
        request_id = self.rng.choice(held) if held else "none"
        for registry, worker in self.each(peer_id):
            registry.release(worker, request_id)

    # -- questions ----------------------------------------------------------------------------

    def ask_everything(self) -> None:
        rng = self.rng
        now = self.now + rng.choice((0.0, 3.0, 6.0))  # past the progress timeout at times
        peers = self.registered()
        for tokens, bulk in ((0, False), (10, False), (33, False), (500, False), (0, True)):
            self.same(takes, tokens, bulk, now)
            self.same(walks, tokens, bulk, now)
            holders = set(rng.sample(peers, k=min(len(peers), rng.randint(0, 2))))
            self.same(candidates, tokens, bulk, now, holders)
            for peer_id in peers:
                self.same(window_takes, peer_id, tokens, bulk)
        for peer_id in peers:
            self.same(window_figures, peer_id)
        self.same(WorkerRegistry.prefill_kinds_taken, now)

    def same(self, question, *args) -> None:
        ours, theirs = question(self.native, *args), question(self.python, *args)
        assert ours == theirs, (question.__name__, args, ours, theirs)
        self.num_questions += 1


def takes(registry: WorkerRegistry, tokens: int, bulk: bool, now: float) -> bool:
    return registry.takes_prefill(tokens, bulk, now)


def walks(registry: WorkerRegistry, tokens: int, bulk: bool, now: float) -> list[list[str]]:
    groups = registry.prefill_takers_by_load(tokens, bulk, now)
    return [[w.peer_id for w in group] for group in groups]


def candidates(registry, tokens: int, bulk: bool, now: float, holders: set[str]) -> list[str]:
    """The placement's candidates: the holders, and per rate the least loaded (or all)."""
    found = prefill_candidates(registry, RoutingWeights(), tokens, bulk, now, holders)
    return [w.peer_id for w in found]


def window_takes(registry: WorkerRegistry, peer_id: str, tokens: int, bulk: bool) -> bool:
    return registry.window_takes(registry.get(peer_id), tokens, bulk)


def window_figures(registry: WorkerRegistry, peer_id: str) -> tuple[int, int, int]:
    worker = registry.get(peer_id)
    return (
        registry.held_tokens(worker),
        registry.small_room(worker),
        registry.interactive_tokens(worker),
    )


@pytest.mark.parametrize("seed", range(10))
def test_the_c_room_answers_as_the_python_one(seed, native_room):
    twins = Twins(random.Random(seed), bulk_share=(0.5, 0.25, 1.0)[seed % 3])
    orders = set()
    for _ in range(300):
        twins.step()
        twins.ask_everything()
        orders.add(tuple(map(tuple, walks(twins.native, 10, False, twins.now))))
    assert twins.num_questions > 300 * 20
    assert len(orders) >= 20  # the walks saw many orders, rate groups and lengths


def test_the_c_room_keeps_its_answers_through_heap_rebuilds(native_room):
    twins = Twins(random.Random(99))
    for peer_id in PEERS[:3]:  # few workers: a heap rebuilds every few dozen changes
        twins.register(peer_id)
    for step in range(6000):
        peer_id = twins.rng.choice(PEERS[:3])
        if step % 2:
            twins.hold(peer_id)
        else:
            twins.release(peer_id)
        if step % 50 == 0:
            twins.ask_everything()
    # Stale entries are dropped as the heaps rebuild: bounded by the live workers, not changes.
    assert twins.native.prefill_room.num_entries() <= 3 * len(RATES) * (2 * 3 + 64)


def test_wrong_input_gets_a_clear_error_and_changes_nothing(native_room):
    room = native_room(64, 0.5)
    good = new_worker("p", 500.0, 0.0)
    room.add(good)
    room.hold(good, "r", 10, False)
    with pytest.raises(ValueError, match="window_tokens must be a positive count"):
        native_room(0)
    with pytest.raises(ValueError, match=r"bulk_share must be in \(0, 1\], got 0.0"):
        native_room(64, 0.0)
    with pytest.raises(TypeError):
        native_room("wide")
    with pytest.raises(AttributeError):
        room.add(object())
    bad = new_worker("x", 500.0, 0.0)
    bad.peer_id = 7
    with pytest.raises(TypeError, match="peer_id must be a str"):
        room.add(bad)
    with pytest.raises(KeyError):
        room.hold(new_worker("stranger", 500.0, 0.0), "r2", 10, False)
    with pytest.raises(ValueError, match="cannot be held"):
        room.hold(good, "r3", -5, False)
    with pytest.raises(TypeError, match="takes 4 arguments"):
        room.hold(good, "r4", 10)
    with pytest.raises(TypeError):
        room.takers_by_load("many", False, 0.0, 5.0)
    with pytest.raises(KeyError):
        room.held_tokens("stranger")
    room.release(new_worker("stranger", 500.0, 0.0), "r")  # a worker it does not know: ignored
    room.release(good, "never held")
    # None of it changed the room: the good worker holds its one prompt and takes more.
    assert (room.held_tokens("p"), room.small_room("p"), room.interactive_tokens("p")) == (
        10,
        54,
        10,
    )
    assert [list(walk) for walk in room.takers_by_load(10, False, 0.0, 5.0)] == [[good]]


def test_a_walk_over_a_room_that_changed_raises(native_room):
    room = native_room(64, 0.5)
    workers = [new_worker(peer_id, 500.0, 0.0) for peer_id in ("a", "b")]
    for worker in workers:
        room.add(worker)
    (walk,) = room.takers_by_load(10, False, 0.0, 5.0)
    assert next(walk) is workers[0]
    room.hold(workers[1], "r", 10, False)  # its heap grows (and may move)
    with pytest.raises(RuntimeError, match="changed while it was read"):
        next(walk)
    (walk,) = room.takers_by_load(10, False, 0.0, 5.0)  # a fresh walk reads the new order
    assert list(walk) == workers
