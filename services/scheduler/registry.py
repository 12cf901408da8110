"""The worker registry: who is in the cluster, their load, and whether they are alive.

Workers introduce themselves with HELLO and then send heartbeats with their load. A worker whose
last heartbeat is older than the timeout is taken out of rotation (and its work re-routed by the
caller). The scheduler's own view of a decode worker's free blocks is the last heartbeat's figure
minus the blocks it has since promised to requests (reservations the worker has not yet reported),
so two requests dispatched between heartbeats cannot both count on the same blocks.

The registry keeps indexes over its workers (`worker_index.py`: prefill windows, decode workers
by room), so every change to a worker's load goes through it: `assign` and `release` a request,
`reserve` a decode worker's blocks, `report_free_blocks`. A dispatch then reads who has room
without a scan.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator

from services.scheduler.native_indexes import (
    NativeOrPython,
    decode_room_type,
    kind,
    prefill_room_type,
)
from services.scheduler.worker_index import (
    BULK_SEAT_SHARE,
    BULK_WINDOW_SHARE,
    DecodeRoom,
    PrefillRoom,
)
from services.scheduler.worker_state import WorkerState

# A worker whose connection closed is gone unless it beats again within this: three of the
# default heartbeat intervals (a live one reconnects in a tenth of a second, then beats).
DISCONNECT_GRACE_S = 1.5


class WorkerRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        progress_timeout_s: float,
        window_tokens: int = 2048,
        bulk_window_share: float = BULK_WINDOW_SHARE,
        bulk_seat_share: float = BULK_SEAT_SHARE,
        indexes: str = "auto",
        disconnect_grace_s: float = DISCONNECT_GRACE_S,
    ):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.disconnect_grace_s = disconnect_grace_s  # see `WorkerState.disconnected_at`
        # A worker that holds work and completes no step for this long is stuck: it answers
        # heartbeats but serves nothing, so it gets no new work and does not count as ready.
        self.progress_timeout_s = progress_timeout_s
        self.workers: dict[str, WorkerState] = {}
        # The same workers by role, so a dispatch does not sift a thousand of the other role.
        self._by_role: dict[str, dict[str, WorkerState]] = {"prefill": {}, "decode": {}}
        self._registrations = itertools.count(1)
        # The rooms in C or Python (`native_indexes.py`): the same answers either way.
        self.prefill_room: NativeOrPython = prefill_room_type(indexes)(
            window_tokens, bulk_window_share
        )
        self._decode_room_type = decode_room_type(indexes)
        self.decode_room: NativeOrPython = self._decode_room_type(self._by_role["decode"])
        # The same workers for batch lines, which leave some seats to interactive requests:
        # built when first asked (`_room`), so a cluster that runs no job keeps no second index.
        self.bulk_seat_share = bulk_seat_share
        self._bulk_decode_room: NativeOrPython | None = None
        # Each role's KV pools, in tokens, and how many workers have each: a request past the
        # smallest decode pool goes only to a worker whose pool holds its whole length
        # (`pick_decode`), a prompt past the smallest prefill pool only to a prefill worker
        # that holds it (a prefill worker refuses a prompt its cache cannot hold, for good).
        self._pools: dict[str, dict[int, int]] = {"prefill": {}, "decode": {}}
        self.smallest_decode_pool = 0  # (0: no decode worker)
        self.smallest_prefill_pool = 0  # (0: no prefill worker)
        self.largest_prefill_pool = 0
        # The prefill workers' measured rates summed (the wait forecast's prior), kept as they
        # report, join and leave: no scan of a thousand workers per request.
        self.prefill_tokens_per_s = 0.0

    def add(self, worker: WorkerState) -> None:
        self.remove(worker.peer_id)
        worker.order = next(self._registrations)
        self.workers[worker.peer_id] = worker
        self._by_role.setdefault(worker.role, {})[worker.peer_id] = worker
        if worker.role == "prefill":
            self.prefill_room.add(worker)
            self.prefill_tokens_per_s += worker.prefill_tokens_per_s
            self._count_pool(worker, 1)
        elif worker.role == "decode":
            self.decode_room.add(worker)
            if self._bulk_decode_room is not None:
                self._bulk_decode_room.add(worker)
            self._count_pool(worker, 1)

    def remove(self, peer_id: str) -> WorkerState | None:
        worker = self.workers.pop(peer_id, None)
        if worker is not None:
            del self._by_role[worker.role][peer_id]
            self.prefill_room.remove(peer_id)
            if worker.role == "decode":
                for room in (self.decode_room, self._bulk_decode_room):
                    if room is not None:
                        room.remove(peer_id)
                self._count_pool(worker, -1)
            if worker.role == "prefill":
                self._add_prefill_rate(-worker.prefill_tokens_per_s)
                self._count_pool(worker, -1)
        return worker

    def get(self, peer_id: str) -> WorkerState | None:
        return self.workers.get(peer_id)

    def _count_pool(self, worker: WorkerState, change: int) -> None:
        pools = self._pools[worker.role]
        pool = worker.pool_tokens
        left = pools.get(pool, 0) + change
        if left:
            pools[pool] = left
        else:
            del pools[pool]
        if worker.role == "decode":
            self.smallest_decode_pool = min(pools, default=0)
        else:
            self.smallest_prefill_pool = min(pools, default=0)
            self.largest_prefill_pool = max(pools, default=0)

    # -- changes to a worker's load (the indexes follow) ---------------------------------------

    def assign(
        self, worker: WorkerState, request_id: str, num_prompt_tokens: int, bulk: bool = False
    ) -> None:
        """The worker now holds state for the request (a prefill worker: its prompt tokens, and
        whether they are a batch line's)."""
        worker.request_ids.add(request_id)
        self._changed(worker, request_id, num_prompt_tokens, bulk)

    def release(self, worker: WorkerState, request_id: str) -> None:
        worker.request_ids.discard(request_id)
        self._changed(worker, request_id, None, False)

    def reserve(self, worker: WorkerState, request_id: str, num_blocks: int) -> None:
        """A decode worker now holds state for the request and has promised it blocks (counted
        until its next heartbeat, which reflects them): one change for its indexes."""
        worker.request_ids.add(request_id)
        worker.num_promised_blocks += num_blocks
        if self.workers.get(worker.peer_id) is worker:
            self._decode_changed(worker)

    def report_free_blocks(
        self, worker: WorkerState, num_free_blocks: int, heartbeat: bool
    ) -> None:
        """The worker's own count; a heartbeat's already reflects every reservation made.
        Read within its pool (the HELLO's blocks): a count past it is a broken report, and the
        wire takes any int, which the C rooms cannot hold."""
        worker.num_free_blocks = min(max(0, num_free_blocks), worker.num_total_blocks)
        if heartbeat:
            worker.num_promised_blocks = 0
        if worker.role == "decode":
            self._decode_changed(worker)

    def report_prefill_rate(self, worker: WorkerState, tokens_per_s: float) -> None:
        if worker.prefill_tokens_per_s != tokens_per_s:
            if worker.role == "prefill" and self.workers.get(worker.peer_id) is worker:
                self._add_prefill_rate(tokens_per_s - worker.prefill_tokens_per_s)
            worker.prefill_tokens_per_s = tokens_per_s
            self.prefill_room.rate_changed(worker)

    def _add_prefill_rate(self, change: float) -> None:
        # Clamped: float sums of ups and downs may stop a hair below zero when all have left.
        self.prefill_tokens_per_s = max(0.0, self.prefill_tokens_per_s + change)

    def _changed(
        self, worker: WorkerState, request_id: str, num_tokens: int | None, bulk: bool
    ) -> None:
        if self.workers.get(worker.peer_id) is not worker:
            return  # gone from the registry: nothing to index
        if worker.role == "prefill":
            if num_tokens is None:
                self.prefill_room.release(worker, request_id)
            else:
                self.prefill_room.hold(worker, request_id, num_tokens, bulk)
        elif worker.role == "decode":
            self._decode_changed(worker)

    def _decode_changed(self, worker: WorkerState) -> None:
        self.decode_room.update(worker)
        if self._bulk_decode_room is not None:
            self._bulk_decode_room.update(worker)

    def _room(self, bulk: bool) -> NativeOrPython:
        """The decode workers with a seat free for an interactive request, or a batch line."""
        if not bulk:
            return self.decode_room
        if self._bulk_decode_room is None:
            room = self._decode_room_type(self._by_role["decode"], self.bulk_seat_share)
            for worker in self._by_role["decode"].values():
                room.add(worker)
            self._bulk_decode_room = room
        return self._bulk_decode_room

    @property
    def decode_room_kind(self) -> str:
        """Which decode room serves: `native` (C) or `python`."""
        return kind(self.decode_room, DecodeRoom)

    @property
    def prefill_room_kind(self) -> str:
        return kind(self.prefill_room, PrefillRoom)

    # -- who has room --------------------------------------------------------------------------

    def by_role(self, role: str) -> list[WorkerState]:
        return list(self._by_role.get(role, {}).values())

    def is_healthy(self, worker: WorkerState, now: float) -> bool:
        return worker.making_progress(now, self.progress_timeout_s)

    def healthy(self, role: str, now: float) -> list[WorkerState]:
        return [w for w in self.by_role(role) if self.is_healthy(w, now)]

    def any_healthy(self, role: str, now: float) -> bool:
        for worker in self._by_role.get(role, {}).values():
            if worker.making_progress(now, self.progress_timeout_s):
                return True
        return False

    def expired(self, now: float) -> list[WorkerState]:
        """The workers out of rotation now: silent past the heartbeat timeout, or their
        connection closed and no heartbeat since, for the grace a reconnect takes."""
        return [w for w in self.workers.values() if self._gone(w, now)]

    def _gone(self, worker: WorkerState, now: float) -> bool:
        if now - worker.last_heartbeat > self.heartbeat_timeout_s:
            return True
        closed_at = worker.disconnected_at
        return closed_at is not None and now - closed_at > self.disconnect_grace_s

    def connection_closed(self, identity: bytes, now: float) -> WorkerState | None:
        """The worker whose connection (ROUTER identity) closed, marked so (None: no worker's,
        a gateway's say). A scan: connections close rarely, and only a worker's own
        heartbeat, on its next connection, clears the mark."""
        for worker in self.workers.values():
            if worker.identity == identity:
                worker.disconnected_at = now
                return worker
        return None

    # A prefill worker's window (`PrefillWindow`): what it holds, and whether it takes more.
    def held_tokens(self, worker: WorkerState) -> int:
        return self.prefill_room.held_tokens(worker.peer_id)

    def small_room(self, worker: WorkerState) -> int:
        return self.prefill_room.small_room(worker.peer_id)

    def interactive_tokens(self, worker: WorkerState) -> int:
        return self.prefill_room.interactive_tokens(worker.peer_id)

    def window_takes(self, worker: WorkerState, num_prompt_tokens: int, bulk: bool) -> bool:
        return self.prefill_room.takes(worker.peer_id, num_prompt_tokens, bulk)

    def prefill_takers_by_load(
        self, num_prompt_tokens: int, bulk: bool, now: float
    ) -> Iterable[Iterator[WorkerState]]:
        """Per measured rate, the healthy prefill workers whose window takes such a prompt, by
        tokens held, then room (most first), then peer id (lazy walks)."""
        timeout_s = self.progress_timeout_s
        return self.prefill_room.takers_by_load(num_prompt_tokens, bulk, now, timeout_s)

    def takes_prefill(self, num_prompt_tokens: int, bulk: bool, now: float) -> bool:
        return self.prefill_room.takes_any(num_prompt_tokens, bulk, now, self.progress_timeout_s)

    def prefill_kinds_taken(self, now: float) -> tuple[bool, bool, bool]:
        """Whether a healthy prefill worker takes a small prompt, a big one (over half the
        window), a batch line."""
        return self.prefill_room.kinds_taken(now, self.progress_timeout_s)

    def prefill_pools_taking(self, now: float) -> tuple[int, int, int]:
        """The largest KV cache, in tokens, of a healthy prefill worker whose window takes a
        small prompt, a big one, a batch line (0: none does). Workers of one pool size (the
        usual cluster) answer at once: the kinds taken are `prefill_kinds_taken`'s."""
        if self.smallest_prefill_pool == self.largest_prefill_pool:
            pool = self.largest_prefill_pool
            return pool, pool, pool
        room = self.prefill_room
        big = room.window_tokens // 2 + 1
        small_pool = big_pool = bulk_pool = 0
        for worker in self._by_role["prefill"].values():
            if not self.is_healthy(worker, now):
                continue
            pool = worker.pool_tokens
            if pool > small_pool and room.takes(worker.peer_id, 0, False):
                small_pool = pool
            if pool > big_pool and room.takes(worker.peer_id, big, False):
                big_pool = pool
            if pool > bulk_pool and room.takes(worker.peer_id, 0, True):
                bulk_pool = pool
        return small_pool, big_pool, bulk_pool

    def max_decode_tokens(self, now: float, bulk: bool = False) -> int:
        """The most tokens some healthy decode worker with a seat free (for a batch line if
        `bulk`) can hold now."""
        return self._room(bulk).max_tokens(now, self.progress_timeout_s)

    def max_decode_capacity(self, now: float) -> int | None:
        """The largest KV cache, in tokens, of a healthy decode worker (None: none is)."""
        return self.decode_room.max_capacity(now, self.progress_timeout_s)

    def pick_decode(
        self,
        num_tokens: int,
        now: float,
        affinity: Callable[[WorkerState], float] | None = None,
        holders: set[str] | None = None,
        bulk: bool = False,
        num_needed_tokens: int = 0,
    ) -> WorkerState | None:
        """The decode worker with the best `affinity` (if given), then the most available
        blocks, then the fewest requests, then the first registered, among those with a seat
        free (for a batch line if `bulk`) that can hold `num_tokens` now and whose whole pool
        holds `num_needed_tokens` (the prompt plus max_tokens: a worker refuses a request that
        could outgrow its pool). `holders`, given with an affinity that rewards a cached
        prefix, names the only workers holding one: the rest rank by seats taken (their
        affinity) from the index."""
        if num_needed_tokens > self.smallest_decode_pool:  # past some pool: those are out
            candidates = self._decode_holding(num_tokens, num_needed_tokens, now, bulk)
            return max(
                candidates,
                key=lambda w: (
                    0.0 if affinity is None else affinity(w),
                    w.num_available_blocks,
                    -len(w.request_ids),
                    -w.order,
                ),
                default=None,
            )
        timeout_s = self.progress_timeout_s
        room = self._room(bulk)
        if affinity is None:  # the index's answer: no pass over the workers
            return room.best(num_tokens, now, timeout_s)
        if holders is None:
            workers = self.healthy("decode", now)
        else:
            by_id = self._by_role["decode"]
            workers = [
                by_id[p] for p in holders if p in by_id and by_id[p].making_progress(now, timeout_s)
            ]
            rest = room.least_busy(num_tokens, now, timeout_s, holders)
            workers += [rest] if rest is not None else []
        candidates = [
            w
            for w in workers
            if w.num_available_blocks >= w.blocks_for(num_tokens) and room.has_seat(w)
        ]
        return max(
            candidates,
            key=lambda w: (affinity(w), w.num_available_blocks, -len(w.request_ids), -w.order),
            default=None,
        )

    def decode_takes(self, num_tokens: int, num_needed_tokens: int, now: float, bulk: bool) -> bool:
        """Whether `pick_decode` has a worker for such a request now (a scan: asked only for a
        request past the smallest pool, `decode_fit.py`)."""
        room = self._room(bulk)
        for w in self._by_role["decode"].values():
            if self._decode_holds(w, num_tokens, num_needed_tokens, now, room):
                return True
        return False

    def _decode_holding(
        self, num_tokens: int, num_needed_tokens: int, now: float, bulk: bool
    ) -> list[WorkerState]:
        """The healthy decode workers with a seat free (for a batch line if `bulk`) that can hold
        `num_tokens` now and whose pool holds `num_needed_tokens`. A scan: asked only for a
        request past the smallest pool, which a cluster of equal pools never has."""
        room = self._room(bulk)
        return [
            w
            for w in self._by_role["decode"].values()
            if self._decode_holds(w, num_tokens, num_needed_tokens, now, room)
        ]

    def _decode_holds(
        self,
        worker: WorkerState,
        num_tokens: int,
        num_needed_tokens: int,
        now: float,
        room: NativeOrPython,
    ) -> bool:
        return (
            worker.pool_tokens >= num_needed_tokens
            and worker.num_available_blocks >= worker.blocks_for(num_tokens)
            and room.has_seat(worker)
            and worker.making_progress(now, self.progress_timeout_s)
        )
