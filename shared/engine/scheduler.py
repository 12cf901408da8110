"""The engine's step scheduler: which sequences run in the next step, and how many tokens each.

Pure bookkeeping over `Sequence` counters and the `BlockManager`; no tensors. Each step has a
token budget (`max_num_batched_tokens`) and a seat limit (`max_num_seqs`):

1. Every running sequence that is decoding takes one token.
2. What is left of the budget is shared among the sequences still in their prompt (running ones
   first, then waiting ones, in order, as seats allow: one per `MIN_CHUNK` tokens of budget, but
   always at least one waiting one). Each gets a small floor, so every prompt advances every
   step; the rest goes to the smallest remaining prompts first. So a short prompt beside a long
   one finishes in one step, and a 100k-token prompt advances every step without blocking
   anyone (chunked prefill). Which prompts reach a worker at all is the cluster scheduler's
   fair-share decision; within the few a worker holds, shortest-first minimizes time to first
   token.
3. If the pool cannot give a running sequence the blocks it needs, the least urgent running
   sequence (lowest priority, then latest arrival) is preempted until the need is met: by
   recompute (its blocks freed, its counter reset, back to the head of the waiting queue) or by
   swap (its KV blocks listed for the engine to copy to host memory before the step runs, its
   blocks freed, its progress kept), as `choose_preemption` decides per sequence (recompute when
   none is given).
   With a step time target (`prompt_token_cap`, set by the engine from the measured prefill
   rate), the prompt budget is also capped so a step takes about that long: a prompt that
   arrives mid-step waits at most about the target; the cap is raised to finish the short
   prompts in the step (`raise_cap_for_short_prompts`). And a step that brings prompts to their
   first token carries little else: the prompts it does not finish get only their floor, so the
   finishing ones' first tokens are not held up by a long prompt's big chunk (`lighten`). Bulk
   prompts (batch jobs' lines) never raise the cap, take the budget after interactive ones, and
   get nothing in a step that brings an interactive prompt to its first token.
4. Swapped sequences come back, most urgent first, when blocks are free for their KV and
   next chunk (one token, or a step's prompt tokens for one swapped out mid-prompt) plus one
   growth block per sequence running before, blocks a worker does not promise to new arrivals
   (`blocks_to_resume`); the engine copies their KV back before the step runs. A sequence
   swapped in is never swapped out in the same step: should a more urgent one need its blocks
   after all, its swap-in is undone before anything is copied. Preempted sequences resume in
   urgency order however each was preempted: a swapped one waits while a more urgent one
   preempted for recompute does, and only such a one is admitted while any is swapped out.
   No new sequence is admitted then, nor in a step that preempted: preempted sequences resume
   before new ones are admitted.
5. With a prefix cache, a newcomer first takes the cached blocks its tokens start with
   (`attach_cached_prefix`) and counts them computed, so its need, its share and its chunks
   cover only the uncached suffix; a newcomer not admitted after all gives them back, and so
   does every newcomer before a running sequence would be preempted for want of blocks, or
   before a later newcomer's pins would keep an earlier one out. Blocks
   copied back from the host tier take free blocks, so only those left after one growth block
   per running sequence (`_spare_blocks`).
6. A sequence whose grammar still compiles runs every token but its last
   (`Sequence.num_schedulable_tokens`): the chunk that brings it to its next token, a decode
   step included, waits until the compile ends or its deadline passes. So the compile overlaps
   its prefill, and no step waits on it; the sequence keeps its blocks (and its seat) meanwhile,
   preemptible like any other. One waiting with nothing else to run is not admitted yet.
7. Bulk decode rows (batch jobs' lines) take only the time interactive rows leave: beside any
   interactive row or prompt chunk, they join the step only as many as `max_bulk_decode_rows`
   allows (the engine's bound from its measured decode steps: the step within a slack of its
   time without them). The oldest go first: each line's tokens are bounded, so they finish and
   make way, and fewer lines hold KV at once than if every one advanced a little. Those left
   out keep their blocks and seats; with no interactive row in the step, they all run.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq
from dataclasses import dataclass, field

from shared.engine.block_manager import BlockManager
from shared.engine.prefix_blocks import attach_cached_prefix, detach_blocks
from shared.engine.sequence import Sequence, SequenceStatus

MIN_CHUNK = 64  # prompt tokens of budget per sharer: how many prompts share one step
PROGRESS_FLOOR = 16  # prompt tokens every sharer gets per step, budget allowing


def shortest_first(
    needs: Seq[int], budget: int, floor: int = PROGRESS_FLOOR, bulk: Seq[bool] = ()
) -> list[int]:
    """Shares of `budget` for `needs`: the interactive prompts' (`bulk` False or not given)
    first, then the bulk prompts' from what they leave, whose first token nobody waits on. In
    each kind, first up to `floor` each (the earliest first, while the budget lasts), so every
    prompt advances; then the rest to the smallest needs first, so the prompts closest to their
    first token get it soonest (shortest remaining work first: the least mean time to first
    token). Nothing needed is left over. (Bulk prompts had their floors beside interactive
    ones: under a step time cap of 64 tokens a batch line's 16 slowed an agent's long prompt by
    a quarter, its first token 5.2 s alone and 6.7-7.0 s beside a job.)"""
    is_bulk = _flags(bulk, len(needs))
    shares = [0] * len(needs)
    left = budget
    for kind in (False, True):
        ones = [i for i in range(len(needs)) if is_bulk[i] == kind]
        for i in ones:
            shares[i] = min(needs[i], floor, left)
            left -= shares[i]
        for i in sorted(ones, key=lambda i: (needs[i], i)):
            extra = min(needs[i] - shares[i], left)
            shares[i] += extra
            left -= extra
    return shares


def lighten(
    needs: Seq[int], shares: Seq[int], floor: int = PROGRESS_FLOOR, bulk: Seq[bool] = ()
) -> list[int]:
    """Shares for a step that is quick whenever it completes a prompt: if some share finishes
    its need and another does not, the unfinished ones keep only their floor. The finishing
    prompts' first tokens then wait for their own tokens, not for a long prompt's chunk; the
    long prompt still advances, and takes its big chunks in the steps between. When an
    interactive prompt finishes, bulk prompts (`bulk` True) get nothing in the step, finishing
    or not: a user's first token does not wait for a batch job's tokens (on a CPU where a token
    of prompt costs several milliseconds, a floor of 16 per bulk line doubled it)."""
    is_bulk = _flags(bulk, len(needs))
    finishing = [share == need for share, need in zip(shares, needs, strict=True)]
    if any(done and not b for done, b in zip(finishing, is_bulk, strict=True)):
        return [
            0 if b else share if done else min(share, floor)
            for share, done, b in zip(shares, finishing, is_bulk, strict=True)
        ]
    if all(finishing) or not any(finishing):
        return list(shares)
    return [
        share if done else min(share, floor) for share, done in zip(shares, finishing, strict=True)
    ]


def raise_cap_for_short_prompts(
    needs: Seq[int], cap: int, budget: int, floor: int = PROGRESS_FLOOR, bulk: Seq[bool] = ()
) -> int:
    """The prompt budget of a step under a time cap: the cap, raised (never past `budget`) to
    finish every short interactive prompt among `needs` (one needing no more than the cap)
    beside the others' floors. The cap exists so a short prompt never waits long behind a long
    prompt's chunk; splitting short prompts themselves across steps would only cost throughput
    (measured: a bursty mixed workload lost ~9% at a 0.2 s target without this), and a prompt
    that arrives behind such a step waits behind equals. Bulk prompts never raise it: an
    interactive prompt arriving behind a step of batch lines waits at most about the cap."""
    is_bulk = _flags(bulk, len(needs))
    short = [need <= cap and not b for need, b in zip(needs, is_bulk, strict=True)]
    raised = sum(need for need, s in zip(needs, short, strict=True) if s)
    floors = floor * short.count(False)
    return min(budget, max(cap, raised + floors))


def prompt_shares(needs: Seq[int], budget: int, cap: int | None, bulk: Seq[bool] = ()) -> list[int]:
    """One step's prompt shares, as the engine and the planner's simulated workers both take
    them: shortest first within `budget`, or, under a step time cap (`cap` tokens), within the
    cap raised for short interactive prompts, lightened when a prompt finishes."""
    if cap is None:
        return shortest_first(needs, budget, bulk=bulk)
    capped = raise_cap_for_short_prompts(needs, cap, budget, bulk=bulk)
    return lighten(needs, shortest_first(needs, capped, bulk=bulk), bulk=bulk)


def _flags(bulk: Seq[bool], count: int) -> list[bool]:
    """Per-prompt bulk flags; none given: all interactive."""
    return list(bulk) if bulk else [False] * count


def _urgency(seq: Sequence) -> tuple[bool, int, float]:
    return (seq.bulk, -seq.priority, seq.arrival_time)


@dataclass(frozen=True)
class ScheduledChunk:
    sequence: Sequence
    num_tokens: int  # tokens of the sequence to run this step, from num_computed_tokens on


@dataclass
class StepPlan:
    """One step's work. The engine copies swap_in, then swap_out, then runs the chunks: blocks
    freed by a swap-out may be written by this very step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    swap_in: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # host -> blocks
    swap_out: list[tuple[Sequence, list[int]]] = field(default_factory=list)  # blocks -> host


class StepScheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        choose_preemption: Callable[[Sequence, int], str] | None = None,
        hand_back_recomputed: bool = False,
        max_bulk_decode_rows: Callable[[int, int], int | None] | None = None,
    ):
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # (victim, its number of KV blocks) -> "swap" or "recompute"
        self.choose_preemption = choose_preemption or (lambda seq, num_blocks: "recompute")
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: list[Sequence] = []  # oldest first
        # A decode worker hands a sequence preempted for recompute back for prefill elsewhere
        # instead of recomputing it here: it leaves through `evicted`.
        self.hand_back_recomputed = hand_back_recomputed
        self.evicted: list[Sequence] = []
        # (the step's other decode rows, its prompt tokens) -> the bulk decode rows that may
        # join them (None: all). Not given: all, always.
        self.max_bulk_decode_rows = max_bulk_decode_rows
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"swap": 0, "recompute": 0}
        # Most prompt tokens in the next step, from a step time target (None: the budget alone).
        self.prompt_token_cap: int | None = None
        self._plan = StepPlan()
        self._pinning: list[Sequence] = []  # this step's newcomers holding cached blocks

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def blocks_to_resume(self) -> int:
        """Blocks the preempted sequences need to come back: their first claim on freed blocks,
        which a worker must not promise to new arrivals."""
        recomputed = [seq for seq in self.waiting if seq.num_preemptions > 0]
        if not self.swapped and not recomputed:
            return 0
        # The swapped ones come back beside a growth block per running sequence, each with its
        # next chunk (`_swap_in` asks exactly this to bring them all back): promised away, any
        # of those blocks would keep one out for as long as arrivals keep coming.
        resumed = sum(self._resume_blocks(seq) for seq in self.swapped)
        kv = sum(self.block_manager.num_blocks_for(seq.num_tokens) for seq in recomputed)
        return len(self.running) + resumed + kv

    def add(self, sequence: Sequence) -> None:
        """Queues a newcomer: in arrival order, except that an interactive one goes ahead of
        every bulk one not yet admitted (preempted sequences keep the head)."""
        if not sequence.bulk:
            for index, queued in enumerate(self.waiting):
                if queued.bulk and queued.num_preemptions == 0:
                    self.waiting.insert(index, sequence)
                    return
        self.waiting.append(sequence)

    def add_running(self, sequence: Sequence) -> None:
        """Admits a sequence that already holds its blocks (its KV came from elsewhere)."""
        sequence.status = SequenceStatus.RUNNING
        self.running.append(sequence)

    def schedule(self) -> StepPlan:
        plan = self._plan = StepPlan()
        self._swap_in(plan)
        # Most urgent first, so the tail, where victims are taken, is the lowest priority and
        # latest arrival, and a victim is never a sequence already scheduled in this step.
        self.running.sort(key=_urgency)
        # Each one's tokens that may run (`num_schedulable_tokens`), read once: a grammar compile
        # that ends mid-way would count a sequence held in the budget and scheduled after all.
        runnable = {id(seq): seq.num_schedulable_tokens for seq in self.running}
        decoding = [
            seq for seq in self.running if seq.num_uncomputed_tokens == 1 and runnable[id(seq)]
        ]
        full_budget = max(0, self.max_num_batched_tokens - len(decoding))
        cap = self.prompt_token_cap
        # Seats go by the capped budget; the shares' budget is raised for short prompts below.
        prompt_budget = full_budget if cap is None else min(full_budget, cap)
        in_prompt = [seq for seq in self.running if seq.num_uncomputed_tokens > 1]
        seats = self.max_num_seqs - len(self.running)
        # At least one newcomer shares whenever a seat is free: prompts in progress never hold
        # the budget against all new ones, however small the budget.
        max_newcomers = max(1, prompt_budget // MIN_CHUNK - len(in_prompt))
        num_newcomers = max(0, min(seats, max_newcomers))
        # (A waiting sequence with nothing to run until its grammar compiles takes no seat.)
        startable = (seq for seq in self.waiting if seq.num_schedulable_tokens > 0)
        newcomers = list(itertools.islice(startable, num_newcomers))
        for seq in newcomers:  # before their needs are counted: only the uncached suffix runs
            attach_cached_prefix(seq, self.block_manager, self._spare_blocks())
            runnable[id(seq)] = seq.num_schedulable_tokens
        self._pinning = newcomers  # give their cached blocks back before anyone is preempted
        # One held back to its last token by a compile shares no budget (had it a share of
        # nothing, `lighten` would take it for a prompt finishing in every step it waits).
        sharers = [seq for seq in in_prompt + newcomers if runnable[id(seq)] > 0]
        needs = [runnable[id(seq)] for seq in sharers]
        shares = prompt_shares(needs, full_budget, cap, [seq.bulk for seq in sharers])
        share_of = {id(seq): share for seq, share in zip(sharers, shares, strict=True)}
        held = self._held_bulk_rows(decoding, sharers, shares)
        scheduled = plan.chunks
        num_preemptions = self.num_preemptions
        for seq in list(self.running):
            if seq.status != SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop to make room for an older sequence
            decodes = seq.num_uncomputed_tokens == 1
            if decodes and id(seq) in held:
                continue  # a bulk row that would slow the interactive ones: it waits, seated
            num_tokens = runnable[id(seq)] if decodes else share_of.get(id(seq), 0)
            if num_tokens == 0 or not self._reserve(seq, num_tokens):
                continue
            scheduled.append(ScheduledChunk(seq, num_tokens))
        if self.num_preemptions != num_preemptions or not self._pinning:
            self._release_pins()
            return plan
        # While a sequence is swapped out (one swapped in may have gone back in the loop, see
        # `_undo_swap_in`) only the preempted sequences more urgent than it come in.
        admissible = list(itertools.takewhile(self._goes_before_swapped, newcomers))
        self._pinning = newcomers[len(admissible) :]
        self._release_pins()
        self._admit(admissible, share_of, scheduled)
        return plan

    def _held_bulk_rows(
        self, decoding: list[Sequence], sharers: list[Sequence], shares: list[int]
    ) -> set[int]:
        """The ids of the bulk decode rows this step leaves out: beside interactive work (a
        decode row, or a prompt chunk), those past `max_bulk_decode_rows`, youngest first
        (`decoding` is in urgency order); none when the step has no interactive work."""
        bulk_rows = [seq for seq in decoding if seq.bulk]
        if self.max_bulk_decode_rows is None or not bulk_rows:
            return set()
        num_rows = len(decoding) - len(bulk_rows)
        interactive_prompt = any(s and not seq.bulk for seq, s in zip(sharers, shares, strict=True))
        if not num_rows and not interactive_prompt:
            return set()
        limit = self.max_bulk_decode_rows(num_rows, sum(shares))
        return set() if limit is None else {id(seq) for seq in bulk_rows[limit:]}

    def _admit(
        self, newcomers: list[Sequence], share_of: dict[int, int], scheduled: list[ScheduledChunk]
    ) -> None:
        """Admits the newcomers in order while the pool holds their chunks. One that does not fit
        first takes back the pins of those behind it (they wait a step): a later newcomer's
        cached blocks never keep an earlier one out. One whose share is nothing (a bulk line in
        a step that brings an interactive prompt to its first token) sits the step out without
        holding back those behind it: a preempted bulk line keeps the head of the queue, and
        the prompt behind it, whose first token was what emptied its share, would never come
        in, nor the bulk line after it."""
        for index, seq in enumerate(newcomers):
            num_tokens = share_of.get(id(seq), 0)  # (none: held to its last token, see above)
            if num_tokens == 0:
                detach_blocks(seq, self.block_manager)  # its pins: it waits for a later step
                continue
            target = seq.num_computed_tokens + num_tokens
            needed = self.block_manager.num_new_blocks_for(seq.block_ids, target)
            last = not self.block_manager.can_allocate(needed)
            if last:
                self._pinning = newcomers[index + 1 :]
                self._release_pins()
            if not self.block_manager.can_allocate(needed):
                self._pinning = newcomers[index:]
                self._release_pins()
                return
            self.waiting.remove(seq)  # (the head, unless one before it sat the step out or
            # waits for its grammar with only its last token left)
            self._count_cache_hit(seq)
            self.block_manager.grow(seq.block_ids, target)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledChunk(seq, num_tokens))
            if last:
                return
        self._pinning = []

    def _release_pins(self) -> None:
        """Newcomers not admitted this step give back the cached blocks they took."""
        for seq in self._pinning:
            detach_blocks(seq, self.block_manager)
        self._pinning = []

    def _spare_blocks(self) -> int:
        """Free blocks a newcomer may fill from the host tier: what leaves every running
        sequence a block to grow into (a load must not preempt anyone), none while sequences
        are swapped out (no newcomer is admitted then)."""
        if self.swapped:
            return 0
        return max(0, self.block_manager.num_free_blocks - len(self.running))

    def _count_cache_hit(self, seq: Sequence) -> None:
        """An admitted newcomer's cached prefix is its prompt cache hit, counted at its first
        prefill only (a recompute after preemption reusing blocks is not a prompt hit)."""
        cache = self.block_manager.prefix_cache
        if cache is None or seq.cache_root is None or seq.num_preemptions > 0:
            return
        seq.num_cached_tokens = seq.num_computed_tokens
        num_cached_blocks = seq.num_cached_tokens // self.block_manager.block_size
        seq.num_host_cached_tokens = self.block_manager.block_size * cache.count_from_host(
            seq.block_ids[:num_cached_blocks]
        )
        cache.record_query(seq.num_prompt_tokens, seq.num_cached_tokens, seq.num_host_cached_tokens)

    def _swap_in(self, plan: StepPlan) -> None:
        # Each comes back to its KV and next chunk, beside a growth block per sequence running
        # before: one that came back to less would be the first victim of its own step. The
        # chunks of those swapped in earlier stay counted until the step takes them.
        room = self.block_manager.num_free_blocks - len(self.running)
        while self.swapped and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            needed = self._resume_blocks(seq)
            if needed > room or self._waits_for_a_recompute(seq):
                return
            room -= needed
            self.swapped.pop(0)
            self.block_manager.grow(seq.block_ids, seq.num_computed_tokens)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            plan.swap_in.append((seq, list(seq.block_ids)))

    def _waits_for_a_recompute(self, swapped: Sequence) -> bool:
        """Whether a more urgent sequence preempted for recompute waits: it comes back first
        (preempted sequences resume in urgency order, however each was preempted; the head of
        the waiting queue is the most urgent of them, `_requeue_preempted`)."""
        head = self.waiting[0] if self.waiting else None
        return head is not None and head.num_preemptions > 0 and _urgency(head) < _urgency(swapped)

    def _goes_before_swapped(self, seq: Sequence) -> bool:
        """Whether a waiting sequence may be admitted beside the swapped ones: any when none is
        swapped out; else only one preempted for recompute that is more urgent than all of them
        (a new arrival waits, or arrivals could keep a swapped sequence out for good)."""
        if not self.swapped:
            return True
        return seq.num_preemptions > 0 and _urgency(seq) < _urgency(self.swapped[0])

    def _resume_blocks(self, seq: Sequence) -> int:
        """Blocks a swapped sequence holds in the step it comes back: its KV and its next chunk,
        one token when decoding, else its prompt's rest up to a step's prompt tokens (the budget,
        or the step time cap when set: a share passes the cap only in a step raised for short
        prompts, and then the swap-in is undone if the pool falls short, `_undo_swap_in`)."""
        most = self.max_num_batched_tokens
        if self.prompt_token_cap is not None:
            most = min(most, max(self.prompt_token_cap, PROGRESS_FLOOR))
        next_tokens = min(seq.num_uncomputed_tokens, most)
        return self.block_manager.num_blocks_for(seq.num_computed_tokens + next_tokens)

    def _undo_swap_in(self, seq: Sequence) -> None:
        """Sends a sequence swapped in this step back to the swapped queue, nothing copied yet:
        its host copy is still there. Preempting it instead would copy its KV in and out for
        nothing, and with its host copy still counted in the swap space (the engine takes it
        only when the step runs) could find no room to swap and drop its progress."""
        self._plan.swap_in = [(s, ids) for s, ids in self._plan.swap_in if s is not seq]
        self.running.remove(seq)
        self.block_manager.free(seq.block_ids)
        seq.block_ids.clear()
        seq.status = SequenceStatus.SWAPPED
        self.swapped.append(seq)
        self.swapped.sort(key=_urgency)

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Grows `seq`'s blocks for this step, preempting newer sequences if needed."""
        target = seq.num_computed_tokens + num_tokens
        while not self.block_manager.can_allocate(
            self.block_manager.num_new_blocks_for(seq.block_ids, target)
        ):
            if self._pinning:  # newcomers' pinned cache blocks go back first: they wait a step
                self._release_pins()
                continue
            victim = self.running[-1]
            if any(victim is swapped for swapped, _ in self._plan.swap_in):
                self._undo_swap_in(victim)
            else:
                self.preempt(victim)
            if victim is seq:
                return False
        self.block_manager.grow(seq.block_ids, target)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Frees a running sequence's blocks, swapping its KV out or dropping it for recompute;
        either way it resumes before new arrivals."""
        self.running.remove(seq)
        kv_blocks = seq.block_ids[: self.block_manager.num_blocks_for(seq.num_computed_tokens)]
        mode = self.choose_preemption(seq, len(kv_blocks))
        if mode == "swap":
            self._plan.swap_out.append((seq, list(kv_blocks)))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            self.swapped.sort(key=_urgency)
        elif self.hand_back_recomputed:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.FINISHED_ABORTED
            self.evicted.append(seq)
        else:
            seq.num_computed_tokens = 0
            seq.status = SequenceStatus.WAITING
            self._requeue_preempted(seq)
        self.block_manager.free(seq.block_ids)
        seq.block_ids.clear()
        seq.num_registered_blocks = 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.num_preemptions_by_mode[mode] += 1

    def _requeue_preempted(self, seq: Sequence) -> None:
        """Back among the preempted sequences at the head of the queue, in urgency order: a
        victim of a later step does not go ahead of a more urgent one still waiting (within a
        step the tail's victims come least urgent first, so the order was right there only)."""
        index = 0
        for waiting in self.waiting:
            if waiting.num_preemptions == 0 or _urgency(waiting) > _urgency(seq):
                break
            index += 1
        self.waiting.insert(index, seq)

    def finish(
        self, seq: Sequence, status: SequenceStatus, retain_until: float | None = None
    ) -> None:
        """Retires a sequence (running or waiting) and returns its blocks to the pool (its cached
        ones protected from eviction until `retain_until`, when given)."""
        assert status.is_finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        elif seq in self.swapped:
            self.swapped.remove(seq)
        self.block_manager.free(seq.block_ids, retain_until)
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.status = status
