"""The worker registry: who is in the cluster, their load, and whether they are alive.

Workers introduce themselves with HELLO and then send heartbeats with their load. A worker whose
last heartbeat is older than the timeout is taken out of rotation (and its work re-routed by the
caller). The scheduler's own view of a decode worker's free blocks is the last heartbeat's figure
minus the blocks it has since promised to requests (reservations the worker has not yet reported),
so two requests dispatched between heartbeats cannot both count on the same blocks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class WorkerState:
    peer_id: str
    role: str  # "prefill" or "decode"
    identity: bytes  # the ROUTER identity messages to this worker go to
    address: str | None  # a decode worker's KV address
    num_total_blocks: int
    block_size: int
    max_num_seqs: int
    last_heartbeat: float
    num_free_blocks: int = 0
    num_running: int = 0
    num_waiting: int = 0
    num_swapped: int = 0
    steps_completed: int = 0
    recent_batch_sizes: list[int] = field(default_factory=list)  # steps of the last heartbeat
    metrics_address: str | None = None  # where its /metrics is served, if anywhere
    dtype: str | None = None  # its weights and KV dtype, as its HELLO said
    # Requests assigned to this worker that it holds state for.
    request_ids: set[str] = field(default_factory=set)
    # Blocks promised since the last heartbeat (decode only).
    num_promised_blocks: int = 0
    # When the worker last advanced its engine, or was idle (idle is not stuck).
    last_progress: float = 0.0
    busy: bool = False  # held work at its last heartbeat
    # Preemptions since the worker started, by kind ("swap", "recompute"), as last reported.
    num_preemptions: dict[str, int] = field(default_factory=lambda: {"swap": 0, "recompute": 0})
    prefill_tokens_per_s: float = 0.0  # its measured prefill rate, as last reported (0: none)
    step_s: float = 0.0  # its engine steps' recent duration, as last reported (0: none)
    num_prefix_query_tokens: int = 0  # prefix cache lookups and hits in tokens, as reported
    num_prefix_hit_tokens: int = 0

    def record_progress(self, steps_completed: int, busy: bool, now: float) -> None:
        if steps_completed > self.steps_completed or not busy:
            self.last_progress = now
        self.steps_completed = steps_completed
        self.busy = busy

    def making_progress(self, now: float, timeout_s: float) -> bool:
        return not self.busy or now - self.last_progress <= timeout_s

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_available_blocks(self) -> int:
        return self.num_free_blocks - self.num_promised_blocks


class WorkerRegistry:
    def __init__(self, heartbeat_timeout_s: float, progress_timeout_s: float):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # A worker that holds work and completes no step for this long is stuck: it answers
        # heartbeats but serves nothing, so it gets no new work and does not count as ready.
        self.progress_timeout_s = progress_timeout_s
        self.workers: dict[str, WorkerState] = {}
        # The same workers by role, so a dispatch does not sift a thousand of the other role.
        self._by_role: dict[str, dict[str, WorkerState]] = {}

    def add(self, worker: WorkerState) -> None:
        self.remove(worker.peer_id)
        self.workers[worker.peer_id] = worker
        self._by_role.setdefault(worker.role, {})[worker.peer_id] = worker

    def remove(self, peer_id: str) -> WorkerState | None:
        worker = self.workers.pop(peer_id, None)
        if worker is not None:
            del self._by_role[worker.role][peer_id]
        return worker

    def get(self, peer_id: str) -> WorkerState | None:
        return self.workers.get(peer_id)

    def by_role(self, role: str) -> list[WorkerState]:
        return list(self._by_role.get(role, {}).values())

    def healthy(self, role: str, now: float) -> list[WorkerState]:
        return [w for w in self.by_role(role) if w.making_progress(now, self.progress_timeout_s)]

    def expired(self, now: float) -> list[WorkerState]:
        return [
            w for w in self.workers.values() if now - w.last_heartbeat > self.heartbeat_timeout_s
        ]

    def pick_decode(
        self,
        num_tokens: int,
        now: float,
        affinity: Callable[[WorkerState], float] | None = None,
        seat_share: float = 1.0,
        num_needed_tokens: int = 0,
    ) -> WorkerState | None:
        """The decode worker with the best `affinity` (if given), then the most available
        blocks, among those that can hold `num_tokens` with a seat free among `seat_share` of
        theirs (at least one), and whose whole pool holds `num_needed_tokens`."""
        candidates = [
            w
            for w in self.healthy("decode", now)
            if w.num_available_blocks >= w.blocks_for(num_tokens)
            and w.num_total_blocks * w.block_size >= num_needed_tokens
            and len(w.request_ids) < max(1, int(w.max_num_seqs * seat_share))
        ]
        return max(
            candidates,
            key=lambda w: (
                affinity(w) if affinity else 0.0,
                w.num_available_blocks,
                -len(w.request_ids),
            ),
            default=None,
        )
