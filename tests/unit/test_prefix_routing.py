"""The cluster's view of prefix caches as pure pieces: the workers' numbered event batches, the
scheduler's index (gaps, resync, key check), the routing policy, and the core choosing the prefill
worker that holds a prompt's prefix."""

from __future__ import annotations

import dataclasses
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.cache_placement import CachePlacement
from services.scheduler.cache_routing import (
    PrefillCandidate,
    RoutingWeights,
    choose_prefill,
    decode_affinity,
    local_prefill_wait_s,
    predicted_wait_s,
    routing_rate,
)
from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from services.scheduler.prefix_index import PrefixIndex
from services.worker import cache_events
from services.worker.cache_events import CacheEventStream
from shared import wire
from shared.engine.block_manager import BlockManager
from shared.engine.prefix_cache import (
    CacheKey,
    PrefixCache,
    chain_hashes,
    root_hash,
    worker_cache_key,
)
from tests.unit.test_scheduler_core import heartbeat, hello, sent, submit

KEY = CacheKey("m", "float32", 16)
OWN = worker_cache_key(KEY, shared_between_tenants=False)


def test_event_batches_are_numbered_net_and_full_every_few():
    cache = PrefixCache()
    bm = BlockManager(8, 16, cache)
    stream = CacheEventStream(cache, full_every=3)
    a, b, c = bm.allocate(3)
    cache.insert(1, a)
    first = stream.next_batch()
    assert (first.seq, first.full, first.stored) == (1, True, [1])
    cache.insert(2, b)
    cache.insert(3, c)
    bm.free([b, c])
    bm.allocate(7)  # evicts both unreferenced blocks: 2 then 3
    second = stream.next_batch()
    assert (second.seq, second.full, second.stored, second.evicted) == (2, False, [], [2, 3])
    assert stream.next_batch().seq == 3
    fourth = stream.next_batch()
    assert fourth.full and fourth.stored == [1]
    assert not stream.next_batch().full
    stream.resync()  # the worker registered again: the scheduler waits for a full set
    assert stream.next_batch().full  # (the sixth: not one of every third)
    with pytest.raises(ValueError, match="full_every"):
        CacheEventStream(cache, full_every=0)


def test_a_set_larger_than_a_heartbeat_carries_goes_as_its_newest_hashes(monkeypatch):
    """Past the wire's bound on a list (2**20 hashes: a big host tier) the heartbeat was
    dropped as malformed, with the load it reported, every time: the index never had the
    worker. Now the newest hashes go, and changes past the bound go as a (bounded) full set."""
    monkeypatch.setattr(cache_events, "MAX_HASHES", 2)
    cache = PrefixCache()
    bm = BlockManager(8, 16, cache)
    stream = CacheEventStream(cache, full_every=100)
    for block_hash, block_id in zip((1, 2, 3), bm.allocate(3), strict=True):
        cache.insert(block_hash, block_id)
    first = stream.next_batch()
    assert first.full and first.stored == [2, 3]
    cache.insert(4, bm.allocate(1)[0])
    assert stream.next_batch().stored == [4]  # a change within the bound
    for block_hash, block_id in zip((5, 6, 7), bm.allocate(3), strict=True):
        cache.insert(block_hash, block_id)
    third = stream.next_batch()
    assert third.full and third.stored == [6, 7]
    # A set at the real bound crosses the wire (its header too).
    beat = dataclasses.replace(heartbeat("w"), cache_events_seq=3, cache_full=True,
                               cache_stored=list(range(wire.MAX_TOKEN_IDS)))  # fmt: skip
    assert len(wire.decode(wire.encode(beat)).cache_stored) == wire.MAX_TOKEN_IDS


def test_index_applies_batches_in_order_and_forgets_a_worker_after_a_gap():
    index = PrefixIndex()
    index.register("p", OWN, 16)
    assert index.apply("p", 1, False, [7], [])  # before any full set: ignored
    assert index.num_hashes("p") == 0
    assert index.apply("p", 2, True, [1, 2], [])
    assert index.apply("p", 3, False, [3], [1])
    assert index.num_hashes("p") == 2
    assert not index.apply("p", 5, False, [4], [])  # batch 4 was lost
    assert index.num_hashes("p") == 0 and index.num_gaps == 1
    assert index.apply("p", 6, False, [5], [])  # still waiting for a full set
    assert index.num_hashes("p") == 0
    index.apply("p", 7, True, [2, 3], [])
    assert index.num_hashes("p") == 2
    index.register("p", OWN, 16)  # registered again (restart): unknown until its next full set
    assert index.num_hashes("p") == 0


def test_index_hashes_prompts_as_the_workers_do_and_counts_leading_blocks():
    index = PrefixIndex()
    index.register("p", OWN, 16)
    prompt = list(range(100, 150))  # 50 tokens: 3 full blocks, none holding the last token
    worker_hashes = list(chain_hashes(root_hash(KEY, "t"), prompt, 16))
    assert index.prompt_hashes(prompt, "t") == worker_hashes
    assert index.prompt_hashes(prompt[:48], "t") == worker_hashes[:2]  # last block computed
    index.apply("p", 1, True, [worker_hashes[0], worker_hashes[2]], [])
    assert index.num_cached_tokens("p", worker_hashes) == 16  # the second block is missing
    assert index.num_cached_tokens("p", index.prompt_hashes(prompt, "other")) == 0
    shared = PrefixIndex()
    shared.register("p", worker_cache_key(KEY, shared_between_tenants=True), 16)
    assert shared.prompt_hashes(prompt, "t") == list(chain_hashes(root_hash(KEY), prompt, 16))


def test_a_worker_with_another_cache_key_is_refused_loudly():
    index = PrefixIndex()
    assert index.refusal(OWN) is None
    index.register("p", OWN, 16)
    other = worker_cache_key(CacheKey("m", "bfloat16", 16), False)
    assert "bfloat16" in index.refusal(other) and "must agree" in index.refusal(other)
    assert index.refusal(None) is None  # a worker without a cache joins, and is never a hit
    # Once no worker keeps the old key, a rollout's new one is the cluster's (it was refused
    # until the scheduler restarted).
    index.register("q", OWN, 16)
    index.remove("p")
    assert index.refusal(other) is not None  # q still keeps the old one
    index.remove("q")
    assert index.refusal(other) is None
    index.register("p2", other, 16)
    assert index.cache_key == other and index.refusal(OWN) is not None


def test_a_worker_registering_again_with_another_key_is_refused_only_for_the_others():
    """The one worker keeping a cache, restarted with another key (dtype, tenant sharing)
    before the scheduler saw it go, was refused for the key of its own old registration,
    which its HELLO replaces: its start failed until the old one timed out."""
    index = PrefixIndex()
    index.register("p", OWN, 16)
    other = worker_cache_key(KEY, shared_between_tenants=True)
    assert index.refusal(other, "p") is None
    assert index.refusal(other, "q") is not None
    index.register("p", other, 16)
    assert index.cache_key == other
    index.register("q", other, 16)
    assert index.refusal(OWN, "p") is not None  # q keeps the cluster's key


def test_local_prefill_off_means_never():
    """0 meant "never", except for a prompt whose every block the decode worker pinned: its
    uncached part counted 0 tokens, and 0 > 0 is false."""
    placement = CachePlacement(RoutingWeights(), 0)
    request = submit("r", prompt_len=32)
    decode = ClusterScheduler(SchedulerLimits())
    decode.on_hello(b"D", dataclasses.replace(hello("d", "decode"), cache_key=OWN), 0.0)
    decode.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    d, p = decode.registry.get("d"), decode.registry.get("p")
    assert not placement.prefills_locally(request, 2, d, p, 0)
    assert CachePlacement(RoutingWeights(), 256).prefills_locally(request, 2, d, p, 0)


def candidate(peer: str, queued: int, cached: int, rate: float = 100.0, room: int = 0):
    return PrefillCandidate(peer, queued, cached, rate, room)


def test_affinity_wins_a_short_queue_and_loses_to_a_far_shorter_wait():
    holder = candidate("holder", queued=100, cached=600)
    idle = candidate("idle", queued=0, cached=0)
    assert choose_prefill([holder, idle], 700).peer_id == "holder"  # 2 s against 7 s
    busy_holder = candidate("holder", queued=2000, cached=600)
    assert choose_prefill([busy_holder, idle], 700).peer_id == "idle"  # 21 s against 7 s
    # Weights tilt it: ignoring the queue, the holder always wins.
    affinity = RoutingWeights(queued=0.0, uncached=1.0)
    assert choose_prefill([busy_holder, idle], 700, affinity).peer_id == "holder"
    # An unmeasured rate is the default, and ties go to the roomier window.
    tied = [candidate("a", 0, 0, rate=0.0, room=1), candidate("b", 0, 0, rate=0.0, room=5)]
    assert choose_prefill(tied, 10).peer_id == "b"


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 2000), st.floats(1.0, 1000.0)),
        min_size=1,
        max_size=6,
    ),
    st.integers(1, 3000),
)
def test_the_choice_has_the_least_predicted_wait(workers, num_prompt_tokens):
    candidates = [candidate(f"w{i}", q, c, r) for i, (q, c, r) in enumerate(workers)]
    chosen = choose_prefill(candidates, num_prompt_tokens)
    best = min(predicted_wait_s(c, num_prompt_tokens, RoutingWeights()) for c in candidates)
    assert predicted_wait_s(chosen, num_prompt_tokens, RoutingWeights()) == best


@pytest.mark.parametrize("queued,uncached", [(-1.0, 1.0), (1.0, -0.5), (0.0, 0.0)])
def test_bad_weights_refused(queued, uncached):
    with pytest.raises(ValueError, match="routing weights"):
        RoutingWeights(queued, uncached)
    with pytest.raises(ValueError, match="no prefill candidate"):
        choose_prefill([], 10)


def test_core_sends_a_prompt_to_the_prefill_worker_holding_its_prefix():
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    for peer in ("p1", "p2"):
        core.on_hello(b"P" + peer.encode(), dataclasses.replace(
            hello(peer, "prefill"), cache_key=OWN), 0.0)  # fmt: skip
    core.on_hello(b"D", hello("d", "decode", blocks=1000), 0.0)
    request = submit("r", prompt_len=80)
    hashes = list(chain_hashes(root_hash(KEY, "t"), request.prompt_token_ids, 16))[:4]
    for peer in ("p1", "p2"):
        stored = hashes if peer == "p2" else []
        beat = dataclasses.replace(
            heartbeat(peer), cache_events_seq=1, cache_full=True, cache_stored=stored
        )
        core.on_heartbeat(b"P" + peer.encode(), beat, 0.0)
    core.on_heartbeat(b"D", heartbeat("d", free=1000), 0.0)
    assert core.prefix_index.num_cached_tokens("p2", hashes) == 64
    core.on_submit(b"G", request, 0.0)
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=900), 0.0
    )
    (job,) = sent(out, wire.PrefillJob)
    assert job.identity == b"Pp2" and job.message.cache_salt == "t"
    # The worker found less than the index predicted (it evicted a block meanwhile): visible.
    done = wire.RequestDone(
        request_id="r",
        peer_id="p2",
        phase="prefill",
        finish_reason=None,
        num_prompt_tokens=80,
        num_output_tokens=1,
        num_cached_tokens=48,
    )
    core.on_request_done(done, 0.0)
    status = core.cluster_status(0.0)
    assert (status.num_predicted_cached_tokens, status.num_actual_cached_tokens) == (64, 48)


def test_a_prompt_token_outside_int64_is_placed_not_a_crash():
    """No worker holds such a block, so the prompt's chain ends before it and the request is
    placed on what precedes it (the prefill worker's engine then refuses it with a clear
    error). It used to raise out of the core's dispatch, which ends the scheduler's loop. The
    wire carries token ids as int32s now, so only an in-process caller (the simulator) can hand
    the core one; a sender's is refused when it is encoded."""
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    core.on_hello(b"D", dataclasses.replace(hello("d", "decode", blocks=1000), cache_key=OWN), 0.0)
    request = submit("r", prompt_len=80)
    tokens = [*request.prompt_token_ids[:40], 2**64 - 1, *request.prompt_token_ids[41:]]
    spoiled = dataclasses.replace(request, prompt_token_ids=tokens)
    with pytest.raises(wire.WireError, match="token ids must be ints within int32"):
        wire.encode(spoiled)
    assert core.placement.prompt_hashes(spoiled) == core.placement.prompt_hashes(request)[:2]
    (reply,) = sent(core.on_submit(b"G", spoiled, 0.0), wire.SubmitReply)
    assert reply.message.accepted
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=900), 0.0
    )
    (job,) = sent(out, wire.PrefillJob)
    assert job.message.prompt_token_ids == tokens


def test_a_conversation_returns_to_its_decode_worker_unless_it_is_far_busier():
    holder = decode_affinity(num_cached_tokens=900, num_tokens=1000, num_requests=4, max_num_seqs=8)
    idle = decode_affinity(num_cached_tokens=0, num_tokens=1000, num_requests=0, max_num_seqs=8)
    assert holder > idle  # 0.9 - 0.5 against 0
    full_holder = decode_affinity(900, 1000, num_requests=8, max_num_seqs=8)
    assert full_holder < idle
    # A prefix both hold (a shared system prompt) tilts nothing: the less busy one wins.
    assert decode_affinity(300, 1000, 1, 8) > decode_affinity(300, 1000, 2, 8)


@pytest.mark.parametrize("cached_blocks,local", [(4, True), (1, False), (0, False)])
@pytest.mark.parametrize("prompt_logprobs", [None, 0])
def test_a_decode_worker_holding_all_but_a_short_suffix_prefills_it_itself(
    cached_blocks, local, prompt_logprobs
):
    """Unless the prompt's logprobs are asked: the prefill worker computes it all (and sends
    only the blocks the decode worker lacks)."""
    local = local and prompt_logprobs is None
    core = ClusterScheduler(SchedulerLimits(local_prefill_max_tokens=20))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    core.on_hello(b"D", dataclasses.replace(hello("d", "decode"), cache_key=OWN), 0.0)
    request = submit("r", prompt_len=70)
    sampling = dataclasses.replace(request.sampling, prompt_logprobs=prompt_logprobs)
    out = core.on_submit(b"G", dataclasses.replace(request, sampling=sampling), 0.0)
    (reserve,) = sent(out, wire.Reserve)
    assert reserve.message.token_ids == [5] * 70 and reserve.message.cache_salt == "t"
    reply = wire.ReserveReply(
        peer_id="d", request_id="r", ok=True, num_free_blocks=90, num_cached_blocks=cached_blocks
    )
    (job,) = sent(core.on_reserve_reply(reply, 0.0), wire.PrefillJob)
    # 70 - 64 = 6 tokens left to compute: the decode worker does it; 70 - 16 = 54 is too many.
    assert job.identity == (b"D" if local else b"P")
    assert job.message.num_skip_blocks == cached_blocks
    prefill, decode = core.registry.get("p"), core.registry.get("d")
    assert ("r" in prefill.request_ids) == (not local) and "r" in decode.request_ids
    done = wire.RequestDone(
        request_id="r",
        peer_id="d" if local else "p",
        phase="prefill",
        finish_reason=None,
        num_prompt_tokens=70,
        num_output_tokens=1,
    )
    core.on_request_done(done, 0.0)
    assert core.requests["r"].phase.name == "DECODING" and "r" in decode.request_ids


def test_a_local_prefill_waits_for_a_step_and_a_half_of_a_busy_decode_worker():
    assert local_prefill_wait_s(0.4, num_running=0, num_uncached=30, tokens_per_s=300) == 0.1
    assert local_prefill_wait_s(0.4, num_running=8, num_uncached=30, tokens_per_s=300) == (
        pytest.approx(0.7)
    )
    assert local_prefill_wait_s(0.0, 0, 300, tokens_per_s=0) == 1.0  # the default rate


@pytest.mark.parametrize(
    "step_s,prefill_held,held_bulk,local",
    [
        (0.01, 0, False, True),  # a short step: the suffix in the next one, no KV sent
        (0.5, 0, False, False),  # a big batch's step (0.75 s) against 70 tokens at 300/s (0.23 s)
        (0.5, 600, False, True),  # ... unless the prefill worker has 2 s of prompts in hand
        (0.5, 600, True, False),  # ... but a batch line's do not count: they yield to it
        # A step no worker can have (a heartbeat's floats are not range-checked on the wire):
        # NaN made the worker never prefill locally, a negative one always; now never.
        (float("nan"), 600, False, False),
        (-1.0, 0, False, False),
        (float("inf"), 600, False, False),
    ],
)
def test_a_busy_decode_worker_leaves_the_suffix_to_a_quicker_prefill_worker(
    step_s, prefill_held, held_bulk, local
):
    # Not speculative: the index knows nothing of the decode worker's cache, and the choice
    # waits for its reply (speculation is for prompts it holds none of).
    limits = SchedulerLimits(local_prefill_max_tokens=20, speculative_prefill=False)
    core = ClusterScheduler(limits)
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    core.on_hello(b"D", dataclasses.replace(hello("d", "decode"), cache_key=OWN), 0.0)
    core.on_heartbeat(b"P", dataclasses.replace(heartbeat("p"), prefill_tokens_per_s=300.0), 0.0)
    busy = dataclasses.replace(heartbeat("d"), num_running=8, step_s=step_s,
                               prefill_tokens_per_s=300.0)  # fmt: skip
    core.on_heartbeat(b"D", busy, 0.0)
    if prefill_held:  # a long prompt already handed to the prefill worker
        held = dataclasses.replace(submit("held", prompt_len=prefill_held), bulk=held_bulk)
        core.on_submit(b"G", held, 0.0)
        core.on_reserve_reply(
            wire.ReserveReply(peer_id="d", request_id="held", ok=True, num_free_blocks=90), 0.0
        )
    (reserve,) = sent(core.on_submit(b"G", submit("r", prompt_len=70), 0.0), wire.Reserve)
    reply = wire.ReserveReply(
        peer_id="d", request_id="r", ok=True, num_free_blocks=90, num_cached_blocks=4
    )
    (job,) = sent(core.on_reserve_reply(reply, 0.0), wire.PrefillJob)
    assert job.identity == (b"D" if local else b"P")


def core_with_a_prefix_cached_on_p(request: wire.Submit) -> ClusterScheduler:
    """A gateway, p and d keeping caches, and p holding the request's first 64 tokens."""
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    core.on_hello(b"D", dataclasses.replace(hello("d", "decode"), cache_key=OWN), 0.0)
    hashes = list(chain_hashes(root_hash(KEY, "t"), request.prompt_token_ids, 16))[:4]
    beat = dataclasses.replace(heartbeat("p"), cache_events_seq=1, cache_full=True,
                               cache_stored=hashes)  # fmt: skip
    core.on_heartbeat(b"P", beat, 0.0)
    return core


def test_fair_share_charges_only_the_prompt_tokens_a_worker_must_compute():
    request = submit("r", prompt_len=80)
    core = core_with_a_prefix_cached_on_p(request)
    core.on_submit(b"G", request, 0.0)
    core.on_submit(b"G", dataclasses.replace(submit("s", prompt_len=80), tenant="u"), 0.0)
    served = {party.tenant: tokens for party, tokens in core.queue.served_tokens.items()}
    assert served == {"t": 80 - 64, "u": 80}


def test_a_prompt_whose_logprobs_are_asked_is_charged_and_routed_as_computed_whole():
    """The workers compute such a prompt whole (a cached block has no logits) and cache none
    of it: its tenant was charged only the uncached part, the prefill choice counted a cached
    prefix it would not use, and the index predicted cached tokens no worker would find."""
    request = submit("r", prompt_len=80)
    scored = dataclasses.replace(
        request, sampling=dataclasses.replace(request.sampling, prompt_logprobs=0)
    )
    core = core_with_a_prefix_cached_on_p(request)
    assert core.placement.cached_on("p", request) == 64  # the plain prompt's prefix is held
    assert core.placement.cached_on("p", scored) == 0
    core.on_submit(b"G", scored, 0.0)
    (party,) = core.queue.served_tokens
    assert core.queue.served_tokens[party] == 80
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    assert core.requests["r"].num_predicted_cached_tokens == 0


def test_a_requeued_request_gets_back_what_it_was_charged_not_more():
    """A refused reservation refunds the uncached part it was charged: refunding the whole
    prompt gave its tenant credit (served tokens below zero) at every requeue."""
    request = submit("r", prompt_len=80)
    core = core_with_a_prefix_cached_on_p(request)
    core.on_submit(b"G", request, 0.0)
    (party,) = core.queue.served_tokens
    assert core.queue.served_tokens[party] == 80 - 64
    # No room after all (it waits queued: the reply says the worker is full).
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=False, num_free_blocks=0), 0.0
    )
    assert core.requests["r"].phase == Phase.QUEUED
    assert core.queue.served_tokens[party] == 0


@pytest.mark.parametrize("step_s,speculative", [(0.5, True), (0.001, False)])
def test_a_busy_decode_worker_holding_the_prefix_gets_a_speculative_job_unless_local_wins(
    step_s, speculative
):
    core = ClusterScheduler(SchedulerLimits(local_prefill_max_tokens=20))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", dataclasses.replace(hello("p", "prefill"), cache_key=OWN), 0.0)
    core.on_hello(b"D", dataclasses.replace(hello("d", "decode"), cache_key=OWN), 0.0)
    request = submit("r", prompt_len=70)
    hashes = list(chain_hashes(root_hash(KEY, "t"), request.prompt_token_ids, 16))[:4]
    beat = dataclasses.replace(heartbeat("d"), num_running=3, step_s=step_s, cache_events_seq=1,
                               cache_full=True, cache_stored=hashes)  # fmt: skip
    core.on_heartbeat(b"D", beat, 0.0)
    out = core.on_submit(b"G", request, 0.0)
    assert bool(sent(out, wire.PrefillJob)) == speculative
    reply = wire.ReserveReply(
        peer_id="d", request_id="r", ok=True, num_free_blocks=90, num_cached_blocks=4
    )
    out = core.on_reserve_reply(reply, 0.0)
    if speculative:  # the blocks it holds are skipped all the same, by the grant
        (grant,) = sent(out, wire.PrefillGrant)
        assert grant.identity == b"P" and grant.message.num_skip_blocks == 4
    else:  # a quick step: the decode worker takes the 6-token suffix itself
        (job,) = sent(out, wire.PrefillJob)
        assert job.identity == b"D"


def test_measured_rates_are_read_on_a_grid():
    assert routing_rate(512.0) == 512.0
    for impossible in (0.0, -1.0, float("nan"), float("inf"), -float("inf")):
        assert routing_rate(impossible) == 0.0
    rates = [500.0 * (1 + i / 1000) for i in range(100)]  # 500 to 549.5 tokens/s
    on_grid = [routing_rate(r) for r in rates]
    assert all(abs(g / r - 1) <= 0.022 for g, r in zip(on_grid, rates, strict=True))
    assert on_grid == sorted(on_grid) and len(set(on_grid)) == 4  # a 10% spread: 4 steps


def test_a_thousand_measured_rates_leave_the_placement_a_few_workers_to_compare():
    """Real workers report moving averages that never repeat exactly: the index keeps workers per
    rate, and without the grid each of them was a group of one, compared at every decision."""
    from services.scheduler.candidates import prefill_candidates

    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    for i in range(1000):
        peer_id = f"p{i}"
        core.on_hello(peer_id.encode(), hello(peer_id, "prefill"), 0.0)
        measured = dataclasses.replace(heartbeat(peer_id), prefill_tokens_per_s=500.0 + i / 10)
        core.on_heartbeat(peer_id.encode(), measured, 0.0)
    candidates = prefill_candidates(core.registry, RoutingWeights(), 64, False, 0.0, set())
    groups = {routing_rate(500.0 + i / 10) for i in range(1000)}  # a 20% spread
    assert len(candidates) == len(groups) == 6  # the least loaded of each (all 1,000 before)


def test_a_heartbeat_with_an_impossible_rate_is_read_as_unmeasured():
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode"), 0.0)
    for rate in (float("inf"), float("nan"), -5.0):
        core.on_heartbeat(b"P", dataclasses.replace(heartbeat("p"), prefill_tokens_per_s=rate), 0.0)
        assert core.registry.get("p").prefill_tokens_per_s == 0.0
    assert sent(core.on_submit(b"G", submit("r", prompt_len=40), 0.0), wire.Reserve)


def test_a_rate_past_any_workers_is_read_as_unmeasured_not_raised_on_nor_summed():
    """The largest floats raised OverflowError on the grid (2.0 ** 1024): each heartbeat of the
    worker failed, and its twenty failures in ten seconds ended the scheduler. Two rates near
    the largest summed to infinity in the prefill workers' total (the wait forecast's prior),
    which stayed infinite after both left: no request was refused past its deadline again."""
    for impossible in (sys.float_info.max, 1.7e308, 1e300, 1e20):
        assert routing_rate(impossible) == 0.0
    assert routing_rate(1e9) == pytest.approx(1e9, rel=0.022)  # fast, but a rate
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    for peer_id in ("p", "q"):
        core.on_hello(peer_id.encode(), hello(peer_id, "prefill"), 0.0)
        huge = dataclasses.replace(heartbeat(peer_id), prefill_tokens_per_s=1.7e308)
        core.on_heartbeat(peer_id.encode(), huge, 0.0)
    assert core.registry.prefill_tokens_per_s == 0.0
