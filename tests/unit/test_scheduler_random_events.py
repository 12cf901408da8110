"""The scheduler's core under random orders of events, failures included: late, duplicate and
stale reports, refusals, timeouts, workers that die, say GOODBYE or HELLO again mid-request,
and gateway cancels. After every event the core's books must agree with each other (no request
held by a worker the core forgot, no queue count drifting), and a worker sent a reservation or
a job must have been told to let it go once the core gave the request up there. At the end,
with every worker gone and the clock run past every limit, every request must have ended,
exactly once at its gateway unless its gateway called it off, and no request may ever have
been prefilled twice."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from shared import wire
from shared.engine.prefix_cache import CacheKey, worker_cache_key

PREFILL = ("p1", "p2")
DECODE = ("d1", "d2")
CACHE_KEY = worker_cache_key(CacheKey("m", "float32", 16), shared_between_tenants=False)


def hello(peer_id: str, role: str, caching: bool) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=peer_id,
        model="m",
        address=None if role == "prefill" else f"ipc://{peer_id}",
        num_kv_blocks=0 if role == "gateway" else 64,
        block_size=0 if role == "gateway" else 16,
        max_num_seqs=0 if role == "gateway" else 4,
        cache_key=CACHE_KEY if caching and role != "gateway" else None,
    )


class Cluster:
    """Drives a core with random events and keeps what it sent, for the checks."""

    def __init__(self, seed: int, caching: bool) -> None:
        self.rng = random.Random(seed)
        self.caching = caching  # a prefix cache: reservations answered with cached blocks
        # (some prompts then prefilled by their decode worker itself)
        self.core = ClusterScheduler(
            SchedulerLimits(
                max_queued_requests=16,
                max_queued_tokens=4000,
                heartbeat_timeout_s=10.0,
                reserve_timeout_s=5.0,
                prefill_timeout_s=60.0,
                max_queue_time_s=120.0,
                prefill_window_tokens=512,
                local_prefill_max_tokens=64,
            )
        )
        self.now = 0.0
        self.num_submits = 0
        self.num_identities = 0
        self.alive: dict[str, bool] = {}
        self.identities: dict[str, bytes] = {}
        self.reserves: list[tuple[wire.Reserve, str]] = []  # (message, decode peer id)
        self.jobs: list[tuple[wire.PrefillJob, str]] = []  # (message, prefill peer id)
        self.accepted: set[str] = set()
        self.cancelled: set[str] = set()
        self.ends: Counter[str] = Counter()  # the scheduler's word to a gateway: it ended
        self.num_jobs: Counter[str] = Counter()
        # (worker identity, request id): sent a RESERVE or a job, not yet a CANCEL, nor ended
        # there by the worker's own word.
        self.held: set[tuple[bytes, str]] = set()
        self.take(self.core.on_hello(b"G", hello("g", "gateway", caching), self.now))
        for peer_id in PREFILL:
            self.join(peer_id, "prefill")
        for peer_id in DECODE:
            self.join(peer_id, "decode")

    # -- what the core sends --------------------------------------------------------------------

    def take(self, outgoing) -> None:
        peers = {identity: peer for peer, identity in self.identities.items()}
        for item in outgoing:
            message = item.message
            if isinstance(message, (wire.Reserve, wire.PrefillJob)):
                self.held.add((item.identity, message.request_id))
            elif isinstance(message, wire.Cancel):
                self.held.discard((item.identity, message.request_id))
            if isinstance(message, wire.Reserve):
                self.reserves.append((message, peers[item.identity]))
            elif isinstance(message, wire.PrefillJob):
                self.jobs.append((message, peers[item.identity]))
                self.num_jobs[message.request_id] += 1
            elif isinstance(message, wire.SubmitReply) and message.accepted:
                self.accepted.add(message.request_id)
            elif isinstance(message, wire.Tokens):
                for delta in message.deltas:
                    if delta.finish_reason is not None:
                        self.ends[delta.request_id] += 1
            elif isinstance(message, wire.StreamEnded):
                self.ends[message.request_id] += 1

    # -- events ---------------------------------------------------------------------------------

    def join(self, peer_id: str, role: str) -> None:
        self.num_identities += 1
        identity = f"{peer_id}#{self.num_identities}".encode()
        self.identities[peer_id] = identity
        self.alive[peer_id] = True
        self.take(self.core.on_hello(identity, hello(peer_id, role, self.caching), self.now))

    def submit(self) -> None:
        self.num_submits += 1
        request = wire.Submit(
            request_id=f"r{self.num_submits}",
            prompt_token_ids=[7] * self.rng.choice((10, 40, 200, 300)),
            sampling=wire.SamplingSpec(max_tokens=8),
            tenant=self.rng.choice(("a", "b")),
            priority=0,
            gateway_peer_id="g",
            arrival_time=0.0,
            bulk=self.rng.random() < 0.2,
            first_token_deadline_s=self.rng.choice((None, 2.0, 30.0)),
        )
        self.take(self.core.on_submit(b"G", request, self.now))

    def reserve_reply(self) -> None:
        if not self.reserves:
            return
        reserve, peer_id = self.recent(self.reserves)
        reply = wire.ReserveReply(
            request_id=reserve.request_id,
            peer_id=peer_id,
            ok=self.rng.random() < 0.8,
            num_free_blocks=self.rng.randint(0, 64),
            attempt=self.rng.choice((reserve.attempt, reserve.attempt, 0)),
            num_cached_blocks=self.rng.choice((0, len(reserve.token_ids) // 16)),
        )
        if not reply.ok:
            self.held.discard((self.identities[peer_id], reply.request_id))
        self.take(self.core.on_reserve_reply(reply, self.now))

    def prefill_done(self) -> None:
        if not self.jobs:
            return
        job, peer_id = self.recent(self.jobs)
        reason = self.rng.choice((None, None, None, "error", "stop", "rejected"))
        done = wire.RequestDone(
            request_id=job.request_id,
            peer_id=peer_id,
            phase="prefill",
            finish_reason=reason,
            num_prompt_tokens=len(job.prompt_token_ids),
            num_output_tokens=1,
            output_length=None if reason in (None, "error") else 1,
        )
        if not (reason is None and peer_id in DECODE):  # (a local prefill goes on to decode)
            self.held.discard((self.identities[peer_id], job.request_id))
        self.take(self.core.on_request_done(done, self.now))

    def decode_done(self) -> None:
        if not self.jobs:
            return
        job, _ = self.recent(self.jobs)
        reason = self.rng.choice(("length", "stop", "preempted"))
        done = wire.RequestDone(
            request_id=job.request_id,
            peer_id=job.decode_peer_id,
            phase="decode",
            finish_reason=reason,
            num_prompt_tokens=len(job.prompt_token_ids),
            num_output_tokens=3,
            output_length=None if reason == "preempted" else 4,
        )
        self.held.discard((self.identities[job.decode_peer_id], job.request_id))
        self.take(self.core.on_request_done(done, self.now))

    def heartbeat(self, peer_id: str) -> None:
        worker = self.core.registry.get(peer_id)
        held = sorted(worker.request_ids) if worker is not None else []
        if self.rng.random() < 0.3:
            held = [r for r in held if self.rng.random() < 0.5]
        beat = wire.Heartbeat(
            peer_id=peer_id,
            num_waiting=0,
            num_running=self.rng.choice((0, 1)),
            num_free_blocks=self.rng.randint(0, 64),
            num_total_blocks=64,
            steps_completed=int(self.now * 10),
            sent_at=0.0,
            request_ids=held,
        )
        self.take(self.core.on_heartbeat(self.identities[peer_id], beat, self.now))

    def cancel(self) -> None:
        if not self.accepted:
            return
        request_id = self.rng.choice(sorted(self.accepted))
        self.cancelled.add(request_id)
        message = wire.Cancel(request_id=request_id, reason="client disconnected")
        self.take(self.core.on_cancel(message, self.now))

    def tick(self) -> None:
        self.now += self.rng.choice((0.2, 0.5, 1.0, 3.0, 6.0))
        for peer_id, alive in self.alive.items():
            if alive and self.rng.random() < 0.8:
                self.heartbeat(peer_id)
        self.take(self.core.tick(self.now))

    def trouble(self) -> None:
        peer_id = self.rng.choice(PREFILL + DECODE)
        role = "prefill" if peer_id in PREFILL else "decode"
        how = self.rng.choice(("die", "goodbye", "hello", "revive"))
        if how == "die":
            self.alive[peer_id] = False
        elif how == "goodbye":
            goodbye = wire.Goodbye(peer_id=peer_id)
            self.take(self.core.on_goodbye(self.identities[peer_id], goodbye, self.now))
            self.alive[peer_id] = False
        else:
            self.join(peer_id, role)

    def recent(self, items: list):
        """Mostly the latest, at times an older one (a late or duplicate report)."""
        if self.rng.random() < 0.7:
            return items[-self.rng.randint(1, min(3, len(items)))]
        return self.rng.choice(items)

    def step(self) -> None:
        events = (
            (self.submit, 4),
            (self.reserve_reply, 4),
            (self.prefill_done, 3),
            (self.decode_done, 2),
            (self.cancel, 1),
            (self.tick, 4),
            (self.trouble, 1),
        )
        event = self.rng.choices([e for e, _ in events], [w for _, w in events])[0]
        event()

    def end_everything(self) -> None:
        """Every worker gone, the clock past every limit: nothing may stay in flight."""
        for peer_id in self.alive:
            self.alive[peer_id] = False
        for _ in range(4):
            self.now += 200.0
            self.take(self.core.tick(self.now))


def check_books(core: ClusterScheduler) -> None:
    """The core's records of a request agree with each other and with its workers'."""
    queued = {r for r, request in core.requests.items() if request.phase == Phase.QUEUED}
    assert len(core.queue) == len(queued)
    assert core.num_queued_tokens == sum(core.requests[r].num_prefill_tokens for r in queued)
    for request_id, request in core.requests.items():
        if request.phase == Phase.QUEUED:
            assert request.decode_peer_id is None and request.prefill_peer_id is None
            continue
        assert request.decode_peer_id is not None, request_id
        for peer_id in (request.decode_peer_id, request.prefill_peer_id):
            if peer_id is not None:
                worker = core.registry.get(peer_id)
                assert worker is not None, (request_id, peer_id)
                assert request_id in worker.request_ids, (request_id, peer_id)
    for worker in core.registry.workers.values():
        for request_id in worker.request_ids:
            request = core.requests.get(request_id)
            assert request is not None, (worker.peer_id, request_id)
            assert worker.peer_id in (request.decode_peer_id, request.prefill_peer_id)
        if worker.role == "prefill":
            held = [
                core.requests[r].num_prefill_tokens
                for r in worker.request_ids
                if core.requests[r].prefill_peer_id == worker.peer_id
            ]
            assert core.registry.held_tokens(worker) == sum(held), worker.peer_id
    assert core.placement.num_chains_kept <= len(core.requests)  # prompt hashes kept
    for request_id in core.awaiting_first_token:
        request = core.requests[request_id]
        assert request.phase in (Phase.RESERVING, Phase.PREFILLING), request_id


def check_workers_told(cluster: Cluster) -> None:
    """What a registered worker holds (as told) the core attributes to it, or has given up on
    (a heartbeat listing it is answered with a cancel)."""
    core = cluster.core
    by_identity = {w.identity: w for w in core.registry.workers.values()}
    for identity, request_id in cluster.held:
        worker = by_identity.get(identity)
        if worker is None or request_id in core.abandoned:
            continue  # gone (its state with it), or told again when it lists the request
        request = core.requests.get(request_id)
        assert request is not None, (worker.peer_id, request_id)
        assert worker.peer_id in (request.decode_peer_id, request.prefill_peer_id)


@pytest.mark.parametrize("caching", [False, True])
@pytest.mark.parametrize("seed", range(20))
def test_random_events_leave_the_books_straight_and_every_request_ended_once(seed, caching):
    cluster = Cluster(seed, caching)
    for _ in range(400):
        cluster.step()
        check_books(cluster.core)
        check_workers_told(cluster)
        assert max(cluster.num_jobs.values(), default=0) <= 1, "a prompt prefilled twice"
        assert max(cluster.ends.values(), default=0) <= 1, "a request ended twice"
    cluster.end_everything()
    core = cluster.core
    check_books(core)
    assert not core.requests and not len(core.queue) and core.num_queued_tokens == 0
    assert not len(core.awaiting_first_token) and core.awaiting_first_token.num_tokens == 0
    for request_id in cluster.accepted - cluster.cancelled:
        assert cluster.ends[request_id] == 1, request_id
