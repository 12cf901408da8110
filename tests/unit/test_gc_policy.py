"""Garbage collection (`shared/gc_policy.py`): what a full collection kept is frozen, the heap
is thawed on its period, the scheduler core makes no cyclic garbage (which a frozen heap would
keep), and every collection is timed into the scheduler's metrics."""

from __future__ import annotations

import argparse
import gc

import pytest
from prometheus_client import generate_latest

from loadtest.scheduler_scale import ScaleBench, hello
from services.scheduler.core import Phase
from shared import wire
from shared.gc_policy import CollectionTimer, SurvivorFreezer, untrack_atoms
from shared.lifecycle import DecodeEvents, GatewayEvents, PrefillEvents, SchedulerEvents
from shared.logs import get_logger


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def thawed_after():
    yield
    gc.unfreeze()  # the test process's collection as it was


def test_survivors_of_a_full_collection_are_frozen_and_thawed_on_the_period(thawed_after):
    clock = Clock()
    freezer = SurvivorFreezer(thaw_every_s=60.0, clock=clock)
    frozen_at_start = gc.get_freeze_count()
    assert frozen_at_start > 0  # the start's objects
    kept = [[index] for index in range(1000)]  # tracked objects made after the start
    freezer.after_collections()
    assert freezer.num_freezes == 0  # no full collection since: nothing to freeze
    gc.collect()
    clock.now = 1.0
    freezer.after_collections()
    assert freezer.num_freezes == 1
    assert gc.get_freeze_count() >= frozen_at_start + len(kept)
    freezer.after_collections()
    assert freezer.num_freezes == 1  # once per full collection
    clock.now = 61.0
    freezer.after_collections()
    assert (freezer.num_thaws, gc.get_freeze_count()) == (1, 0)
    gc.collect()
    clock.now = 62.0
    freezer.after_collections()
    assert freezer.num_freezes == 2 and gc.get_freeze_count() > 0
    freezer.close()
    assert gc.get_freeze_count() == 0


@pytest.mark.parametrize("thaw_every_s", [0.0, -1.0, float("nan")])
def test_a_period_that_is_not_positive_is_refused(thaw_every_s):
    with pytest.raises(ValueError, match="thaw_every_s must be positive"):
        SurvivorFreezer(thaw_every_s)


def test_a_list_of_atoms_untracked_stays_a_list():
    prompt = list(range(100))
    untrack_atoms(prompt)
    untrack_atoms(prompt)  # again: no effect, as CPython's own call
    assert not gc.is_tracked(prompt)
    prompt.append(100)
    assert prompt == list(range(101)) and sum(prompt) == 5050


@pytest.mark.parametrize("indexes", ["native", "python"])
def test_the_scheduler_core_makes_no_cyclic_garbage(indexes):
    """Requests dispatched, served, refused, cancelled, requeued by a worker's loss, timed out:
    whatever the core lets go, reference counting frees (a frozen cycle would stay), with
    either set of indexes."""
    args = argparse.Namespace(
        prefill=4,
        decode=4,
        queued=300,
        tenants=20,
        rounds=200,
        seed=0,
        prefill_ms=20,
        prefix_cache=True,
        gc="default",
        indexes=indexes,
        token_ids="distinct",  # prompts of distinct ids, as real ones (hashed by the caches)
    )
    bench = ScaleBench(args)
    gc.collect()
    gc.disable()
    try:
        bench.setup()
        for index in range(args.rounds):
            bench.round(index)
        core = bench.core
        queued = [r for r in core.requests.values() if r.phase == Phase.QUEUED][:20]
        prefilling = [r for r in core.requests.values() if r.phase == Phase.PREFILLING][:5]
        assert len(queued) == 20 and len(prefilling) == 5
        for request in queued + prefilling:
            core.on_cancel(wire.Cancel(request_id=request.request_id, reason="client"), bench.now)
        core.tick(bench.now)  # the prefill windows the cancels freed take the next requests
        reserving = [r for r in core.requests.values() if r.phase == Phase.RESERVING]
        assert reserving
        for request in reserving:
            refused = wire.ReserveReply(
                request_id=request.request_id,
                peer_id=request.decode_peer_id,
                ok=False,
                num_free_blocks=0,
            )
            core.on_reserve_reply(refused, bench.now)
        core.tick(bench.now + 1e3)  # every reservation and prefill past its deadline
        rejoin = hello("decode0", "decode", prefix_cache=True)
        core.on_hello(b"decode0", rejoin, bench.now)  # a worker rejoins: its requests requeued
        core.tick(bench.now + 1e6)  # every queued request past the queue-time limit
        del bench, core, queued, reserving, prefilling
        found = gc.collect()
    finally:
        gc.enable()
    assert found == 0


def test_every_collection_is_timed_by_generation_until_closed():
    seen = []
    timer = CollectionTimer(lambda generation, seconds: seen.append((generation, seconds)))
    try:
        gc.collect()
        gc.collect(0)
    finally:
        timer.close()
    assert [generation for generation, _ in seen][-2:] == [2, 0]
    assert all(seconds >= 0 for _, seconds in seen)
    count = len(seen)
    gc.collect()
    assert len(seen) == count  # closed: no longer called
    timer.close()  # twice is harmless


@pytest.mark.parametrize(
    "events_class, service",
    [
        (SchedulerEvents, "scheduler"),
        (GatewayEvents, "gateway"),
        (PrefillEvents, "worker"),
        (DecodeEvents, "worker"),
    ],
)
def test_every_service_exports_the_pauses(events_class, service):
    events = events_class(get_logger())
    events.gc_paused(2, 0.9)
    events.gc_paused(0, 0.001)
    exposition = generate_latest(events.registry).decode()
    metric = f"tandem:{service}_gc_pause_seconds"
    assert f'{metric}_count{{generation="2"}} 1.0' in exposition
    assert f'{metric}_bucket{{generation="2",le="1.0"}} 1.0' in exposition
    assert f'{metric}_bucket{{generation="2",le="0.5"}} 0.0' in exposition
    assert f'{metric}_count{{generation="0"}} 1.0' in exposition
