"""A restarted scheduler adopts the requests its earlier life left decoding on the workers
(`services/scheduler/adopted.py`): the real core, a fresh one, driven by hand-made messages."""

from __future__ import annotations

import pytest

from services.scheduler.adopted import MAX_CANCELS_AHEAD
from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from shared import wire
from tests.unit.test_scheduler_core import hello, run_to_decoding, sent, submit

TIMEOUT_S = 3.0
GATEWAYS = {b"G": "g", b"H": "h"}


@pytest.fixture
def core() -> ClusterScheduler:
    """A scheduler just started: two gateways and the workers have said HELLO again."""
    c = ClusterScheduler(SchedulerLimits(heartbeat_timeout_s=TIMEOUT_S))
    for identity, peer_id in GATEWAYS.items():
        c.on_hello(identity, hello(peer_id, "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode", seats=2), 0.0)
    return c


def beat(
    core: ClusterScheduler, held: list[str], now: float, peer_id: str = "d", identity: bytes = b"D"
) -> list:
    heartbeat = wire.Heartbeat(
        peer_id=peer_id,
        num_waiting=0,
        num_running=len(held),
        num_free_blocks=90,
        num_total_blocks=100,
        steps_completed=int(now),
        sent_at=now,
        request_ids=held,
    )
    return core.on_heartbeat(identity, heartbeat, now)


def ends(outgoing) -> dict[bytes, list[tuple[str, str | None]]]:
    """The (request id, finish reason) of every delta each gateway was sent."""
    by_gateway: dict[bytes, list[tuple[str, str | None]]] = {}
    for out in sent(outgoing, wire.Tokens):
        deltas = by_gateway.setdefault(out.identity, [])
        deltas += [(d.request_id, d.finish_reason) for d in out.message.deltas]
    return by_gateway


def lost_everywhere(*request_ids: str) -> dict[bytes, list[tuple[str, str | None]]]:
    return {identity: [(r, "lost") for r in request_ids] for identity in GATEWAYS}


def test_a_decode_worker_timing_out_tells_every_gateway_its_adopted_request_is_lost(core):
    beat(core, ["old"], 1.0)
    out = core.tick(1.0 + TIMEOUT_S + 0.1)
    assert ends(out) == lost_everywhere("old")
    (delta,) = sent(out, wire.Tokens)[0].message.deltas
    assert "worker d stopped responding" in delta.error and delta.token_ids == []
    # Alive after all (a long stall), it must stop working for nobody; and listed again once it
    # has registered again, the request is not adopted twice.
    assert [(o.identity, o.message.request_id) for o in sent(out, wire.Cancel)] == [(b"D", "old")]
    core.on_hello(b"D2", hello("d", "decode"), 5.0)
    (cancel,) = sent(beat(core, ["old"], 6.0, identity=b"D2"), wire.Cancel)
    assert cancel.message.request_id == "old" and cancel.message.reason == "abandoned"
    assert not ends(core.on_goodbye(b"D2", wire.Goodbye(peer_id="d"), 7.0))


def test_a_decode_worker_saying_goodbye_tells_every_gateway(core):
    beat(core, ["old-1", "old-2"], 1.0)
    out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 2.0)
    assert ends(out) == lost_everywhere("old-1", "old-2")
    assert all(
        "worker d stopped" in d.error for o in sent(out, wire.Tokens) for d in o.message.deltas
    )


def test_a_decode_worker_registering_again_tells_every_gateway(core):
    """Its HELLO again is a new process (or one that took itself for forgotten): what the old
    registration held is gone."""
    beat(core, ["old"], 1.0)
    assert ends(core.on_hello(b"D2", hello("d", "decode"), 2.0)) == lost_everywhere("old")


def test_an_id_unlisted_twice_in_a_row_is_forgotten(core):
    """It ended there, and the gateway had its end from the worker: a later death is not its
    loss. Once left out (a stale heartbeat) is not enough."""
    beat(core, ["ended", "stale", "running"], 1.0)
    beat(core, ["stale", "running"], 2.0)
    beat(core, ["running"], 3.0)  # "stale" left out once, listed in between: not twice in a row
    beat(core, ["stale", "running"], 4.0)
    beat(core, ["running"], 5.0)
    out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 6.0)
    assert ends(out) == lost_everywhere("running", "stale")


def test_a_full_list_forgets_nothing_and_adopts_at_most_a_list(core):
    first = [f"a{i}" for i in range(wire.MAX_HELD_IDS)]
    beat(core, first, 1.0)
    beat(core, [f"b{i}" for i in range(wire.MAX_HELD_IDS)], 2.0)  # (a worker listing lies)
    beat(core, [f"c{i}" for i in range(wire.MAX_HELD_IDS)], 3.0)
    assert core.cluster_status(3.0).num_in_flight == wire.MAX_HELD_IDS
    out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 4.0)
    assert core.cluster_status(4.0).num_in_flight == 0  # none outlives its worker
    messages = sent(out, wire.Tokens)
    assert sorted(ends(out)[b"G"]) == sorted((r, "lost") for r in first)
    # Each message within what the wire takes: the gateway would drop a longer one whole.
    assert all(len(o.message.deltas) <= wire.MAX_LIST_LEN for o in messages)
    assert wire.decode(wire.encode(messages[0].message)) == messages[0].message


def test_an_abandoned_id_is_not_adopted(core):
    run_to_decoding_here(core, "r")
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)  # that cancel lost
    (cancel,) = sent(beat(core, ["r", "old"], 2.0), wire.Cancel)
    assert cancel.message.request_id == "r"  # told again, not adopted
    assert ends(core.tick(2.0 + TIMEOUT_S + 0.1)) == lost_everywhere("old")


def test_a_request_placed_here_is_untouched(core):
    """It is tracked: its loss goes to its own gateway alone, once."""
    run_to_decoding_here(core, "r")
    beat(core, ["r", "old"], 1.0)
    assert "r" in core.requests
    out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 2.0)
    assert ends(out) == {b"G": [("old", "lost"), ("r", "lost")], b"H": [("old", "lost")]}


def test_a_prefill_workers_listing_is_not_adopted(core):
    """Its request either had no token yet (the gateway resumed it at the restart) or is held
    by its decode worker too (a reservation), which lists it."""
    beat(core, ["old-prefill"], 1.0, peer_id="p", identity=b"P")
    beat(core, ["old"], 1.0)
    assert ends(core.on_goodbye(b"P", wire.Goodbye(peer_id="p"), 2.0)) == {}
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 2.0)) == lost_everywhere("old")


def test_adopted_requests_take_their_seats_until_they_end(core):
    """The heartbeat's free blocks count their KV; their seats are the scheduler's to count."""
    beat(core, ["old-1", "old-2"], 1.0)  # both of d's seats
    out = core.on_submit(b"G", submit("new"), 1.5)
    assert sent(out, wire.SubmitReply)[0].message.accepted and not sent(out, wire.Reserve)
    assert core.cluster_status(1.5).num_in_flight == 3
    assert not sent(beat(core, ["old-2"], 2.0), wire.Reserve)  # old-1 left out once
    (reserve,) = sent(beat(core, ["old-2"], 3.0), wire.Reserve)  # twice: it ended, seat free
    assert reserve.message.request_id == "new"


def test_a_sequence_handed_back_for_recompute_goes_to_every_gateway(core):
    beat(core, ["old"], 1.0)
    done = wire.RequestDone(request_id="old", peer_id="d", phase="decode",
                            finish_reason="preempted", num_prompt_tokens=20,
                            num_output_tokens=3)  # fmt: skip
    out = core.on_request_done(done, 2.0)
    assert ends(out) == {identity: [("old", "preempted")] for identity in GATEWAYS}
    assert not core.adopted.holds("old") and "old" not in core.registry.get("d").request_ids
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 3.0)) == {}


def test_where_an_adopted_stream_ended_goes_to_every_gateway(core):
    beat(core, ["old"], 1.0)
    done = wire.RequestDone(request_id="old", peer_id="d", phase="decode", finish_reason="stop",
                            num_prompt_tokens=20, num_output_tokens=4,
                            output_length=9)  # fmt: skip
    out = core.on_request_done(done, 2.0)
    ended = wire.StreamEnded(request_id="old", finish_reason="stop", output_length=9)
    assert [(o.identity, o.message) for o in sent(out, wire.StreamEnded)] == [
        (identity, ended) for identity in GATEWAYS
    ]
    assert not ends(out) and not core.adopted.holds("old")
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 3.0)) == {}


def test_a_gateways_cancel_reaches_the_worker_holding_an_adopted_request(core):
    """Its client left after the restart: the worker stops generating for nobody."""
    beat(core, ["old"], 1.0)
    out = core.on_cancel(wire.Cancel(request_id="old", reason="client gone"), 2.0)
    (cancel,) = sent(out, wire.Cancel)
    assert cancel.identity == b"D" and cancel.message.reason == "client gone"
    assert core.cluster_status(2.0).num_in_flight == 0
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 3.0)) == {}


def test_a_submit_reusing_an_adopted_id_is_refused(core):
    beat(core, ["old"], 1.0)
    (reply,) = sent(core.on_submit(b"G", submit("old"), 2.0), wire.SubmitReply)
    assert not reply.message.accepted and reply.message.status_code == 400


def test_two_workers_listing_one_id_both_let_it_go_when_one_dies(core):
    """The second holds a reservation the old scheduler gave up on (its cancel lost): which
    one decodes it is unknown, so either's death resumes it, and the other lets it go."""
    core.on_hello(b"E", hello("e", "decode"), 0.0)
    beat(core, ["old"], 1.0)
    beat(core, ["old"], 1.0, peer_id="e", identity=b"E")
    out = core.on_goodbye(b"E", wire.Goodbye(peer_id="e"), 2.0)
    assert ends(out) == lost_everywhere("old")
    assert sorted((o.identity, o.message.request_id) for o in sent(out, wire.Cancel)) == [
        (b"D", "old"),
        (b"E", "old"),
    ]
    assert not core.adopted.holds("old") and "old" not in core.registry.get("d").request_ids


def run_to_decoding_here(core: ClusterScheduler, request_id: str) -> None:
    """A request this scheduler placed (from gateway g), decoding on d."""
    run_to_decoding(core, request_id)
    assert core.requests[request_id].gateway_peer_id == "g"


def test_a_worker_whose_adopted_requests_all_ended_is_heard_as_any_other(core):
    beat(core, ["old"], 1.0)
    for t in (2.0, 3.0, 4.0):  # forgotten at 3.0; then the usual heartbeat
        assert not ends(beat(core, [], t))
    beat(core, ["older"], 5.0)  # (a stale listing, say)
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 6.0)) == lost_everywhere("older")


# -- a cancel that comes before the worker's listing -----------------------------------------


def test_a_cancel_before_its_workers_listing_reaches_the_worker(core):
    """The client left after the restart, before the decode worker's heartbeat listed its
    request: the cancel waits for that listing, and the worker stops generating for nobody."""
    assert not sent(core.on_cancel(wire.Cancel(request_id="old", reason="client gone"), 1.0),
                    wire.Cancel)  # fmt: skip
    (cancel,) = sent(beat(core, ["old"], 1.5), wire.Cancel)
    assert cancel.identity == b"D" and cancel.message.request_id == "old"
    assert cancel.message.reason == "client gone"
    assert not core.adopted.holds("old") and core.cluster_status(1.5).num_in_flight == 0
    assert "old" not in core.registry.get("d").request_ids  # its seat is free
    # A heartbeat sent before the worker had it is told again, and it is never adopted.
    (again,) = sent(beat(core, ["old"], 2.0), wire.Cancel)
    assert again.message.request_id == "old" and not core.adopted.holds("old")
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 3.0)) == {}


def test_a_cancel_before_the_listing_reaches_a_prefill_worker_too(core):
    core.on_cancel(wire.Cancel(request_id="old", reason="client gone"), 1.0)
    (cancel,) = sent(beat(core, ["old"], 1.5, peer_id="p", identity=b"P"), wire.Cancel)
    assert cancel.identity == b"P" and cancel.message.reason == "client gone"
    (cancel,) = sent(beat(core, ["old"], 1.5), wire.Cancel)  # its decode worker's reservation
    assert cancel.identity == b"D" and not core.adopted.holds("old")


def test_a_cancel_before_a_listing_naming_the_id_twice_leaves_it_unadopted(core):
    core.on_cancel(wire.Cancel(request_id="old", reason="client gone"), 1.0)
    assert sent(beat(core, ["old", "old"], 1.5), wire.Cancel)
    assert not core.adopted.holds("old") and "old" not in core.registry.get("d").request_ids


def test_a_cancel_before_the_listing_is_kept_a_heartbeat_timeout(core):
    """Past that, a worker holding it would have listed it (or been taken for dead): a listing
    later is adopted as ever."""
    core.on_cancel(wire.Cancel(request_id="old", reason="client gone"), 1.0)
    assert not sent(beat(core, ["old"], 1.0 + TIMEOUT_S + 0.1), wire.Cancel)
    assert core.adopted.holds("old")


def test_cancels_before_the_listing_are_bounded(core):
    """A flood of cancels of ids nobody holds keeps at most `MAX_CANCELS_AHEAD` (the oldest
    go first), and none past its time."""
    many = MAX_CANCELS_AHEAD + 10
    for i in range(many):
        core.on_cancel(wire.Cancel(request_id=f"x{i}", reason="client gone"), 1.0)
    assert core.adopted.num_cancels_ahead() == MAX_CANCELS_AHEAD
    out = beat(core, ["x0", f"x{many - 1}"], 1.5)
    assert [o.message.request_id for o in sent(out, wire.Cancel)] == [f"x{many - 1}"]
    assert core.adopted.holds("x0")  # its cancel was among the oldest, forgotten
    core.on_cancel(wire.Cancel(request_id="late", reason="client gone"), 1.0 + TIMEOUT_S + 0.1)
    assert core.adopted.num_cancels_ahead() == 1  # the others' time was up


def test_a_cancel_of_a_request_that_ended_here_is_not_kept(core):
    run_to_decoding_here(core, "r")
    done = wire.RequestDone(request_id="r", peer_id="d", phase="decode", finish_reason="stop",
                            num_prompt_tokens=20, num_output_tokens=4)  # fmt: skip
    core.on_request_done(done, 1.0)
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)
    assert core.adopted.num_cancels_ahead() == 0


def test_a_cancel_before_a_submit_of_its_id_leaves_the_new_request_be(core):
    """A SUBMIT after the cancel is a request of its own: the cancel is not its."""
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 0.0)
    run_to_decoding_here(core, "r")
    assert not sent(beat(core, ["r"], 1.0), wire.Cancel)
    assert core.requests["r"].phase == Phase.DECODING and not core.adopted.holds("r")


def test_a_submit_after_the_cancel_reached_its_worker_leaves_the_new_request_be(core):
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 0.0)
    assert sent(beat(core, ["r"], 0.0), wire.Cancel)  # the earlier life's "r" let go
    beat(core, [], 0.0)  # (and gone: d idle again, so the reservation goes out alone)
    run_to_decoding_here(core, "r")  # then a new "r"
    assert not sent(beat(core, ["r"], 1.0), wire.Cancel)
    assert core.requests["r"].phase == Phase.DECODING


def test_a_submit_reusing_an_id_given_up_on_is_not_cancelled_where_it_runs(core):
    """An id remembered as given up on (a cancel's, an end's) names the request tracked now
    once one reuses it: its worker's listing is its, not a stale one."""
    run_to_decoding_here(core, "r")
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)
    run_to_decoding_here(core, "r")
    assert not sent(beat(core, ["r"], 2.0), wire.Cancel)
    assert core.requests["r"].phase == Phase.DECODING


# -- an earlier life's prefill worker reporting on a request its decode worker holds ---------


def prefill_done(finish_reason: str | None, output_length: int | None = None) -> wire.RequestDone:
    return wire.RequestDone(request_id="old", peer_id="p", phase="prefill",
                            finish_reason=finish_reason, num_prompt_tokens=20,
                            num_output_tokens=1, output_length=output_length)  # fmt: skip


def test_an_earlier_lifes_failed_handoff_lets_the_decode_workers_reservation_go(core):
    """The prefill worker could not hand the KV over (it told the gateway, which resumes the
    request): the decode worker's reservation, adopted, held a seat for nobody until its lease
    ran out (minutes), or the KV that did arrive decoded for nobody."""
    beat(core, ["old"], 1.0)  # d holds it, reserved
    out = core.on_request_done(prefill_done("error"), 2.0)
    assert [(o.identity, o.message.request_id) for o in sent(out, wire.Cancel)] == [(b"D", "old")]
    assert ends(out) == lost_everywhere("old")
    assert not core.adopted.holds("old") and "old" not in core.registry.get("d").request_ids
    assert ends(core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 3.0)) == {}


def test_an_earlier_lifes_prefill_ending_the_request_lets_the_reservation_go(core):
    """It ended at its first token (as a request placed here: `_forget`'s "finished in
    prefill"); its end goes to the gateways, as an adopted request's does."""
    beat(core, ["old"], 1.0)
    out = core.on_request_done(prefill_done("length", output_length=1), 2.0)
    (cancel,) = sent(out, wire.Cancel)
    assert cancel.identity == b"D" and cancel.message.request_id == "old"
    ended = wire.StreamEnded(request_id="old", finish_reason="length", output_length=1)
    assert [o.message for o in sent(out, wire.StreamEnded)] == [ended, ended]
    assert not ends(out) and not core.adopted.holds("old")


def test_an_earlier_lifes_prefill_handing_the_kv_over_leaves_the_adopted_request_be(core):
    beat(core, ["old"], 1.0)
    assert not core.on_request_done(prefill_done(None), 2.0)
    assert core.adopted.holds("old") and "old" in core.registry.get("d").request_ids


# -- a request given up on in the queue after a worker held it ---------------------------------


def test_a_request_timing_out_in_the_queue_after_its_reservation_did_is_not_adopted():
    """Its reservation timed out (the cancel to its decode worker went astray), it went back to
    the queue, and timed out there: the worker's listing of it, the old reservation's, was
    adopted as an earlier life's request, holding a seat until its lease ran out (minutes). It
    is given up on: the worker is told again to let it go."""
    limits = SchedulerLimits(heartbeat_timeout_s=TIMEOUT_S, reserve_timeout_s=1.0,
                             max_queue_time_s=2.0)  # fmt: skip
    core = ClusterScheduler(limits)
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode"), 0.0)
    assert sent(core.on_submit(b"G", submit("r"), 0.0), wire.Reserve)
    full = wire.Heartbeat(peer_id="d", num_waiting=0, num_running=0, num_free_blocks=0,
                          num_total_blocks=100, steps_completed=0, sent_at=0.0,
                          request_ids=["r"])  # fmt: skip
    core.on_heartbeat(b"D", full, 0.5)  # (no room left there: it stays queued once requeued)
    out = core.tick(1.1)  # the reservation timed out: back to the queue
    assert [o.message.reason for o in sent(out, wire.Cancel)] == ["timed out"]  # (lost)
    assert core.requests["r"].phase == Phase.QUEUED
    core.on_heartbeat(b"D", full, 1.5)
    core.on_heartbeat(b"P", wire.Heartbeat(peer_id="p", num_waiting=0, num_running=0,
                                           num_free_blocks=100, num_total_blocks=100,
                                           steps_completed=0, sent_at=0.0), 1.5)  # fmt: skip
    out = core.tick(2.1)  # timed out in the queue
    assert [d.finish_reason for o in sent(out, wire.Tokens) for d in o.message.deltas] == [
        "timeout"
    ]
    (cancel,) = sent(core.on_heartbeat(b"D", full, 2.5), wire.Cancel)
    assert cancel.message.request_id == "r" and cancel.message.reason == "abandoned"
    assert not core.adopted.holds("r") and "r" not in core.registry.get("d").request_ids
