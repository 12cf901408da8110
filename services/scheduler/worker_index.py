"""The registry's indexes over the workers, kept up to date as they change, so that a dispatch
never passes over a thousand workers of a role to find the few with room.

* `PrefillRoom`: every prefill worker's window (`PrefillWindow`, what it holds ahead of its
  progress) kept as prompts come and go instead of recounted, and the sets of workers whose
  window takes a small prompt, a big one, or a bulk line: under load only the few workers that
  just finished something are in them. Each set is also ordered, per measured prefill rate, by
  tokens held (fewest first), then room (most first), then peer id: the placement's order among
  workers of one rate when no cache counts (see `ClusterScheduler._prefill_candidates`), so
  a lightly loaded cluster's thousand idle workers are not all compared either.
* `DecodeRoom`: the decode workers with a seat free, by available blocks (most first), then by
  fewest requests, then by registration order (the order a scan of the registry met them in),
  one lazy heap per block size: the first healthy worker of a heap is the one of its block size
  that can hold the most tokens, so whether anyone can hold a prompt, and who, is answered from
  the heaps' tops. And the same workers by share of seats taken (least first), then the same
  order: the cache-aware affinity's ranking of the workers holding none of a prompt.

Health is not indexed: whether a worker is making progress depends on the clock, so the readers
skip unhealthy workers as they meet them (rare: a stuck worker).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from services.scheduler import lazy_heap

if TYPE_CHECKING:
    from services.scheduler.worker_state import WorkerState

SMALL, BIG, BULK = "small", "big", "bulk"  # what a prefill window may take
# Batch lines fill a prefill window up to half: with the default window (four steps' budget of
# 512 tokens) a step's worth waits while another runs, so the worker does not wait between a
# step's end and the scheduler's next lines. An interactive prompt still waits only for the step
# in progress (the engine takes it first), and finds half the window free.
BULK_WINDOW_SHARE = 0.5
# Batch lines take up to seven eighths of a decode worker's seats: the rest stay free for
# interactive requests, which otherwise wait for a batch line to finish before they can start.
BULK_SEAT_SHARE = 0.875


@dataclass
class PrefillWindow:
    """What a prefill worker holds ahead of its progress, and whether it may take more.

    A worker holds at most one *big* prompt (more than half the window) and up to a window of
    prompt tokens in smaller ones (the last may overshoot). One big prompt already fills every
    step's budget for many steps, so a second adds nothing but a claim on the worker's future;
    kept in the scheduler's queue instead, it stays under the policy, and short prompts always
    find room beside the big one in hand. A batch line's big prompt is no bar to an interactive
    one: the engine takes that first (until 2026-12-07 an agent's long prompt waited in the
    queue for a batch line's whole prefill).
    """

    tokens: int  # the window, in prompt tokens
    # A batch line goes only to a worker holding less than this share of the window in small
    # prompts (and no big one): enough that the next step's lines wait while one runs.
    bulk_share: float = BULK_WINDOW_SHARE
    num_big: int = 0  # big prompts held (one interactive, one a batch line's; or by hand, more)
    num_big_bulk: int = 0  # of those, batch lines'
    small_tokens: int = 0
    held_tokens: int = 0  # every prompt token held, big or small
    bulk_tokens: int = 0  # of those, batch lines' (which yield every step to interactive prompts)

    @property
    def holds_big(self) -> bool:
        return self.num_big > 0

    @property
    def holds_interactive_big(self) -> bool:
        return self.num_big > self.num_big_bulk

    @property
    def interactive_tokens(self) -> int:
        """What an interactive prompt given to this worker now waits behind (besides the step
        in progress): the engine takes interactive prompts before any batch line."""
        return self.held_tokens - self.bulk_tokens

    def is_big(self, num_prompt_tokens: int) -> bool:
        return num_prompt_tokens > self.tokens // 2

    def hold(self, num_prompt_tokens: int, bulk: bool = False) -> None:
        self.held_tokens += num_prompt_tokens
        self.bulk_tokens += num_prompt_tokens if bulk else 0
        if self.is_big(num_prompt_tokens):
            self.num_big += 1
            self.num_big_bulk += bulk
        else:
            self.small_tokens += num_prompt_tokens

    def release(self, num_prompt_tokens: int, bulk: bool = False) -> None:
        self.held_tokens -= num_prompt_tokens
        self.bulk_tokens -= num_prompt_tokens if bulk else 0
        if self.is_big(num_prompt_tokens):
            self.num_big -= 1
            self.num_big_bulk -= bulk
        else:
            self.small_tokens -= num_prompt_tokens

    @property
    def small_room(self) -> int:
        return self.tokens - self.small_tokens

    def takes(self, num_prompt_tokens: int, bulk: bool = False) -> bool:
        if bulk:
            # A batch line goes only to a worker with little in hand (`bulk_share` of the window,
            # no big prompt). A later interactive prompt waits only for the step in progress
            # (the engine takes it before batch lines), but it needs room in the window too.
            return not self.holds_big and self.small_tokens < int(self.tokens * self.bulk_share)
        if self.is_big(num_prompt_tokens):
            return not self.holds_interactive_big
        return self.small_room > 0

    def kinds(self) -> tuple[bool, bool, bool]:
        """Whether it takes (a small prompt, a big one, a bulk line)."""
        return self.small_room > 0, not self.holds_interactive_big, self.takes(0, bulk=True)


class PrefillRoom:
    """The prefill workers' windows, and who takes what (see the module doc). Health is
    `WorkerState.making_progress(now, timeout_s)`, asked of the workers a question meets.
    `prefill_room.c` is the same room in C (`native_indexes.py` chooses)."""

    def __init__(self, window_tokens: int, bulk_share: float = BULK_WINDOW_SHARE):
        self.window_tokens = window_tokens
        self.bulk_share = bulk_share
        self.windows: dict[str, PrefillWindow] = {}
        # peer id -> request id -> (prompt tokens, whether a batch line)
        self._held: dict[str, dict[str, tuple[int, bool]]] = {}
        self._takers: dict[str, dict[str, WorkerState]] = {SMALL: {}, BIG: {}, BULK: {}}
        # kind -> measured rate -> lazy heap of (held tokens, -room, peer id)
        self._by_load: dict[str, dict[float, list[LoadEntry]]] = {SMALL: {}, BIG: {}, BULK: {}}

    def add(self, worker: WorkerState) -> None:
        self.windows[worker.peer_id] = PrefillWindow(self.window_tokens, self.bulk_share)
        self._held[worker.peer_id] = {}
        self._sort(worker)

    def remove(self, peer_id: str) -> None:
        self.windows.pop(peer_id, None)
        self._held.pop(peer_id, None)
        for takers in self._takers.values():
            takers.pop(peer_id, None)

    def hold(
        self, worker: WorkerState, request_id: str, num_prompt_tokens: int, bulk: bool
    ) -> None:
        held = self._held[worker.peer_id]
        if request_id not in held:
            held[request_id] = (num_prompt_tokens, bulk)
            self.windows[worker.peer_id].hold(num_prompt_tokens, bulk)
            self._sort(worker)

    def release(self, worker: WorkerState, request_id: str) -> None:
        held = self._held.get(worker.peer_id)
        if held is not None and request_id in held:
            self.windows[worker.peer_id].release(*held.pop(request_id))
            self._sort(worker)

    def rate_changed(self, worker: WorkerState) -> None:
        if worker.peer_id in self.windows:
            self._sort(worker)

    # -- a worker's window ----------------------------------------------------------------------

    def held_tokens(self, peer_id: str) -> int:
        return self.windows[peer_id].held_tokens

    def small_room(self, peer_id: str) -> int:
        return self.windows[peer_id].small_room

    def interactive_tokens(self, peer_id: str) -> int:
        return self.windows[peer_id].interactive_tokens

    def takes(self, peer_id: str, num_prompt_tokens: int, bulk: bool) -> bool:
        return self.windows[peer_id].takes(num_prompt_tokens, bulk)

    # -- who takes what -------------------------------------------------------------------------

    def takes_any(self, num_prompt_tokens: int, bulk: bool, now: float, timeout_s: float) -> bool:
        """Whether some healthy worker's window takes such a prompt."""
        # (a loop, not any(...): a dispatch asks this thrice per choice)
        for worker in self._takers[self._kind(num_prompt_tokens, bulk)].values():
            if worker.making_progress(now, timeout_s):
                return True
        return False

    def kinds_taken(self, now: float, timeout_s: float) -> tuple[bool, bool, bool]:
        """Whether a healthy worker takes a small prompt, a big one, a batch line."""
        return (
            self.takes_any(0, False, now, timeout_s),
            self.takes_any(self.window_tokens // 2 + 1, False, now, timeout_s),
            self.takes_any(0, True, now, timeout_s),
        )

    def takers_by_load(
        self, num_prompt_tokens: int, bulk: bool, now: float, timeout_s: float
    ) -> Iterator[Iterator[WorkerState]]:
        """The healthy takers of such a prompt, per measured rate, by tokens held (fewest
        first), then room (most first), then peer id, each once. Each walk is lazy: stop it
        early."""
        kind = self._kind(num_prompt_tokens, bulk)
        groups = self._by_load[kind]
        for rate in list(groups):
            heap = groups[rate]
            if lazy_heap.live_top(heap, self._live_for(kind, rate)) is None:
                del groups[rate]  # no live entry left
                continue
            yield self._walk(heap, kind, rate, now, timeout_s)

    def num_entries(self) -> int:
        """The entries in all heaps, live or stale (what the index holds)."""
        return sum(len(heap) for groups in self._by_load.values() for heap in groups.values())

    def _walk(
        self, heap: list[LoadEntry], kind: str, rate: float, now: float, timeout_s: float
    ) -> Iterator[WorkerState]:
        live = self._live_for(kind, rate)
        last = None
        for entry in lazy_heap.in_order(heap):
            # A worker's live entries are equal, so they come together: it is yielded once.
            if entry[2] != last and live(entry):
                last = entry[2]
                worker = self._takers[kind][entry[2]]
                if worker.making_progress(now, timeout_s):
                    yield worker

    def _kind(self, num_prompt_tokens: int, bulk: bool) -> str:
        big = num_prompt_tokens > self.window_tokens // 2
        return BULK if bulk else (BIG if big else SMALL)

    def _sort(self, worker: WorkerState) -> None:
        window = self.windows[worker.peer_id]
        rate = worker.prefill_tokens_per_s
        entry = (window.held_tokens, -window.small_room, worker.peer_id)
        for kind, takes in zip((SMALL, BIG, BULK), window.kinds(), strict=True):
            takers = self._takers[kind]
            if not takes:
                takers.pop(worker.peer_id, None)
                continue
            takers[worker.peer_id] = worker
            heap = self._by_load[kind].setdefault(rate, [])
            lazy_heap.push(heap, entry, len(takers), self._live_for(kind, rate))

    def _live_for(self, kind: str, rate: float) -> Callable[[LoadEntry], bool]:
        takers = self._takers[kind]

        def live(entry: LoadEntry) -> bool:
            worker = takers.get(entry[2])
            if worker is None or worker.prefill_tokens_per_s != rate:
                return False
            window = self.windows[entry[2]]
            return entry[0] == window.held_tokens and entry[1] == -window.small_room

        return live


# (prompt tokens held, -room in the window, peer id): the least loaded prefill worker first.
LoadEntry = tuple[int, int, str]
# (share of seats taken, -available blocks, requests, registration order, peer id)
BusyEntry = tuple[float, int, int, int, str]
# (-available blocks, requests, registration order, peer id): the best worker is the smallest.
DecodeEntry = tuple[int, int, int, str]


class DecodeRoom:
    """The decode workers with a seat free: all of a worker's seats, or for batch lines
    `seat_share` of them (at least one), the rest kept for interactive requests, which would
    otherwise wait in the queue for a batch line to finish (the engine cannot make a running
    batch line yield its seat).

    Health is `WorkerState.making_progress(now, timeout_s)`, asked of the workers a question
    meets. `decode_room.c` is the same room in C (`native_indexes.py` chooses)."""

    def __init__(self, workers: dict[str, WorkerState], seat_share: float | None = None):
        if seat_share is not None and not 0 < seat_share <= 1:
            raise ValueError(f"seat_share must be in (0, 1], got {seat_share!r}")
        self._workers = workers  # the registry's decode workers
        self._seat_share = seat_share
        self._heaps: dict[int, list[DecodeEntry]] = {}  # block size -> its workers' entries
        self._by_busy: list[BusyEntry] = []
        # Each worker's last entry pushed (and seats): while they hold, its entries are live.
        self._pushed: dict[str, tuple[DecodeEntry, int]] = {}
        # (-KV capacity in tokens, registration order, peer id), for the admission's question.
        self._capacities: list[tuple[int, int, str]] = []

    def add(self, worker: WorkerState) -> None:
        capacity = worker.pool_tokens
        entry = (-capacity, worker.order, worker.peer_id)
        lazy_heap.push(self._capacities, entry, len(self._workers), self._registered)
        self.update(worker)

    def remove(self, peer_id: str) -> None:
        """The worker left the registry (its entries are stale already)."""
        self._pushed.pop(peer_id, None)

    def update(self, worker: WorkerState) -> None:
        """The worker's room or seats changed (or it registered): its entry follows. A worker
        with no seat free has none until one frees."""
        seats = self._seats(worker)
        if len(worker.request_ids) >= seats:
            self._pushed.pop(worker.peer_id, None)  # its entries may go stale now
            return
        entry = _entry(worker)
        if self._pushed.get(worker.peer_id) == (entry, seats):
            return  # unchanged (a heartbeat with the same figures): its entries are live
        self._pushed[worker.peer_id] = (entry, seats)
        heap = self._heaps.setdefault(worker.block_size, [])
        lazy_heap.push(heap, entry, len(self._workers), self._live)
        lazy_heap.push(self._by_busy, _busy_entry(worker), len(self._workers), self._busy_live)

    def least_busy(
        self, num_tokens: int, now: float, timeout_s: float, excluded: Container[str]
    ) -> WorkerState | None:
        """The healthy worker with a seat free, not `excluded`, that can hold `num_tokens`, with
        the smallest share of its seats taken (then the most available blocks, the fewest
        requests, the first registered)."""
        lazy_heap.live_top(self._by_busy, self._busy_live)
        for entry in lazy_heap.in_order(self._by_busy):
            worker = self._workers.get(entry[4])
            if (
                worker is not None
                and entry[4] not in excluded
                and self._busy_live(entry)
                and worker.num_available_blocks >= worker.blocks_for(num_tokens)
                and worker.making_progress(now, timeout_s)
            ):
                return worker
        return None

    def best(self, num_tokens: int, now: float, timeout_s: float) -> WorkerState | None:
        """The healthy worker with a seat free and the most available blocks (then the fewest
        requests, then the first registered) that can hold `num_tokens`; None if none can."""
        found = [
            w
            for w in self._tops(now, timeout_s)
            if w.num_available_blocks >= w.blocks_for(num_tokens)
        ]
        return min(found, key=_entry, default=None)

    def max_tokens(self, now: float, timeout_s: float) -> int:
        """The most tokens a healthy worker with a seat free can hold now (0: none can)."""
        tokens = [w.num_available_blocks * w.block_size for w in self._tops(now, timeout_s)]
        return max(tokens, default=0)

    def max_capacity(self, now: float, timeout_s: float) -> int | None:
        """The largest KV cache, in tokens, of a healthy worker (None: no worker is healthy)."""
        lazy_heap.live_top(self._capacities, self._registered)
        for entry in lazy_heap.in_order(self._capacities):
            if self._registered(entry) and self._workers[entry[2]].making_progress(now, timeout_s):
                return -entry[0]
        return None

    def has_seat(self, worker: WorkerState) -> bool:
        return len(worker.request_ids) < self._seats(worker)

    def num_entries(self) -> int:
        """The entries in all heaps, live or stale (what the index holds)."""
        heaps: list[list] = [*self._heaps.values(), self._by_busy, self._capacities]
        return sum(len(heap) for heap in heaps)

    def _seats(self, worker: WorkerState) -> int:
        if self._seat_share is None:
            return worker.max_num_seqs
        return max(1, int(worker.max_num_seqs * self._seat_share))

    def _tops(self, now: float, timeout_s: float) -> Iterator[WorkerState]:
        """Per block size, the first healthy worker with a seat free: the one that can hold the
        most tokens of its block size."""
        for heap in self._heaps.values():
            top = lazy_heap.live_top(heap, self._live)
            if top is None:
                continue
            worker = self._workers[top[3]]  # the usual case: the top has a seat and is healthy
            if self.has_seat(worker) and worker.making_progress(now, timeout_s):
                yield worker
                continue
            for entry in lazy_heap.in_order(heap):
                if not self._live(entry):
                    continue
                worker = self._workers[entry[3]]  # live: registered
                if self.has_seat(worker) and worker.making_progress(now, timeout_s):
                    yield worker
                    break

    def _registered(self, entry: tuple[int, int, str]) -> bool:
        worker = self._workers.get(entry[2])
        return worker is not None and worker.order == entry[1]

    def _busy_live(self, entry: BusyEntry) -> bool:
        worker = self._workers.get(entry[4])
        return worker is not None and self.has_seat(worker) and _busy_entry(worker) == entry

    def _live(self, entry: DecodeEntry) -> bool:
        worker = self._workers.get(entry[3])
        return worker is not None and _entry(worker) == entry


def _busy_entry(worker: WorkerState) -> BusyEntry:
    # The share of seats as `cache_routing.decode_affinity` computes it, so the order agrees.
    busy = len(worker.request_ids) / worker.max_num_seqs
    return (
        busy,
        -worker.num_available_blocks,
        len(worker.request_ids),
        worker.order,
        worker.peer_id,
    )


def _entry(worker: WorkerState) -> DecodeEntry:
    return (-worker.num_available_blocks, len(worker.request_ids), worker.order, worker.peer_id)
