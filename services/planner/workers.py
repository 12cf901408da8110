"""Simulated prefill and decode workers: the engines' step behaviour, timed by a profile.

They play what the real workers do on the wire, in simulated time, through a `Cluster` (the
simulator) that carries their messages to the scheduler core and their tokens to the records:

* A prefill worker runs steps while it holds prompts. Each step shares a token budget between
  the prompts in progress and a few new ones with the engine's own rules (`prompt_shares`: a
  floor each, the rest to the shortest; the time target's cap at the prefill rate the worker
  has measured, as the engine's, raised to finish short prompts; `lighten`). A prompt finished
  in a step has its first token at the step's end; its KV then travels to the decode target
  (the profile's transfer time, off the compute path), and on arrival the prefill reports the
  request done to the scheduler.
* A decode worker reserves blocks when asked (between its steps, as the real loop reads its
  socket: a reservation asked mid-step is answered at the step's end), admits a sequence when
  its KV arrives, and runs continuous batching: every step advances every running sequence by
  one token (step time by batch size and mean context), retires finished ones at once and admits
  waiting ones at the next step, up to `max_num_seqs`. A sequence that needs a block when none
  is free preempts the latest admitted one by swap (its blocks freed, its progress kept);
  swapped sequences come back first, before any waiting one, once their blocks and a growth
  block per running sequence are free; a waiting one (its blocks its own) does not wait for them.

With prefix caches (`caches.py`), a prefill worker computes only the prompt past the blocks it
holds and sends only the blocks past those the decode worker said it holds (`num_skip_blocks`);
a decode worker answers a reservation with the leading blocks it holds and takes only the rest
from its pool (the sequence shares the cached ones, as the real worker's does: its growth never
takes them again), and takes a prefill job itself when the scheduler sends it one (a
conversation's next turn: it holds all but a short suffix), computing the suffix in its next
step (that step lasts the suffix's prefill time longer), whose end is the first token.
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from services.planner.caches import SimCache
from services.planner.profile import WorkerProfile
from services.scheduler.cache_placement import prefill_tokens
from shared import wire
from shared.engine.pace import INITIAL_PREFILL_TOKENS_PER_S, prefill_rate, smoothed
from shared.engine.scheduler import MIN_CHUNK, prompt_shares
from shared.metrics import STEP_BUCKETS, batch_range


class Cluster(Protocol):
    """What a simulated worker needs from the simulator."""

    @property
    def now(self) -> float: ...

    def at(self, time: float, callback, *args) -> None: ...
    def to_scheduler(self, message: wire.Message) -> None: ...
    def first_token(self, request_id: str) -> None: ...
    def token_finished(self, request_id: str, num_output_tokens: int) -> None: ...
    def kv_arrived(self, decode_peer_id: str, job: wire.PrefillJob) -> None: ...
    def step_profile(self) -> WorkerProfile: ...  # what times a step starting now


@dataclass
class WorkerStats:
    busy_s: float = 0.0  # time spent in steps (a step still running at the stop: up to it)
    num_steps: int = 0
    num_step_sequences: int = 0  # decode: sequences summed over its steps
    num_preemptions: int = 0
    # Steps by duration: [i] counts those in (STEP_BUCKETS[i-1], STEP_BUCKETS[i]], the last one
    # those beyond (the real workers' engine_step_seconds histogram, not cumulated).
    step_counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_BUCKETS) + 1))
    # Decode steps by batch size range (the real workers' ranges and counters): steps, seconds,
    # sequences and the tokens of context they attended.
    by_batch: dict[str, list[float]] = field(default_factory=dict)
    step_end_s: float = 0.0  # when its latest step ends (simulated)

    def record_step(
        self,
        duration_s: float,
        num_sequences: int = 0,
        num_context_tokens: int = 0,
        start_s: float = 0.0,
    ) -> None:
        self.busy_s += duration_s
        self.step_end_s = start_s + duration_s
        self.num_steps += 1
        self.num_step_sequences += num_sequences
        self.step_counts[bisect.bisect_left(STEP_BUCKETS, duration_s)] += 1
        if num_sequences > 0:
            label = batch_range(num_sequences)
            counts = self.by_batch.get(label)
            if counts is None:
                counts = self.by_batch[label] = [0.0, 0.0, 0.0, 0.0]
            counts[0] += 1
            counts[1] += duration_s
            counts[2] += num_sequences
            counts[3] += num_context_tokens

    def stop_at(self, now: float) -> None:
        """The simulation stopped at `now`: a step still running counts only up to it (a
        worker's steps follow one another, so only its latest can), so busy time never exceeds
        the time simulated."""
        if self.step_end_s > now:
            self.busy_s -= self.step_end_s - now
            self.step_end_s = now


@dataclass
class Pace:
    """What a worker's heartbeat says of its pace, measured as the real workers measure it
    (`shared/engine/pace.py`): the core's routing and wait forecast read both."""

    step_s: float = 0.0
    prefill_tokens_per_s: float = INITIAL_PREFILL_TOKENS_PER_S

    def stepped(self, seconds: float, num_prompt_tokens: int) -> None:
        self.step_s = smoothed(self.step_s, seconds)
        self.prefill_tokens_per_s = prefill_rate(
            self.prefill_tokens_per_s, num_prompt_tokens, seconds
        )


@dataclass
class _Prompt:
    job: wire.PrefillJob
    num_tokens: int  # prompt tokens in all
    num_left: int  # prompt tokens not yet computed
    hashes: list[int] = field(default_factory=list)  # its full blocks', for the prefix cache
    started: bool = False  # a step has computed some of it


class SimPrefillWorker:
    def __init__(
        self,
        peer_id: str,
        profile: WorkerProfile,
        cluster: Cluster,
        budget: int,
        cache: SimCache | None = None,
    ):
        self.peer_id = peer_id
        self.profile = profile
        self.cluster = cluster
        self.budget = budget  # max_num_batched_tokens
        self.cache = cache
        self.prompts: dict[str, _Prompt] = {}  # in arrival order
        self.in_transfer: set[str] = set()
        # Speculative jobs: grants come before or after the prefill; KV goes once both are in,
        # but for the leading blocks the grant says the decode worker holds.
        self.granted: dict[str, int] = {}  # request id -> blocks not to send
        self.awaiting_grant: dict[str, wire.PrefillJob] = {}
        self.stepping = False
        self.stats = WorkerStats()
        self.pace = Pace()

    @property
    def token_cap(self) -> int | None:
        """The engine's cap for the time target (`LLMEngine.prompt_token_cap`): at the prefill
        rate measured so far, as the engine measures it (a fixed rate from a full step of the
        profile put a 200-token suffix, which runs faster per token than 512 fresh ones, into two
        steps where the engine takes it in one)."""
        target_s = self.profile.settings.step_time_target_s
        if target_s is None:
            return None
        return max(MIN_CHUNK, int(target_s * self.pace.prefill_tokens_per_s))

    def on_job(self, job: wire.PrefillJob) -> None:
        num_tokens = len(job.prompt_token_ids) + len(job.output_token_ids)
        prompt = _Prompt(job, num_tokens, num_tokens)
        if self.cache is not None:  # the blocks it holds are not computed again
            prompt.hashes = self.cache.prompt_hashes(prefill_tokens(job), job.cache_salt)
            prompt.num_left -= self.cache.num_cached_blocks(prompt.hashes) * self.cache.block_size
        self.prompts[job.request_id] = prompt
        self._maybe_step()

    def on_cancel(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.in_transfer.discard(request_id)
        self.granted.pop(request_id, None)
        self.awaiting_grant.pop(request_id, None)

    def on_grant(self, grant: wire.PrefillGrant) -> None:
        job = self.awaiting_grant.pop(grant.request_id, None)
        if job is not None:
            self._transfer(job, grant.num_skip_blocks)
        else:  # the prefill is still running (a cancel forgets it)
            self.granted[grant.request_id] = grant.num_skip_blocks

    def _maybe_step(self) -> None:
        if self.stepping or not self.prompts:
            return
        cap = self.token_cap
        ids = self._sharers(cap)
        needs = [self.prompts[i].num_left for i in ids]
        bulk = [self.prompts[i].job.bulk for i in ids]
        shares = prompt_shares(needs, self.budget, cap, bulk)
        # Each chunk's attention reads what of its prompt is already in the KV cache.
        pairs = sum(
            share * (self.prompts[i].num_tokens - self.prompts[i].num_left)
            for i, share in zip(ids, shares, strict=True)
        )
        duration = self.cluster.step_profile().prefill_time(sum(shares), pairs)
        self.stepping = True
        self.stats.record_step(duration, start_s=self.cluster.now)
        self.cluster.at(
            self.cluster.now + duration,
            self._end_step,
            dict(zip(ids, shares, strict=True)),
            duration,
        )

    def _sharers(self, cap: int | None) -> list[str]:
        """The prompts in progress and as many new ones as the capped budget seats (as the
        engine's step scheduler: one per MIN_CHUNK tokens, at least one)."""
        started = [i for i, p in self.prompts.items() if p.started]
        # Interactive prompts ahead of unstarted bulk ones, as the engine's queue keeps them.
        waiting = sorted(
            (i for i, p in self.prompts.items() if not p.started),
            key=lambda i: self.prompts[i].job.bulk,
        )
        budget = self.budget if cap is None else min(self.budget, cap)
        num_newcomers = max(1, budget // MIN_CHUNK - len(started))
        return started + waiting[:num_newcomers]

    def _end_step(self, shares: dict[str, int], duration: float) -> None:
        self.stepping = False
        self.pace.stepped(duration, sum(shares.values()))
        for request_id, share in shares.items():
            prompt = self.prompts.get(request_id)
            if prompt is None:  # cancelled mid-step
                continue
            prompt.num_left -= share
            prompt.started = prompt.started or share > 0
            if prompt.num_left == 0:
                del self.prompts[request_id]
                if self.cache is not None:
                    self.cache.store(prompt.hashes)
                self._finish(prompt.job)
        self._maybe_step()

    def _finish(self, job: wire.PrefillJob) -> None:
        self.cluster.first_token(job.request_id)
        if job.sampling.max_tokens <= 1:  # finished at its first token: nothing to hand on
            self.cluster.token_finished(job.request_id, 1)
            self._report(job.request_id, "length")
            return
        if job.await_grant and job.request_id not in self.granted:
            self.awaiting_grant[job.request_id] = job  # its reservation is not confirmed yet
            return
        self._transfer(job, self.granted.pop(job.request_id, job.num_skip_blocks))

    def _transfer(self, job: wire.PrefillJob, num_skip_blocks: int) -> None:
        """The KV goes to the decode worker, but for the leading blocks it said it holds."""
        self.in_transfer.add(job.request_id)
        num_tokens = len(job.prompt_token_ids) + len(job.output_token_ids)
        num_tokens -= num_skip_blocks * self.profile.settings.block_size
        arrival = self.cluster.now + self.profile.transfer_time(max(0, num_tokens))
        self.cluster.at(arrival, self._transferred, job)

    def _transferred(self, job: wire.PrefillJob) -> None:
        if job.request_id not in self.in_transfer:
            return  # cancelled while in flight
        self.in_transfer.discard(job.request_id)
        self.cluster.kv_arrived(job.decode_peer_id, job)
        self._report(job.request_id, None)

    def _report(self, request_id: str, finish_reason: str | None) -> None:
        self.cluster.to_scheduler(prefill_done(self.peer_id, request_id, finish_reason))

    def heartbeat(self) -> wire.Heartbeat:
        return wire.Heartbeat(
            peer_id=self.peer_id,
            num_waiting=len(self.prompts),
            num_running=len(self.in_transfer),
            num_free_blocks=0,
            num_total_blocks=0,
            steps_completed=self.stats.num_steps,
            sent_at=self.cluster.now,
            request_ids=[*self.prompts, *self.awaiting_grant, *self.in_transfer],
            step_s=self.pace.step_s,
            prefill_tokens_per_s=self.pace.prefill_tokens_per_s,
            **(self.cache.heartbeat_fields() if self.cache is not None else {}),
        )


def prefill_done(peer_id: str, request_id: str, finish_reason: str | None) -> wire.RequestDone:
    """A prefill's report to the scheduler: its first token made (charged to the party), or
    an error."""
    return wire.RequestDone(
        request_id=request_id,
        peer_id=peer_id,
        phase="prefill",
        finish_reason=finish_reason,
        num_prompt_tokens=0,
        num_output_tokens=0 if finish_reason == "error" else 1,
    )


@dataclass
class _LocalPrefill:
    """A prefill job a decode worker computes itself (it holds all of the prompt but this)."""

    job: wire.PrefillJob
    num_blocks: int  # its reservation's, which become its sequence's
    num_tokens: int  # to compute: the prompt past the blocks this worker holds
    num_cached: int  # the prompt's tokens in those blocks, which the suffix's attention reads
    hashes: list[int]  # the prompt's chain, named in the cache once computed
    num_cached_blocks: int  # its reservation's: its sequence's, not taken from the pool


@dataclass
class _Sequence:
    request_id: str
    num_tokens: int  # prompt + generated; the next step writes the last one's KV
    num_generated: int
    max_tokens: int
    num_blocks: int  # taken from the pool, given back when it ends or is swapped out
    num_generated_here: int = 0
    # The leading blocks its reservation found in the prefix cache: its own too, but held by the
    # cache, so never taken from the pool (as the real worker's sequence shares them).
    num_cached_blocks: int = 0
    bulk: bool = False  # a batch job's line: it sits out steps its row would slow (`_rows`)

    @property
    def num_table_blocks(self) -> int:
        """The blocks its KV fills: the cached ones and those it took."""
        return self.num_cached_blocks + self.num_blocks


@dataclass
class SimDecodeWorker:
    peer_id: str
    profile: WorkerProfile
    cluster: Cluster
    num_total_blocks: int
    num_free_blocks: int = field(init=False)
    # request id -> (blocks taken from the pool, leading blocks held in the prefix cache)
    reserved: dict[str, tuple[int, int]] = field(default_factory=dict)
    # With a cache: a reservation's prompt chain, hashed once for its KV or its prefill here.
    chains: dict[str, list[int]] = field(default_factory=dict)
    running: dict[str, _Sequence] = field(default_factory=dict)  # in admission order
    waiting: deque[_Sequence] = field(default_factory=deque)
    swapped: deque[_Sequence] = field(default_factory=deque)
    pending_reserves: list[wire.Reserve] = field(default_factory=list)  # answered at step end
    # Prefill jobs taken here, waiting for the next step; `prefilling_here` names them until
    # their step ends (a cancel takes the name).
    local_jobs: list[_LocalPrefill] = field(default_factory=list)
    prefilling_here: set[str] = field(default_factory=set)
    stepping: bool = False
    stats: WorkerStats = field(default_factory=WorkerStats)
    cache: SimCache | None = None
    pace: Pace = field(default_factory=Pace)

    def __post_init__(self) -> None:
        self.num_free_blocks = self.num_total_blocks
        self.block_size = self.profile.settings.block_size
        self.max_num_seqs = self.profile.settings.max_num_seqs

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def on_reserve(self, reserve: wire.Reserve) -> None:
        """Answers the scheduler, between steps as the real worker's loop does: a reservation
        that arrives mid-step waits for the step's end (and the blocks it frees)."""
        if self.stepping:
            self.pending_reserves.append(reserve)
        else:
            self.cluster.to_scheduler(self._reserve(reserve))

    def _reserve(self, reserve: wire.Reserve) -> wire.ReserveReply:
        """Blocks for the prompt and its first step, but for the leading ones held cached (the
        prefill worker skips sending those), with room for all of them asked, as the real
        worker does."""
        num_blocks = self.blocks_for(reserve.num_tokens)
        ok = reserve.request_id not in self.reserved and num_blocks <= self.num_free_blocks
        num_cached = 0
        if ok:
            if self.cache is not None:
                hashes = self.cache.prompt_hashes(reserve.token_ids, reserve.cache_salt)
                num_cached = self.cache.num_cached_blocks(hashes)
                self.chains[reserve.request_id] = hashes
            self.reserved[reserve.request_id] = (num_blocks - num_cached, num_cached)
            self.num_free_blocks -= num_blocks - num_cached
        return wire.ReserveReply(
            request_id=reserve.request_id,
            peer_id=self.peer_id,
            ok=ok,
            num_free_blocks=self.num_free_blocks,
            num_cached_blocks=num_cached,
            attempt=reserve.attempt,
        )

    def on_job(self, job: wire.PrefillJob) -> None:
        """A prefill job sent here (the scheduler found this worker holds all of the prompt
        but a short suffix): computed in the next step, no KV crossing the wire."""
        reservation = self.reserved.pop(job.request_id, None)
        hashes = self.chains.pop(job.request_id, [])
        if reservation is None:  # its reservation is gone: the real worker reports an error
            self._report_prefill(job.request_id, "error")
            return
        num_blocks, num_cached_blocks = reservation
        num_cached = self.cache.num_cached_blocks(hashes) * self.block_size if self.cache else 0
        num_tokens = len(prefill_tokens(job)) - num_cached
        self.local_jobs.append(
            _LocalPrefill(job, num_blocks, num_tokens, num_cached, hashes, num_cached_blocks)
        )
        self.prefilling_here.add(job.request_id)
        self._maybe_step()

    def on_kv(self, job: wire.PrefillJob) -> None:
        reservation = self.reserved.pop(job.request_id, None)
        hashes = self.chains.pop(job.request_id, [])
        if reservation is None:
            return  # the reservation was cancelled meanwhile
        num_blocks, num_cached_blocks = reservation
        if self.cache is not None:  # the prompt's blocks are here now, named in the cache
            self.cache.store(hashes)
        num_output = len(job.output_token_ids) + 1  # the first token came from the prefill
        sequence = _Sequence(
            job.request_id,
            len(job.prompt_token_ids) + num_output,
            num_output,
            job.sampling.max_tokens,
            num_blocks,
            num_cached_blocks=num_cached_blocks,
            bulk=job.bulk,
        )
        self.waiting.append(sequence)
        self._maybe_step()

    def on_cancel(self, request_id: str) -> None:
        if request_id in self.reserved:
            self.num_free_blocks += self.reserved.pop(request_id)[0]
            self.chains.pop(request_id, None)
        if request_id in self.prefilling_here:
            self.prefilling_here.discard(request_id)
            for local in [j for j in self.local_jobs if j.job.request_id == request_id]:
                self.local_jobs.remove(local)  # not in a step yet: its blocks go back now
                self.num_free_blocks += local.num_blocks
        sequence = self.running.pop(request_id, None)
        if sequence is not None:
            self.num_free_blocks += sequence.num_blocks
        for queue in (self.waiting, self.swapped):
            for sequence in [s for s in queue if s.request_id == request_id]:
                queue.remove(sequence)
                if queue is self.waiting:
                    self.num_free_blocks += sequence.num_blocks

    def _maybe_step(self) -> None:
        if self.stepping:
            return
        swap_tokens = self._admit()
        swap_tokens += self._grow()
        if not self.running and not self.local_jobs:
            return
        profile = self.cluster.step_profile()
        local, self.local_jobs = self.local_jobs, []
        prefill_s = 0.0
        if local:  # the suffixes prefilled here lengthen the step by their prefill time
            pairs = sum(j.num_tokens * j.num_cached for j in local)
            prefill_s = profile.prefill_time(sum(j.num_tokens for j in local), pairs)
        batch = self._rows(profile, bool(local), prefill_s)
        num_context_tokens = sum(s.num_tokens for s in batch)
        duration = prefill_s
        if batch:
            duration += profile.decode_time(len(batch), num_context_tokens / len(batch))
        if swap_tokens:
            duration += self.profile.transfer_time(swap_tokens)
        self.stepping = True
        self.stats.record_step(duration, len(batch), num_context_tokens, self.cluster.now)
        self.cluster.at(self.cluster.now + duration, self._end_step, local, batch, duration)

    def _rows(self, profile: WorkerProfile, prefills: bool, prefill_s: float) -> list[_Sequence]:
        """The running sequences this step decodes: all of them, but that beside interactive
        work (a row, a suffix prefilled here) the batch lines join only while the step's time
        stays within `bulk_step_slack` of its time without them, the oldest first, as the real
        engine does (`shared/engine/scheduler.py`; it predicts from its own steps, this from the
        profile)."""
        running = list(self.running.values())
        slack = self.profile.settings.bulk_step_slack
        interactive = [s for s in running if not s.bulk]
        bulk = [s for s in running if s.bulk]
        if slack is None or not bulk or not (interactive or prefills):
            return running
        context = sum(s.num_tokens for s in running) / len(running)
        alone = prefill_s
        if interactive:
            alone += profile.decode_time(len(interactive), context)
        bound = (1.0 + slack) * alone
        joined = 0
        while joined < len(bulk) and (
            prefill_s + profile.decode_time(len(interactive) + joined + 1, context) <= bound
        ):
            joined += 1
        return interactive + bulk[:joined]

    def _admit(self) -> int:
        """Swapped sequences first (returns the tokens copied back), then waiting ones, also
        while some stay swapped out: their KV is in blocks already theirs, as the real engine's
        `add_prefilled` runs them at once (held back, a swapped one that waited for their
        blocks waited for good, and they with it)."""
        num_swapped_in = 0
        while self.swapped and len(self.running) < self.max_num_seqs:
            sequence = self.swapped[0]
            need = self.blocks_for(sequence.num_tokens) + len(self.running)
            if need > self.num_free_blocks:
                break
            self.swapped.popleft()
            sequence.num_blocks = self.blocks_for(sequence.num_tokens)
            self.num_free_blocks -= sequence.num_blocks
            self.running[sequence.request_id] = sequence
            num_swapped_in += sequence.num_tokens
        while self.waiting and len(self.running) < self.max_num_seqs:
            sequence = self.waiting.popleft()
            self.running[sequence.request_id] = sequence
        return num_swapped_in

    def _grow(self) -> int:
        """Gives every running sequence the blocks its next token needs, preempting the latest
        admitted ones by swap when the pool runs dry; returns the tokens copied out."""
        num_swapped_out = 0
        for sequence in list(self.running.values()):
            if sequence.request_id not in self.running:
                continue  # preempted by an earlier one's growth
            need = self.blocks_for(sequence.num_tokens) - sequence.num_table_blocks
            while need > self.num_free_blocks and len(self.running) > 1:
                victim = self.running.pop(next(reversed(self.running)))
                self.num_free_blocks += victim.num_blocks
                # Its cached blocks go too: swapped in, it takes a block for every token.
                victim.num_blocks = victim.num_cached_blocks = 0
                self.swapped.appendleft(victim)
                self.stats.num_preemptions += 1
                num_swapped_out += victim.num_tokens
                if victim is sequence:
                    break
            if sequence.request_id in self.running and need <= self.num_free_blocks:
                self.num_free_blocks -= need
                sequence.num_blocks += need
        return num_swapped_out

    def _end_step(
        self, local: list[_LocalPrefill], batch: list[_Sequence], duration: float
    ) -> None:
        self.stepping = False
        self.pace.stepped(duration, sum(j.num_tokens for j in local))
        for sequence in batch:
            if self.running.get(sequence.request_id) is not sequence:
                continue  # cancelled during the step
            sequence.num_generated += 1
            sequence.num_generated_here += 1
            sequence.num_tokens += 1
            if sequence.num_generated >= sequence.max_tokens:
                del self.running[sequence.request_id]
                self.num_free_blocks += sequence.num_blocks
                self._report(sequence)
        for prefilled in local:
            self._prefilled_here(prefilled)
        reserves, self.pending_reserves = self.pending_reserves, []
        for reserve in reserves:
            self.cluster.to_scheduler(self._reserve(reserve))
        self._maybe_step()

    def _prefilled_here(self, prefilled: _LocalPrefill) -> None:
        """A suffix prefilled here has its first token: reported as a prefill worker would,
        and the sequence decodes here from the next step (or ends, at one token)."""
        job, num_blocks = prefilled.job, prefilled.num_blocks
        if job.request_id not in self.prefilling_here:
            self.num_free_blocks += num_blocks  # cancelled during the step
            return
        self.prefilling_here.discard(job.request_id)
        if self.cache is not None:
            self.cache.store(prefilled.hashes)
        self.cluster.first_token(job.request_id)
        num_output = len(job.output_token_ids) + 1
        if num_output >= job.sampling.max_tokens:
            self.num_free_blocks += num_blocks
            self.cluster.token_finished(job.request_id, num_output)
            self._report_prefill(job.request_id, "length")
            return
        num_tokens = len(job.prompt_token_ids) + num_output
        sequence = _Sequence(
            job.request_id,
            num_tokens,
            num_output,
            job.sampling.max_tokens,
            num_blocks,
            num_cached_blocks=prefilled.num_cached_blocks,
            bulk=job.bulk,
        )
        if len(self.running) < self.max_num_seqs:
            self.running[job.request_id] = sequence
        else:
            self.waiting.appendleft(sequence)
        self._report_prefill(job.request_id, None)

    def _report_prefill(self, request_id: str, finish_reason: str | None) -> None:
        self.cluster.to_scheduler(prefill_done(self.peer_id, request_id, finish_reason))

    def _report(self, sequence: _Sequence) -> None:
        self.cluster.token_finished(sequence.request_id, sequence.num_generated)
        done = wire.RequestDone(
            request_id=sequence.request_id,
            peer_id=self.peer_id,
            phase="decode",
            finish_reason="length",
            num_prompt_tokens=0,
            num_output_tokens=sequence.num_generated_here,
        )
        self.cluster.to_scheduler(done)

    def held_ids(self) -> list[str]:
        waiting = [s.request_id for s in self.waiting]
        swapped = [s.request_id for s in self.swapped]
        return [*self.reserved, *self.prefilling_here, *self.running, *waiting, *swapped]

    def heartbeat(self) -> wire.Heartbeat:
        return wire.Heartbeat(
            peer_id=self.peer_id,
            num_waiting=len(self.waiting),
            num_running=len(self.running),
            num_free_blocks=self.num_free_blocks,
            num_total_blocks=self.num_total_blocks,
            steps_completed=self.stats.num_steps,
            sent_at=self.cluster.now,
            num_swapped=len(self.swapped),
            num_swap_preemptions=self.stats.num_preemptions,
            request_ids=self.held_ids(),
            step_s=self.pace.step_s,
            prefill_tokens_per_s=self.pace.prefill_tokens_per_s,
            **(self.cache.heartbeat_fields() if self.cache is not None else {}),
        )
