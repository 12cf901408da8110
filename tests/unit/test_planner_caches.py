"""The simulator's prefix caches: the simulated workers' caches, what their heartbeats tell the
real core, and what a cached prefix saves (prefill compute, KV sent, the prefill worker itself)."""

from __future__ import annotations

import dataclasses
import json

import pytest

from services.planner.caches import SIM_CACHE_KEY, SimCache
from services.planner.profile import WorkerProfile
from services.planner.simulator import SimConfig, Simulator
from services.planner.workload import SimRequest, load_workload
from services.scheduler.core import SchedulerLimits
from services.scheduler.prefix_index import PrefixIndex
from tests.unit.test_planner_sim import cpu_like_profile, fixed_profile, run_busy

PROMPT = list(range(100, 164))  # 64 tokens: three full blocks before the last token's


def test_a_cache_names_blocks_as_the_scheduler_does_and_keeps_the_most_recent():
    index = PrefixIndex()
    index.register("w", SIM_CACHE_KEY, 16)
    cache = SimCache(block_size=16, capacity=4)
    hashes = cache.prompt_hashes(PROMPT, "tenant")
    assert hashes == index.prompt_hashes(PROMPT, "tenant") and len(hashes) == 3
    assert cache.prompt_hashes(PROMPT, "other") != hashes  # tenants keep their own blocks
    assert cache.num_cached_blocks(hashes) == 0
    cache.store(hashes)
    assert cache.num_cached_blocks(hashes) == 3
    other = cache.prompt_hashes(PROMPT, "other")
    cache.store(other[:2])  # 5 blocks in 4: the least recently used goes
    assert len(cache) == 4 and cache.num_cached_blocks(hashes) == 0  # its first block went
    assert cache.num_cached_blocks(other) == 2


def test_heartbeats_send_the_whole_set_then_each_change_by_its_state_now():
    index = PrefixIndex()
    index.register("w", SIM_CACHE_KEY, 16)
    cache = SimCache(block_size=16, capacity=3)
    first = cache.prompt_hashes(PROMPT, "a")
    cache.store(first)

    def beat() -> dict:
        fields = cache.heartbeat_fields()
        index.apply(
            "w",
            fields["cache_events_seq"],
            fields["cache_full"],
            fields["cache_stored"],
            fields["cache_evicted"],
        )
        return fields

    assert beat() == dict(cache_events_seq=1, cache_full=True, cache_stored=first, cache_evicted=[])
    assert index.num_cached_tokens("w", first) == 48
    second = cache.prompt_hashes(PROMPT, "b")
    cache.store(second)  # all of `first` evicted
    cache.store(first[:1])  # one of them back, which evicts second[0]
    fields = beat()
    assert fields["cache_events_seq"] == 2 and not fields["cache_full"]
    assert sorted(fields["cache_stored"]) == sorted([first[0], *second[1:]])
    assert sorted(fields["cache_evicted"]) == sorted([*first[1:], second[0]])
    assert index.num_cached_tokens("w", first) == 16
    assert index.num_cached_tokens("w", second) == 0  # its first block is gone
    assert beat()["cache_stored"] == [] and index.num_cached_tokens("w", first) == 16


def conversation(prefix_cache: bool, profile: WorkerProfile | None = None, **limits) -> Simulator:
    """A turn, then its next one (the same prompt and 16 tokens more) well after it finished."""
    requests = [
        SimRequest(0.0, len(PROMPT), 2, tenant="t", prompt_token_ids=tuple(PROMPT)),
        SimRequest(10.0, 80, 2, tenant="t", prompt_token_ids=(*PROMPT, *range(16))),
    ]
    limits = SchedulerLimits(**limits)
    config = SimConfig(1, 1, limits, prefix_cache=prefix_cache)
    sim = Simulator(profile or fixed_profile(), config)
    sim.run(requests)
    return sim


def test_a_next_turn_skips_the_blocks_both_workers_hold_by_hand():
    """Fixed times (a prefill step 0.5 s whatever its tokens, a decode step 0.375 s, a transfer
    0.125 s + tokens / 1,024 per s). Turn one: prefill 0-0.5, KV (64 tokens) 0.5-0.6875, a
    decode step to 1.0625. Turn two at 10 s, no local prefill allowed: the prefill worker holds
    3 of its blocks and computes the rest (0.5 s all the same); the decode worker holds them too
    and reserves, so only 32 tokens' KV travel: 10.5-10.65625, and its step ends 11.03125
    (without caches all 80 travel: 10.703125, and 11.078125)."""
    cached = conversation(True, local_prefill_max_tokens=0)
    a, b = cached.records.values()
    assert (a.first_token_time, a.finish_time) == (0.5, 1.0625)
    assert (b.first_token_time, b.finish_time) == (10.5, 11.03125)
    assert cached.core.num_predicted_cached_tokens == 48
    uncached = conversation(False, local_prefill_max_tokens=0)
    assert [r.finish_time for r in uncached.records.values()] == [1.0625, 11.078125]


def test_a_next_turn_is_prefilled_on_the_decode_worker_holding_its_prefix_by_hand():
    """With local prefill (the default limit, 256 tokens), turn two's 32-token suffix is computed
    by the decode worker that holds the rest: one step of 0.5 s (the suffix's prefill) ends at
    its first token, the next decode step at 10.875; the prefill worker sees one prompt only."""
    sim = conversation(True)
    a, b = sim.records.values()
    assert (b.first_token_time, b.finish_time, b.completion_tokens) == (10.5, 10.875, 2)
    assert sim.prefills["prefill0"].stats.num_steps == 1
    assert sim.decodes["decode0"].stats.num_steps == 3  # a's, b's suffix, b's second token


def test_a_suffix_pays_for_reading_its_cached_prefix_on_either_worker():
    """At 1/1024 s a (token computed, token of context) pair, turn two's 32 tokens computed
    after its 48 cached ones take 1.5 s longer, on the prefill worker (first token 12.0 instead
    of 10.5) as on the decode worker that prefills it itself (and its next step ends 0.375 s
    later)."""
    profile = dataclasses.replace(fixed_profile(), prefill_s_per_context_pair=1 / 1024)
    remote = conversation(True, profile, local_prefill_max_tokens=0)
    assert [r.first_token_time for r in remote.records.values()] == [0.5, 12.0]
    local = conversation(True, profile)
    assert local.prefills["prefill0"].stats.num_steps == 1  # the decode worker's, as before
    turn_two = list(local.records.values())[1]
    assert (turn_two.first_token_time, turn_two.finish_time) == (12.0, 12.375)


def test_a_cached_prefix_is_not_computed_again():
    """The prefill worker's time is the uncached part's (cpu-like: time grows with tokens; one
    step per prompt, no time target splitting it)."""
    profile = cpu_like_profile(step_time_target_s=None)
    shared = SimRequest(0.0, 128, 2, tenant="t", num_shared_tokens=128)
    later = SimRequest(20.0, 300, 2, tenant="t", num_shared_tokens=128)
    limits = SchedulerLimits(local_prefill_max_tokens=0)
    sim = Simulator(profile, SimConfig(1, 1, limits, prefix_cache=True))
    result = sim.run([shared, later])
    computed = profile.prefill_time(128) + profile.prefill_time(300 - 112)  # 7 blocks cached
    assert result.prefill_stats["prefill0"].busy_s == pytest.approx(computed)
    assert all(r.error is None for r in result.records)


def test_caches_keep_the_simulation_deterministic_and_conserving():
    first = run_busy(3, prefix_cache=True)
    assert first.records == run_busy(3, prefix_cache=True).records
    assert all(r.num_ends == 1 for r in first.records), "every request ends exactly once"
    assert any(r.error for r in first.records) and first.num_preemptions > 0
    for stats in [*first.prefill_stats.values(), *first.decode_stats.values()]:
        assert 0 < stats.busy_s <= first.wall_s


def test_shared_prefixes_and_token_ids_in_workloads(tmp_path):
    generated = load_workload("poisson:rate=2,n=4,prompt=8-64,output=4-4,prefix=16,tenants=2")
    prompts = [r.prompt(i) for i, r in enumerate(generated)]
    assert all(p[:16] == [0] * 16 and len(set(p[16:])) <= 1 for p in prompts)
    assert len({tuple(p[16:]) for p in prompts if len(p) > 16}) == sum(len(p) > 16 for p in prompts)
    path = tmp_path / "w.jsonl"
    path.write_text(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 2}))
    (request,) = load_workload(str(path))
    assert request.prompt(0) == [5, 6, 7]
    with pytest.raises(ValueError, match="prefix"):
        load_workload("poisson:prefix=-1")


class Recorder:
    """Just the simulator's clock and event list, to watch one prefill worker alone."""

    now = 0.0

    def __init__(self, profile):
        self.profile = profile
        self.events: list[tuple[float, object, tuple]] = []

    def at(self, time: float, callback, *args) -> None:
        self.events.append((time, callback, args))

    def run_next(self) -> None:
        self.events.sort(key=lambda e: e[0])
        time, callback, args = self.events.pop(0)
        self.now = time
        callback(*args)

    def step_profile(self):
        return self.profile

    def first_token(self, request_id: str) -> None: ...
    def to_scheduler(self, message) -> None: ...
    def kv_arrived(self, decode_peer_id: str, job) -> None: ...
    def token_finished(self, request_id: str, num_output_tokens: int) -> None: ...


@pytest.mark.parametrize("grant_first", [True, False])
def test_a_speculative_prefill_sends_only_what_its_grant_says_is_missing(grant_first):
    """The grant (after the reservation's answer) names the blocks the decode worker holds; the
    KV then sent is the rest, whether the grant comes before the prefill ends or after."""
    from services.planner.workers import SimPrefillWorker
    from shared import wire

    cluster = Recorder(fixed_profile())
    worker = SimPrefillWorker("p", cluster.profile, cluster, budget=512)
    job = wire.PrefillJob(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingSpec(max_tokens=4),
        gateway_address="g",
        decode_peer_id="d",
        decode_address="d",
        await_grant=True,
    )
    grant = wire.PrefillGrant(request_id="r", num_skip_blocks=2)
    worker.on_job(job)
    if grant_first:
        worker.on_grant(grant)
    cluster.run_next()  # the prefill step ends at 0.5
    if not grant_first:
        worker.on_grant(grant)
    (transfer,) = cluster.events
    assert transfer[0] == 0.5 + 0.125 + (64 - 32) / 1024


@pytest.mark.parametrize("prefilled_here", [False, True])
def test_a_decode_worker_takes_a_cached_prefix_from_its_pool_once(prefilled_here):
    """A next turn whose 3 leading blocks the decode worker holds cached: its reservation takes
    the other 2 of the 5 it needs (64 prompt tokens and the first step's) and answers with the
    free count that leaves. Its KV arrived, or its suffix prefilled here, the sequence holds all
    5 but took only those 2 from the pool (the cached ones are shared, as the real worker's),
    so the count after its first step is the one the reservation predicted; its 81st token
    takes one block more, and its end gives back what it took."""
    from services.planner.workers import SimDecodeWorker
    from shared import wire

    cluster = Recorder(fixed_profile())
    cache = SimCache(block_size=16, capacity=100)
    worker = SimDecodeWorker("d", cluster.profile, cluster, 100, cache=cache)
    cache.store(cache.prompt_hashes(PROMPT, "t"))  # an earlier turn's
    reserve = wire.Reserve(
        request_id="r", num_tokens=65, lease_s=10.0, token_ids=PROMPT, cache_salt="t"
    )
    reply = worker._reserve(reserve)
    assert (reply.ok, reply.num_cached_blocks, reply.num_free_blocks) == (True, 3, 98)
    job = wire.PrefillJob(
        request_id="r",
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingSpec(max_tokens=20),
        gateway_address="g",
        decode_peer_id="d",
        decode_address="d",
        cache_salt="t",
    )
    if prefilled_here:
        worker.on_job(job)
        cluster.run_next()  # the suffix's step: the first token, and the sequence runs
    else:
        worker.on_kv(job)
    (sequence,) = worker.running.values()
    assert sequence.num_tokens == 65 and worker.stepping
    assert worker.num_free_blocks == reply.num_free_blocks
    cluster.run_next()  # its first decode step
    assert worker.num_free_blocks == reply.num_free_blocks
    while sequence.num_tokens < 81:
        cluster.run_next()
    assert worker.num_free_blocks == reply.num_free_blocks - 1  # the step writing token 81's
    while worker.running:
        cluster.run_next()
    assert worker.num_free_blocks == 100
