"""The wait forecast: a request that would outwait its first-token deadline is refused at once
(429), hand-checked on the pure functions and on the core with a hand-held clock."""

from __future__ import annotations

import dataclasses
import math

import pytest

from services.scheduler.core import ClusterScheduler, SchedulerLimits
from services.scheduler.fair_share import FairShareConfig
from services.scheduler.wait_forecast import ServiceRate, queued_ahead, refusal_for_deadline
from shared import wire
from tests.unit.test_scheduler_core import hello, sent, submit


def test_the_rate_counts_only_time_spent_backlogged():
    rate = ServiceRate(max_samples=4, horizon_s=100.0)
    rate.served(1.0)  # in an idle cluster: paced by the arrivals, not counted
    assert rate.per_second(1.0) is None
    rate.pass_ended(1.0, backlogged=True)  # someone is left waiting: a backlog begins
    assert rate.per_second(1.5) is None  # half a second of backlog: too short to tell
    rate.served(2.0)
    rate.served(4.0)
    assert rate.per_second(4.0) == pytest.approx((2 + 1) / 3.0)  # one more than seen
    rate.served(5.0)
    assert rate.per_second(5.0) == pytest.approx(4 / 4.0)  # 1 + 2 + 1 s
    assert rate.per_second(7.0) == pytest.approx(4 / 6.0)  # 2 s without one: slowing down
    rate.pass_ended(7.0, backlogged=False)  # the queue emptied
    assert rate.per_second(50.0) == pytest.approx(4 / 4.0)  # idle time is not counted
    rate.served(60.0)  # idle again: not counted
    rate.pass_ended(60.0, backlogged=True)
    rate.served(61.0)
    rate.served(61.5)  # five samples: the oldest (1 s) falls out
    assert rate.per_second(61.5) == pytest.approx(5 / 4.5)  # 2 + 1 + 1 + 0.5 s
    # All samples older than the horizon; the backlog has gone 108.5 s without a first token.
    assert rate.per_second(170.0) == pytest.approx(1 / 108.5)


def test_a_backlog_where_nothing_comes_out_is_seen_at_once():
    """Every request waiting until it times out: no first token ever, only the silence."""
    rate = ServiceRate()
    rate.pass_ended(0.0, backlogged=True)
    assert rate.per_second(0.5) is None
    assert rate.per_second(4.0) == pytest.approx(1 / 4.0)  # not even one in 4 s


def test_service_rate_settings_are_checked():
    with pytest.raises(ValueError, match="max_samples"):
        ServiceRate(max_samples=0)
    with pytest.raises(ValueError, match="min_span_s"):
        ServiceRate(min_span_s=0.0)


@pytest.mark.parametrize(
    ("queued", "party_queued", "parties", "fair", "ahead"),
    [
        (10, 10, 1, True, 10),  # one flooding tenant: its whole queue
        (10, 0, 1, True, 1),  # a newcomer beside it: one turn of the other party
        (10, 3, 3, True, 10),  # (3 + 1) x 3 - 1 = 11, but only 10 are queued
        (30, 2, 5, True, 14),  # (2 + 1) x 5 - 1
        (30, 0, 5, False, 30),  # FCFS: everyone queued
        (0, 0, 0, True, 0),
    ],
)
def test_queued_ahead(queued, party_queued, parties, fair, ahead):
    assert queued_ahead(queued, party_queued, parties, fair) == ahead


def test_refusal_past_half_the_deadline():
    assert refusal_for_deadline(20.0, 100, None) is None  # no rate known
    assert refusal_for_deadline(20.0, 19, 2.0) is None  # 19 + itself: 10 s, half of 20
    assert refusal_for_deadline(1e-3, 0, 0.01) is None  # nothing ahead: goes at the next chance
    message, retry_after = refusal_for_deadline(20.0, 29, 2.0)
    assert retry_after == 5.0 and "29 requests" in message and "15 s" in message
    assert refusal_for_deadline(20.0, 20, 2.0)[1] == 1.0  # at least a second
    assert refusal_for_deadline(1.0, 10_000, 1.0)[1] == 60.0  # at most a minute


# -- the core ---------------------------------------------------------------------------------


def deadline_submit(request_id: str, deadline: float | None, **fields) -> wire.Submit:
    return dataclasses.replace(submit(request_id), first_token_deadline_s=deadline, **fields)


def serial_core(**limits) -> ClusterScheduler:
    """One request at a time (the decode worker has one seat), no speculation: a dispatch
    happens exactly when the one in flight finishes, its first token a second later."""
    limits = {"refuse_past_deadline": True, **limits}
    c = ClusterScheduler(
        SchedulerLimits(max_queued_requests=100, speculative_prefill=False, **limits)
    )
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode"), 0.0)
    c.registry.get("d").max_num_seqs = 1
    return c


def finish_in_flight(core: ClusterScheduler, now: float) -> None:
    """Plays the life of the request in flight to its end at `now`."""
    (request,) = [r for r in core.requests.values() if r.decode_peer_id is not None]
    request_id = request.request_id
    out = core.on_reserve_reply(
        wire.ReserveReply(request_id=request_id, ok=True, num_free_blocks=90), now
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


def backlogged(**limits) -> ClusterScheduler:
    """20 requests of tenant t at 0 s (the first dispatched at once, the rest a backlog); one
    gets its first token and finishes each second from 1 to 16 s, making room for the next: at
    16 s, 16 first tokens in the 16 s backlogged (17/16 per second: one more than seen), one
    dispatched awaiting its first token, 3 queued."""
    core = serial_core(**limits)
    for i in range(20):
        assert core.on_submit(b"G", submit(f"r{i}"), 0.0)[0].message.accepted
    for second in range(1, 17):
        finish_in_flight(core, float(second))
    assert len(core.queue) == 3 and core.awaiting_first_token == {"r16"}
    assert core.service_rate.per_second(16.0) == pytest.approx(17 / 16)
    return core


def test_a_request_forecast_past_its_deadline_is_refused_with_retry_after():
    core = backlogged()
    # 1 in hand, 3 queued, and itself at 17/16 per second: 4.7 s, past half of 5 s.
    (reply,) = core.on_submit(b"G", deadline_submit("late", 5.0), 16.0)
    assert reply.message.status_code == 429 and "4 requests are ahead" in reply.message.message
    assert reply.message.retry_after_s == pytest.approx(5 * 16 / 17 - 2.5)
    assert "late" not in core.requests and len(core.queue) == 3  # nothing kept of it
    status = core.cluster_status(16.0)
    assert status.num_refused_past_deadline == 1
    assert status.first_tokens_per_s == pytest.approx(17 / 16)
    assert core.on_submit(b"G", deadline_submit("in-time", 10.0), 16.0)[0].message.accepted


def test_another_tenant_is_forecast_by_its_own_place():
    core = backlogged()
    # Fair share: a newcomer waits for the one in hand, one turn of t's queue and its own
    # (2.8 s), not for t's whole queue.
    assert core.on_submit(b"G", deadline_submit("u1", 6.0, tenant="u"), 16.0)[0].message.accepted
    (reply,) = core.on_submit(b"G", deadline_submit("u2", 6.0, tenant="u"), 16.0)
    assert reply.message.status_code == 429  # behind u1 too: 1 + (1 + 1) x 2 - 1 = 4 ahead


def test_fcfs_forecasts_the_whole_queue_for_everyone():
    core = backlogged(fair_share=FairShareConfig(policy="fcfs"))
    (reply,) = core.on_submit(b"G", deadline_submit("u1", 6.0, tenant="u"), 16.0)
    assert reply.message.status_code == 429


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


def test_the_refusal_can_be_switched_off_and_is_by_default():
    core = backlogged(refuse_past_deadline=False)
    assert core.on_submit(b"G", deadline_submit("x", 0.5), 16.0)[0].message.accepted
    assert not SchedulerLimits().refuse_past_deadline


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
    assert reply.message.status_code == 429  # x is in hand: 1.9 s
    assert core.on_submit(b"G", deadline_submit("y", 4.0), 100.0)[0].message.accepted


def test_a_request_leaves_the_ones_in_hand_at_its_first_token_or_its_end():
    core = backlogged()
    core.on_cancel(wire.Cancel(request_id="r16", reason="client gone"), 16.0)
    assert not core.awaiting_first_token
    core.dispatch(16.0)  # as the next message or tick does
    assert core.awaiting_first_token == {"r17"}  # the next one took its place
    out = core.on_reserve_reply(
        wire.ReserveReply(request_id="r17", ok=False, num_free_blocks=0), 16.0
    )
    assert not sent(out, wire.PrefillJob)
    assert "r17" not in core.awaiting_first_token  # back in the queue: counted there
    assert len(core.queue) + len(core.awaiting_first_token) == 3


@pytest.mark.parametrize("deadline", [0.0, -1.0, math.nan])
def test_a_deadline_that_is_not_positive_is_refused_as_invalid(deadline):
    core = serial_core()
    (reply,) = core.on_submit(b"G", deadline_submit("x", deadline), 0.0)
    assert reply.message.status_code == 400 and "first_token_deadline_s" in reply.message.message
