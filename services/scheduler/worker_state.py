"""One registered worker as the scheduler sees it: identity, load as last reported, the requests
it holds, and whether it is making progress. The registry (`registry.py`) owns these and keeps
its indexes (`worker_index.py`) in step with every change of load."""

from __future__ import annotations

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
    # When its connection to the scheduler closed, unless a heartbeat came since (then None):
    # a worker whose process died is out of rotation `disconnect_grace_s` later, not after the
    # whole heartbeat timeout; one whose connection only blipped beats again on a new one.
    disconnected_at: float | None = None
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
    num_heartbeats: int = 0  # read since it registered: tells "unlisted twice in a row" apart
    order: int = 0  # when it registered, among all registrations: scans met workers in this order

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
    def pool_tokens(self) -> int:
        """Its whole KV cache, in tokens."""
        return self.num_total_blocks * self.block_size

    @property
    def num_available_blocks(self) -> int:
        return self.num_free_blocks - self.num_promised_blocks
