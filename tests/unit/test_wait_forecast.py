"""The wait forecast: a request that would outwait its first-token deadline is refused at once
(429), hand-checked on the pure functions and on the core with a hand-held clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.scheduler.core import ClusterScheduler, SchedulerLimits
from services.scheduler.fair_share import FairQueue, FairShareConfig
from services.scheduler.queued import QueuedRequest
from services.scheduler.wait_forecast import (
    DEADLINE_SHARE,
    InHand,
    ServiceRate,
    queued_work,
    refusal_for_deadline,
)
from shared import wire
from tests.unit.test_scheduler_core import hello, sent, submit


def test_the_pace_counts_only_time_spent_backlogged():
    rate = ServiceRate(max_samples=4, horizon_s=100.0)
    rate.served(1.0, 100)  # in an idle cluster: paced by the arrivals, not counted
    assert rate.per_second(1.0) is None and rate.tokens_per_second(1.0, 10) is None
    rate.pass_ended(1.0, backlogged=True)  # someone is left waiting: a backlog begins
    assert rate.per_second(1.5) is None  # half a second of backlog: too short to tell
    rate.served(2.0, 10)
    rate.served(4.0, 30)
    assert rate.per_second(4.0) == pytest.approx((2 + 1) / 3.0)  # one more than seen
    assert rate.tokens_per_second(4.0, 20) == pytest.approx((10 + 30 + 20) / 3.0)
    rate.served(5.0, 40)
    assert rate.per_second(5.0) == pytest.approx(4 / 4.0)  # 1 + 2 + 1 s
    assert rate.per_second(7.0) == pytest.approx(4 / 6.0)  # 2 s without one: slowing down
    assert rate.tokens_per_second(7.0, 0) == pytest.approx(80 / 6.0)
    rate.pass_ended(7.0, backlogged=False)  # the queue emptied
    assert rate.per_second(50.0) == pytest.approx(4 / 4.0)  # idle time is not counted
    rate.served(60.0, 1000)  # idle again: not counted
    rate.pass_ended(60.0, backlogged=True)
    rate.served(61.0, 50)
    rate.served(61.5, 60)  # five samples: the oldest (1 s, 10 tokens) falls out
    assert rate.per_second(61.5) == pytest.approx(5 / 4.5)  # 2 + 1 + 1 + 0.5 s
    assert rate.tokens_per_second(61.5, 0) == pytest.approx((30 + 40 + 50 + 60) / 4.5)
    # All samples older than the horizon; the backlog has gone 108.5 s without a first token.
    assert rate.per_second(170.0) == pytest.approx(1 / 108.5)
    assert rate.tokens_per_second(170.0, 217) == pytest.approx(2.0)


def test_a_backlog_where_nothing_comes_out_is_seen_at_once():
    """Every request waiting until it times out: no first token ever, only the silence."""
    rate = ServiceRate()
    rate.pass_ended(0.0, backlogged=True)
    assert rate.per_second(0.5) is None
    assert rate.per_second(4.0) == pytest.approx(1 / 4.0)  # not even one in 4 s
    assert rate.tokens_per_second(4.0, 100) == pytest.approx(25.0)


def test_the_workers_own_rates_count_as_half_a_second_of_samples():
    rate = ServiceRate()
    rate.pass_ended(0.0, backlogged=True)
    # A burst's first prefill step not yet through at 1.5 s: its silence alone would say
    # 26 tokens in 1.5 s; with the workers' 150 a second as half a second more, 50.5.
    assert rate.tokens_per_second(1.5, 26) == pytest.approx(26 / 1.5)
    assert rate.tokens_per_second(1.5, 26, prior_tokens_per_s=150.0) == pytest.approx(101 / 2.0)
    rate.served(2.0, 500)  # the step's batch: the backlog's own samples soon outweigh the prior
    assert rate.tokens_per_second(2.0, 26, 150.0) == pytest.approx((500 + 26 + 75) / 2.5)
    # A minute in which nothing came out still reads as slowness.
    assert rate.tokens_per_second(62.0, 26, 150.0) == pytest.approx(601 / 62.5)


def test_the_registry_sums_the_prefill_workers_rates_as_they_report_join_and_leave():
    core = serial_core()
    registry = core.registry
    assert registry.prefill_tokens_per_s == 0.0
    core.on_hello(b"Q", hello("q", "prefill"), 0.0)
    registry.report_prefill_rate(registry.get("p"), 100.0)
    registry.report_prefill_rate(registry.get("q"), 50.0)
    registry.report_prefill_rate(registry.get("d"), 400.0)  # a decode worker's does not count
    assert registry.prefill_tokens_per_s == pytest.approx(150.0)
    registry.report_prefill_rate(registry.get("p"), 120.0)
    assert registry.prefill_tokens_per_s == pytest.approx(170.0)
    registry.remove("q")
    assert registry.prefill_tokens_per_s == pytest.approx(120.0)
    core.on_hello(b"P", hello("p", "prefill"), 1.0)  # joins again, not measured yet
    assert registry.prefill_tokens_per_s == 0.0


def test_service_rate_settings_are_checked():
    with pytest.raises(ValueError, match="max_samples"):
        ServiceRate(max_samples=0)
    with pytest.raises(ValueError, match="min_span_s"):
        ServiceRate(min_span_s=0.0)


def test_in_hand_keeps_the_prompt_tokens_of_its_requests():
    in_hand = InHand()
    assert in_hand.mean_tokens() is None and in_hand.num_tokens == 0
    in_hand.add("a", 10)
    in_hand.add("b", 30)
    in_hand.add("a", 20)  # dispatched anew: counted once
    assert set(in_hand) == {"a", "b"} and "a" in in_hand and len(in_hand) == 2
    assert in_hand.num_tokens == 50 and in_hand.mean_tokens() == 25.0
    in_hand.discard("a")
    in_hand.discard("gone")
    assert in_hand.num_tokens == 30 and list(in_hand) == ["b"]


@pytest.mark.parametrize(
    ("own", "party_queued", "queued", "parties", "fair", "work"),
    [
        (10, 100, 100, 1, True, 110),  # one flooding tenant: its whole queue and itself
        (10, 0, 100, 1, True, 20),  # a newcomer beside it: one turn of as much of the other
        (10, 30, 100, 3, True, 110),  # (30 + 10) x 3 = 120, but only 100 + 10 are there
        (10, 20, 300, 5, True, 150),  # (20 + 10) x 5
        (10, 0, 300, 5, False, 310),  # FCFS: everyone queued
        (10, 0, 0, 0, True, 10),  # nothing queued: itself
    ],
)
def test_queued_work(own, party_queued, queued, parties, fair, work):
    assert queued_work(own, party_queued, queued, parties, fair) == work


def test_refusal_past_half_the_deadline():
    def refusal(*args):
        return refusal_for_deadline(*args, share=0.5)

    assert refusal(20.0, 10, 1000, None) is None  # no pace known
    assert refusal(20.0, 10, 200, 20.0) is None  # 10 s, half of 20
    assert refusal(1e-3, 10, 10, 0.01) is None  # nothing ahead: goes at once
    message, retry_after = refusal(20.0, 10, 300, 20.0)
    assert retry_after == 5.0 and "about 290 prompt tokens" in message and "15 s" in message
    assert refusal(20.0, 10, 210, 20.0)[1] == 1.0  # at least a second
    assert refusal(1.0, 10, 10_000, 1.0)[1] == 60.0  # at most a minute


def test_refusal_past_three_quarters_of_the_deadline_by_default():
    assert DEADLINE_SHARE == 0.75
    assert refusal_for_deadline(20.0, 10, 300, 20.0) is None  # 15 s of 20
    message, retry_after = refusal_for_deadline(20.0, 10, 340, 20.0)
    assert retry_after == 2.0 and "17 s" in message  # 17 s, 2 past three quarters of 20


def test_the_queue_keeps_the_prompt_tokens_the_forecast_reads():
    queue = FairQueue(FairShareConfig())
    for request_id, tenant, num_tokens, bulk in [
        ("a", "t", 10, False),
        ("b", "t", 30, False),
        ("c", "u", 5, False),
        ("d", "t", 100, True),
    ]:
        queue.push(QueuedRequest(request_id, tenant, num_tokens, 0, 0.0, bulk=bulk))
    t, u = queue.party_for("t", 10), queue.party_for("u", 5)
    assert queue.num_interactive_queued_tokens() == 45
    assert queue.num_queued_tokens_in(t) == 40 and queue.num_queued_tokens_in(u) == 5
    assert queue.num_queued_tokens_in(queue.party_for("t", 100, bulk=True)) == 100
    assert queue.num_backlogged_interactive_parties() == 2
    queue.remove("b")
    assert queue.pop_next(0.0).request_id in {"a", "c"}
    queue.remove("a")
    queue.remove("c")
    assert queue.num_interactive_queued_tokens() == 0 and queue.num_queued_tokens_in(t) == 0
    assert queue.num_backlogged_interactive_parties() == 0


# -- the core ---------------------------------------------------------------------------------


def deadline_submit(request_id: str, deadline: float | None, **fields) -> wire.Submit:
    return dataclasses.replace(submit(request_id), first_token_deadline_s=deadline, **fields)


def serial_core(**limits) -> ClusterScheduler:
    """One request at a time (the decode worker has one seat), no speculation: a dispatch
    happens exactly when the one in flight finishes, its first token a second later."""
    limits = {"refuse_past_deadline": True, "deadline_share": 0.5, **limits}
    c = ClusterScheduler(
        SchedulerLimits(max_queued_requests=100, speculative_prefill=False, **limits)
    )
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode", blocks=1000, seats=1), 0.0)
    return c


def finish_in_flight(core: ClusterScheduler, now: float) -> None:
    """Plays the life of the request in flight to its end at `now`."""
    (request,) = [r for r in core.requests.values() if r.decode_peer_id is not None]
    request_id = request.request_id
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id=request_id, ok=True, num_free_blocks=900), now
    )
    assert sent(out, wire.PrefillJob)
    for phase, peer in (("prefill", "p"), ("decode", "d")):
        done = wire.RequestDone(
            request_id=request_id,
            peer_id=peer,
            phase=phase,
            finish_reason=None if phase == "prefill" else "length",
            num_prompt_tokens=20,
            num_output_tokens=1 if phase == "prefill" else 8,
        )
        core.on_request_done(done, now)


def backlogged(prompt_len: int = 20, **limits) -> ClusterScheduler:
    """20 requests of tenant t at 0 s (the first dispatched at once, the rest a backlog); one
    gets its first token and finishes each second from 1 to 16 s, making room for the next: at
    16 s, 16 first tokens in the 16 s backlogged (17/16 per second: one more than seen), one
    dispatched awaiting its first token, 3 queued. Of 20 prompt tokens each, the pace is
    17 x 20 / 16 = 21.25 prompt tokens a second."""
    core = serial_core(**limits)
    for i in range(20):
        assert core.on_submit(b"G", submit(f"r{i}", prompt_len), 0.0)[0].message.accepted
    for second in range(1, 17):
        finish_in_flight(core, float(second))
    assert len(core.queue) == 3 and set(core.awaiting_first_token) == {"r16"}
    assert core.service_rate.per_second(16.0) == pytest.approx(17 / 16)
    return core


def test_a_request_forecast_past_its_deadline_is_refused_with_retry_after():
    core = backlogged()
    # 20 tokens in hand, 60 queued and its own 20 at 21.25 a second: 4.7 s, past half of 5 s.
    (reply,) = core.on_submit(b"G", deadline_submit("late", 5.0), 16.0)
    assert reply.message.status_code == 429
    assert "about 80 prompt tokens" in reply.message.message
    assert reply.message.retry_after_s == pytest.approx(100 / 21.25 - 2.5)
    assert "late" not in core.requests and len(core.queue) == 3  # nothing kept of it
    status = core.cluster_status(16.0)
    assert status.num_refused_past_deadline == 1
    assert status.first_tokens_per_s == pytest.approx(17 / 16)
    assert status.prompt_tokens_per_s == pytest.approx(21.25)
    assert core.on_submit(b"G", deadline_submit("in-time", 10.0), 16.0)[0].message.accepted


def test_the_deadline_share_moves_the_cut():
    # The same 4.7 s forecast: past half of 5 s, inside all of it.
    assert core_refuses(backlogged(deadline_share=0.5), "late", 5.0)
    assert not core_refuses(backlogged(deadline_share=1.0), "late", 5.0)


def core_refuses(core: ClusterScheduler, request_id: str, deadline: float) -> bool:
    (reply,) = core.on_submit(b"G", deadline_submit(request_id, deadline), 16.0)[:1]
    return reply.message.status_code == 429


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5])
def test_a_deadline_share_outside_its_range_is_refused(share):
    with pytest.raises(ValueError, match="deadline_share"):
        SchedulerLimits(deadline_share=share)


def test_another_tenant_is_forecast_by_its_own_place():
    core = backlogged()
    # Fair share: a newcomer waits for the one in hand, one turn of t's queue as big as itself
    # and its own (60 tokens, 2.8 s), not for t's whole queue.
    assert core.on_submit(b"G", deadline_submit("u1", 6.0, tenant="u"), 16.0)[0].message.accepted
    (reply,) = core.on_submit(b"G", deadline_submit("u2", 6.0, tenant="u"), 16.0)
    assert reply.message.status_code == 429  # behind u1 too: 20 + (20 + 20) x 2 = 100 tokens


def test_fcfs_forecasts_the_whole_queue_for_everyone():
    core = backlogged(fair_share=FairShareConfig(policy="fcfs"))
    (reply,) = core.on_submit(b"G", deadline_submit("u1", 6.0, tenant="u"), 16.0)
    assert reply.message.status_code == 429


def test_a_pace_learned_from_long_prompts_does_not_refuse_a_burst_of_short_ones():
    """Counted in requests, 19 long prompts in 19 s forecast a burst of 40 short ones at 20
    s; counted in prompt tokens, they take a second and a half."""
    core = backlogged(prompt_len=400)
    for second in range(17, 21):
        finish_in_flight(core, float(second))
    for i in range(40):
        short = dataclasses.replace(submit(f"s{i}", prompt_len=10), first_token_deadline_s=4.0)
        assert core.on_submit(b"G", short, 100.0)[0].message.accepted, i
    # The pace: 19 x 400 tokens in 19 s, and one more short one in hand: 400.5 a second.
    assert core.cluster_status(100.0).prompt_tokens_per_s == pytest.approx(7610 / 19)
    # A long one behind them is forecast by its size: 10 in hand, 390 queued and its 400: 2 s.
    long = dataclasses.replace(submit("long", prompt_len=400), first_token_deadline_s=4.2)
    assert core.on_submit(b"G", long, 100.0)[0].message.accepted
    long = dataclasses.replace(submit("long2", prompt_len=400), first_token_deadline_s=4.2)
    (reply,) = core.on_submit(b"G", long, 100.0)  # and one more behind it: 3 s
    assert reply.message.status_code == 429


def test_a_burst_is_not_refused_before_the_first_prefill_step_brings_its_first_tokens():
    """100 short prompts at once, 1.5 s in, nothing through yet: paced by the silence alone
    (26 tokens in 1.5 s) the 2,626 tokens to go before one more take 151 s, past half its
    120 s; with the prefill worker's measured 150 tokens a second as the prior, 52 s."""
    core = serial_core()
    for i in range(100):
        request = dataclasses.replace(submit(f"b{i}", prompt_len=26), first_token_deadline_s=120.0)
        assert core.on_submit(b"G", request, 0.0)[0].message.accepted, i
    late = dataclasses.replace(submit("late", prompt_len=26), first_token_deadline_s=120.0)
    assert core.on_submit(b"G", late, 1.5)[0].message.status_code == 429
    core.registry.report_prefill_rate(core.registry.get("p"), 150.0)
    assert core.on_submit(b"G", dataclasses.replace(late, request_id="late2"), 1.5)[
        0
    ].message.accepted


@pytest.mark.parametrize(
    "fields",
    [
        {"first_token_deadline_s": None},  # a gateway that sets none
        {"bulk": True},  # batch lines wait for spare capacity by design
        {"priority": 1},  # goes before its party's queue
    ],
)
def test_requests_the_forecast_does_not_refuse(fields):
    core = backlogged()
    request = dataclasses.replace(deadline_submit("x", 0.5), **fields)
    assert core.on_submit(b"G", request, 16.0)[0].message.accepted


def test_the_refusal_is_on_by_default_and_can_be_switched_off():
    core = backlogged(refuse_past_deadline=False)
    assert core.on_submit(b"G", deadline_submit("x", 0.5), 16.0)[0].message.accepted
    assert SchedulerLimits().refuse_past_deadline


def test_no_forecast_before_a_backlog_shows_the_pace():
    core = serial_core()
    for i in range(5):
        assert core.on_submit(b"G", deadline_submit(f"r{i}", 1e-3), 0.0)[0].message.accepted


def test_the_pace_outlives_an_idle_spell_and_nothing_ahead_is_never_refused():
    core = backlogged()
    for second in range(17, 21):  # the last three dispatched, the last finishes at 20 s
        finish_in_flight(core, float(second))
    assert not core.requests and not core.awaiting_first_token  # idle from 20 s
    # 19 first tokens in the 19 s backlogged (the last one's came after the queue emptied).
    assert core.service_rate.per_second(100.0) == pytest.approx(20 / 19)  # idle not counted
    assert core.on_submit(b"G", deadline_submit("x", 1e-3), 100.0)[0].message.accepted  # runs
    (reply,) = core.on_submit(b"G", deadline_submit("y", 1e-3), 100.0)
    assert reply.message.status_code == 429  # x is in hand: 40 tokens at 400 / 19 a second
    assert core.on_submit(b"G", deadline_submit("y", 4.0), 100.0)[0].message.accepted


def test_a_request_leaves_the_ones_in_hand_at_its_first_token_or_its_end():
    core = backlogged()
    core.on_cancel(wire.Cancel(request_id="r16", reason="client gone"), 16.0)
    assert not core.awaiting_first_token and core.awaiting_first_token.num_tokens == 0
    core.dispatch(16.0)  # as the next message or tick does
    assert set(core.awaiting_first_token) == {"r17"}  # the next one took its place
    assert core.awaiting_first_token.num_tokens == 20
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r17", ok=False, num_free_blocks=0), 16.0
    )
    assert not sent(out, wire.PrefillJob)
    assert "r17" not in core.awaiting_first_token  # back in the queue: counted there
    assert len(core.queue) + len(core.awaiting_first_token) == 3


@pytest.mark.parametrize("deadline", [0.0, -1.0, math.nan])
def test_a_deadline_that_is_not_positive_is_refused_as_invalid(deadline):
    core = serial_core()
    (reply,) = core.on_submit(b"G", deadline_submit("x", deadline), 0.0)
    assert reply.message.status_code == 400 and "first_token_deadline_s" in reply.message.message


def test_a_weighted_tenant_is_forecast_by_its_weighted_turn():
    """Fair share serves a party tokens in proportion to its weight (`--tenant-weights`): while
    a tenant of weight 4 is served its own tokens, one of weight 1 gets a quarter as many, and
    while one of weight 1/4 is, four times as many. Forecast as if every weight were 1, the
    heavy tenant was refused (429) what it would get in time, and the light one admitted to
    time out."""
    weights = FairShareConfig(tenant_weights={"gold": 4.0, "free": 0.25})
    core = backlogged(fair_share=weights)
    # gold: 20 in hand, its own 20 and a quarter of as much of t's queue: 45 tokens, 2.1 s,
    # inside half of 5 s (equal weights said 60 tokens, 2.8 s: refused).
    gold = core.on_submit(b"G", deadline_submit("gold", 5.0, tenant="gold"), 16.0)[0]
    assert gold.message.accepted, gold.message.message
    core = backlogged(fair_share=weights)
    # free: 20 in hand, its own 20 and four times as much of t's 60 queued: 100 tokens, 4.7 s,
    # past half of 6 s (equal weights said 2.8 s: admitted).
    (free,) = core.on_submit(b"G", deadline_submit("free", 6.0, tenant="free"), 16.0)
    assert free.message.status_code == 429 and "about 80 prompt tokens" in free.message.message


@pytest.mark.parametrize(
    ("own", "party_queued", "queued", "weights", "work"),
    [
        (10, 0, 300, (2.0, 1.0), 30),  # two others of weight 1: as (10 x 3)
        (10, 0, 300, (2.0, 4.0), 15),  # itself of weight 4: half a turn of theirs each
        (10, 20, 300, (5.0, 1.0), 150),  # its party among them: (20 + 10) x 5
        (10, 0, 40, (1.0, 0.25), 50),  # four turns of theirs, but only 40 are queued
    ],
)
def test_queued_work_by_weight(own, party_queued, queued, weights, work):
    assert queued_work(own, party_queued, queued, 0, True, weights) == work


@pytest.mark.parametrize("indexes", ["python", "auto"])  # (auto: the C index where it builds)
def test_the_queue_sums_the_weights_of_its_backlogged_parties(indexes):
    config = FairShareConfig(tenant_weights={"gold": 4.0, "free": 0.25}, class_weights=(1.0, 2.0))
    queue = FairQueue(config, indexes)
    for request_id, tenant, num_tokens in [
        ("a", "gold", 10),
        ("b", "gold", 2000),
        ("c", "t", 5),
        ("d", "free", 3000),
        ("e", "u", 3000),
    ]:
        queue.push(QueuedRequest(request_id, tenant, num_tokens, 0, 0.0))
    queue.push(QueuedRequest("f", "gold", 10, 0, 0.0, bulk=True))  # (bulk: not interactive)
    # short: gold 4 + t 1; long (class weight 2): (gold 4 + free 1/4 + u 1) x 2
    assert queue.backlogged_interactive_weight() == 5.0 + 10.5
    for request_id in "abcde":
        queue.remove(request_id)
    assert queue.backlogged_interactive_weight() == 0.0
