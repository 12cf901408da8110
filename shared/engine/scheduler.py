"""The engine's step scheduler: which sequences run in the next step, and how many tokens each.

Pure bookkeeping over `Sequence` counters and the `BlockManager`; no tensors. Each step has a
token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):

1. Running sequences go first, oldest first: a decoding one takes one token, one still in its
   prompt takes the next chunk that fits the budget. If the pool cannot give a running sequence
   the block it needs, the newest running sequence is preempted for recompute (its blocks freed,
   its counter reset, back to the head of the waiting queue) until the need is met.
2. Waiting sequences are admitted in order while budget, seats and blocks allow; a prompt longer
   than what is left of the budget starts with a chunk of it (chunked prefill), so a long prompt
   never blocks the running decodes and is itself never starved by them.

Preempted sequences wait at the head of the queue, so they resume before new ones are admitted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from shared.engine.block_manager import BlockManager
from shared.engine.sequence import Sequence, SequenceStatus


@dataclass(frozen=True)
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int  # tokens of the sequence to run this step, from num_computed_tokens on


class StepScheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, sequence: Sequence) -> None:
        self.waiting.append(sequence)

    def add_running(self, sequence: Sequence) -> None:
        """Admits a sequence that already holds its blocks (its KV came from elsewhere)."""
        sequence.status = SequenceStatus.RUNNING
        self.running.append(sequence)

    def schedule(self) -> list[ScheduledChunk]:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledChunk] = []
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_tokens):
                continue
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            num_tokens = min(seq.num_uncomputed_tokens, budget)
            target = seq.num_computed_tokens + num_tokens
            if not self.block_manager.can_allocate(
                self.block_manager.num_new_blocks_for(seq.block_ids, target)
            ):
                break
            self.waiting.popleft()
            self.block_manager.grow(seq.block_ids, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            budget -= num_tokens
        return scheduled

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s blocks for this step, preempting newer sequences if needed."""
        target = seq.num_computed_tokens + num_tokens
        while not self.block_manager.can_allocate(
            self.block_manager.num_new_blocks_for(seq.block_ids, target)
        ):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq.block_ids, target)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks; it will be prefilled again, before new arrivals."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_ids)
        seq.block_ids.clear()
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """Retires a sequence (running or waiting) and returns its blocks to the pool."""
        assert status.is_finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_ids)
        seq.block_ids = []
        seq.status = status
