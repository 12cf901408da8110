"""The C decode room (`decode_room.c`) answers as the Python one (`worker_index.DecodeRoom`),
question by question.

Two registries, one on each room, get the same random changes through the registry's own
methods (decode workers registering, registering again, leaving; requests assigned, reserved
with blocks, released; free blocks reported, with and without a heartbeat; workers stalling and
recovering, so health by the clock comes and goes), and after every change both are asked every
question a dispatch asks of the room, for interactive requests and batch lines alike: the best
worker for a request, the least busy worker outside a prompt's cache holders, the most tokens any
worker can hold, the largest KV capacity, who has a seat. The same worker (by peer id) or the
same figure is required. Then the C type's guards: wrong input gets a clear error and changes
nothing, and a read whose heap changed under it raises instead of walking moved memory.
"""

from __future__ import annotations

import random

import pytest

from services.scheduler import native_indexes
from services.scheduler.registry import WorkerRegistry
from services.scheduler.worker_state import WorkerState

PEERS = [f"d{i}" for i in range(10)]
PROGRESS_TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
def native_room():
    return native_indexes.native_decode_room()


def new_worker(peer_id: str, block_size: int, seats: int, blocks: int, now: float) -> WorkerState:
    return WorkerState(
        peer_id=peer_id,
        role="decode",
        identity=peer_id.encode(),
        address=f"ipc://{peer_id}",
        num_total_blocks=blocks,
        block_size=block_size,
        max_num_seqs=seats,
        last_heartbeat=now,
        last_progress=now,
        num_free_blocks=blocks,
    )


class Twins:
    """A registry on the Python room and one on the C room, the same changes, every answer
    compared."""

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.python = WorkerRegistry(60.0, PROGRESS_TIMEOUT_S, indexes="python")
        self.native = WorkerRegistry(60.0, PROGRESS_TIMEOUT_S, indexes="native")
        assert self.native.decode_room_kind == "native"
        assert self.python.decode_room_kind == "python"
        self.now = 0.0
        self.num_requests = 0
        self.num_questions = 0

    def both(self, change) -> None:
        for registry in (self.python, self.native):
            change(registry)

    def pair(self, peer_id: str) -> tuple[WorkerState, WorkerState] | None:
        python, native = self.python.get(peer_id), self.native.get(peer_id)
        assert (python is None) == (native is None)
        return None if python is None else (python, native)

    def registered(self) -> list[str]:
        return sorted(w.peer_id for w in self.python.by_role("decode"))

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
            self.both(lambda r: r.remove(peer_id))
        elif roll < 0.35:
            self.reserve(rng.choice(peers))
        elif roll < 0.55:
            self.release(rng.choice(peers))
        elif roll < 0.8:
            self.report(rng.choice(peers))
        else:
            self.progress(rng.choice(peers))

    def register(self, peer_id: str) -> None:
        shape = (
            self.rng.choice((8, 16, 32)),
            self.rng.randint(1, 5),
            self.rng.choice((0, 4, 20, 60, 200)),
        )
        self.both(lambda r: r.add(new_worker(peer_id, *shape, self.now)))

    def reserve(self, peer_id: str) -> None:
        self.num_requests += 1
        request_id = f"r{self.num_requests}"
        num_blocks = self.rng.randint(0, 12)
        with_blocks = self.rng.random() < 0.5
        for registry, worker in zip((self.python, self.native), self.pair(peer_id), strict=True):
            if with_blocks:
                registry.reserve(worker, request_id, num_blocks)
            else:
                registry.assign(worker, request_id, num_blocks * worker.block_size)

    def release(self, peer_id: str) -> None:
        python, native = self.pair(peer_id)
        held = sorted(python.request_ids)
        request_id = self.rng.choice(held) if held else "none"
        self.python.release(python, request_id)
        self.native.release(native, request_id)

    def report(self, peer_id: str) -> None:
        python, native = self.pair(peer_id)
        num_free = self.rng.randint(-2, python.num_total_blocks + 2)
        heartbeat = self.rng.random() < 0.7
        self.python.report_free_blocks(python, num_free, heartbeat)
        self.native.report_free_blocks(native, num_free, heartbeat)

    def progress(self, peer_id: str) -> None:
        steps_done = self.rng.random() < 0.6
        busy = self.rng.random() < 0.8
        for worker in self.pair(peer_id):
            worker.record_progress(worker.steps_completed + steps_done, busy, self.now)

    # -- questions ----------------------------------------------------------------------------

    def ask_everything(self) -> None:
        rng = self.rng
        now = self.now + rng.choice((0.0, 3.0, 6.0))  # past the progress timeout at times
        peers = self.registered()
        for num_tokens in (1, rng.randint(1, 400), rng.randint(1, 4000)):
            for bulk in (False, True):
                holders = set(rng.sample(peers, k=min(len(peers), rng.randint(0, 3))))
                self.same(pick_best, num_tokens, now, bulk)
                self.same(least_busy, num_tokens, now, bulk, holders)
                self.same(pick_with_affinity, num_tokens, now, bulk, holders)
        for bulk in (False, True):
            self.same(WorkerRegistry.max_decode_tokens, now, bulk)
            for peer_id in peers:
                self.same(has_seat, peer_id, bulk)
        self.same(WorkerRegistry.max_decode_capacity, now)

    def same(self, question, *args) -> None:
        ours, theirs = question(self.native, *args), question(self.python, *args)
        if isinstance(ours, WorkerState) or isinstance(theirs, WorkerState):
            ours, theirs = getattr(ours, "peer_id", ours), getattr(theirs, "peer_id", theirs)
        assert ours == theirs, (ours, theirs)
        self.num_questions += 1


def pick_best(registry: WorkerRegistry, num_tokens: int, now: float, bulk: bool):
    return registry.pick_decode(num_tokens, now, bulk=bulk)


def least_busy(registry: WorkerRegistry, num_tokens: int, now: float, bulk: bool, holders):
    return registry._room(bulk).least_busy(num_tokens, now, PROGRESS_TIMEOUT_S, holders)


def pick_with_affinity(registry: WorkerRegistry, num_tokens: int, now: float, bulk, holders):
    """The cache-aware pick: the holders of a prompt's prefix first, then the least busy."""
    return registry.pick_decode(num_tokens, now, lambda w: w.peer_id in holders, holders, bulk)


def has_seat(registry: WorkerRegistry, peer_id: str, bulk: bool) -> bool:
    return registry._room(bulk).has_seat(registry.get(peer_id))


@pytest.mark.parametrize("seed", range(10))
def test_the_c_room_answers_as_the_python_one(seed, native_room):
    twins = Twins(random.Random(seed))
    answers = set()
    for _ in range(300):
        twins.step()
        twins.ask_everything()
        answers.add(getattr(twins.native.pick_decode(16, twins.now), "peer_id", None))
    assert twins.num_questions > 300 * 20
    assert len(answers) >= 4  # the runs pick several workers, and none at times


def test_the_c_room_keeps_its_answers_through_heap_rebuilds(native_room):
    twins = Twins(random.Random(99))
    for peer_id in PEERS[:3]:  # few workers: a heap rebuilds every few dozen changes
        twins.register(peer_id)
    for step in range(6000):
        twins.report(twins.rng.choice(PEERS[:3]))
        if step % 3 == 0:
            twins.reserve(twins.rng.choice(PEERS[:3]))
        if step % 5 == 0:
            twins.release(twins.rng.choice(PEERS[:3]))
        if step % 50 == 0:
            twins.ask_everything()
    # Stale entries are dropped as the heaps rebuild: bounded by the live workers, not changes.
    assert twins.native.decode_room.num_entries() <= 3 * (2 * 3 + 64)


def test_wrong_input_gets_a_clear_error_and_changes_nothing(native_room):
    workers: dict[str, WorkerState] = {}
    room = native_room(workers)
    good = new_worker("d", 16, 4, 100, 0.0)
    workers["d"] = good
    room.add(good)
    with pytest.raises(TypeError):
        native_room("not a dict")
    with pytest.raises(ValueError, match=r"seat_share must be in \(0, 1\]"):
        native_room(workers, 0.0)
    with pytest.raises(AttributeError):
        room.add(object())
    for blocks, size, seats in ((100, 0, 4), (100, 16, 0), (-1, 16, 4)):
        bad = new_worker("d", size, seats, blocks, 0.0)
        with pytest.raises(ValueError, match="a decode worker needs block_size > 0"):
            room.add(bad)
    bad = new_worker("x", 16, 4, 100, 0.0)
    bad.peer_id = 7
    with pytest.raises(TypeError, match="peer_id must be a str"):
        room.add(bad)
    with pytest.raises(TypeError):
        room.best("many", 0.0, 5.0)
    with pytest.raises(TypeError, match="takes 3 arguments"):
        room.best(16, 0.0)
    with pytest.raises(TypeError):
        room.least_busy(16, 0.0, 5.0, 42)  # not a container
    # None of it changed the room: the good worker is still its answer to every question.
    assert room.best(16, 0.0, 5.0) is good
    assert room.least_busy(16, 0.0, 5.0, set()) is good
    assert room.max_tokens(0.0, 5.0) == 1600 and room.max_capacity(0.0, 5.0) == 1600
    room.update(new_worker("stranger", 16, 4, 100, 0.0))  # never added: ignored
    room.remove("stranger")
    assert room.best(16, 0.0, 5.0) is good


def test_a_read_whose_heap_changes_under_it_raises(native_room):
    workers: dict[str, WorkerState] = {}
    room = native_room(workers)
    for peer_id in ("a", "b"):
        workers[peer_id] = new_worker(peer_id, 16, 4, 100, 0.0)
        room.add(workers[peer_id])

    class Meddling:
        """A container whose membership test changes the room mid-walk."""

        def __contains__(self, peer_id: str) -> bool:
            workers["b"].num_free_blocks -= 1
            room.update(workers["b"])
            return True

    with pytest.raises(RuntimeError, match="changed while it was read"):
        room.least_busy(16, 0.0, 5.0, Meddling())
    assert room.least_busy(16, 0.0, 5.0, set()) is workers["a"]  # and it reads on after
