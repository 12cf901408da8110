"""The scheduler's pure core, driven by hand-made messages and a hand-held clock."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys

import pytest

from services.scheduler.core import (
    MAX_ABANDONED,
    ClusterScheduler,
    Phase,
    SchedulerLimits,
)
from shared import wire


def hello(
    peer_id: str, role: str, blocks: int = 100, address: str | None = None, seats: int = 8
) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=peer_id,
        model="m",
        address=address or (f"ipc://{peer_id}" if role != "prefill" else None),
        num_kv_blocks=0 if role == "gateway" else blocks,
        block_size=0 if role == "gateway" else 16,
        max_num_seqs=0 if role == "gateway" else seats,
    )


def submit(request_id: str, prompt_len: int = 20, max_tokens: int = 8) -> wire.Submit:
    return wire.Submit(
        request_id=request_id,
        prompt_token_ids=[5] * prompt_len,
        sampling=wire.SamplingSpec(max_tokens=max_tokens),
        tenant="t",
        priority=0,
        gateway_peer_id="g",
        arrival_time=0.0,
    )


def heartbeat(peer_id: str, free: int = 100) -> wire.Heartbeat:
    return wire.Heartbeat(
        peer_id=peer_id,
        num_waiting=0,
        num_running=0,
        num_free_blocks=free,
        num_total_blocks=100,
        steps_completed=0,
        sent_at=0.0,
    )


def sent(outgoing, kind):
    return [o for o in outgoing if isinstance(o.message, kind)]


@pytest.fixture
def core() -> ClusterScheduler:
    c = ClusterScheduler(
        SchedulerLimits(max_queued_requests=4, max_queued_tokens=1000, heartbeat_timeout_s=3.0)
    )
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode"), 0.0)
    return c


def run_to_decoding(core: ClusterScheduler, request_id: str, now: float = 0.0):
    out = core.on_submit(b"G", submit(request_id), now)
    (reserve,) = sent(out, wire.Reserve)
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id=request_id, ok=True, num_free_blocks=90), now
    )
    (job,) = sent(out, wire.PrefillJob)
    assert job.message.decode_peer_id == "d" and job.message.gateway_address == "ipc://g"
    core.on_request_done(
        wire.RequestDone(
            request_id=request_id,
            peer_id="p",
            phase="prefill",
            finish_reason=None,
            num_prompt_tokens=20,
            num_output_tokens=1,
        ),
        now,
    )
    assert core.requests[request_id].phase == Phase.DECODING


def test_request_goes_reserve_prefill_decode_done(core):
    run_to_decoding(core, "r1")
    core.on_request_done(
        wire.RequestDone(
            request_id="r1",
            peer_id="d",
            phase="decode",
            finish_reason="length",
            num_prompt_tokens=20,
            num_output_tokens=8,
        ),
        1.0,
    )
    assert not core.requests and not core.registry.get("d").request_ids


def test_a_free_block_count_is_read_within_the_workers_pool(core):
    """A report past the pool (a broken worker) would have more placed on it than it holds."""
    core.on_heartbeat(b"D", heartbeat("d", free=wire.MAX_COUNT), 0.0)
    assert core.registry.get("d").num_free_blocks == 100  # its HELLO's pool
    core.on_heartbeat(b"D", heartbeat("d", free=40), 0.0)
    assert core.registry.get("d").num_free_blocks == 40


def test_no_worker_answers_503():
    c = ClusterScheduler(SchedulerLimits())
    out = c.on_submit(b"G", submit("r"), 0.0)
    assert out[0].message.status_code == 503 and out[0].message.retry_after_s


def test_full_queue_answers_429_before_any_work(core):
    # Without a decode reply nothing leaves RESERVING; the decode worker has room for only 1.
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)
    replies = [core.on_submit(b"G", submit(f"r{i}"), 0.0)[0].message for i in range(6)]
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 200, 429]
    assert replies[-1].retry_after_s is not None


def test_queued_batch_lines_never_get_a_chat_refused(core):
    """Batch lines wait in the queue by design (a job keeps its window of lines there): they
    counted against the queue's bounds, so a few jobs filled it and every chat was refused 429.
    Each class is bounded by its own queued requests; a line by everything queued, as it takes
    only spare room."""
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)  # one in RESERVING, the rest queue
    lines = [dataclasses.replace(submit(f"b{i}"), bulk=True) for i in range(6)]
    assert [core.on_submit(b"G", s, 0.0)[0].message.status_code for s in lines] == [
        200, 200, 200, 200, 200, 429
    ]  # fmt: skip
    replies = [core.on_submit(b"G", submit(f"q{i}"), 0.0)[0].message for i in range(5)]
    assert [r.status_code for r in replies] == [200, 200, 200, 200, 429]
    line = core.on_submit(b"G", dataclasses.replace(submit("b9"), bulk=True), 0.0)[0].message
    assert line.status_code == 429


def test_a_prompt_more_than_the_queue_holds_answers_400_not_429(core):
    """Over max_queued_tokens on its own, a prompt waits for no queue to drain: a 429 (retry
    in 1 s) was answered for ever."""
    reply = core.on_submit(b"G", submit("long", prompt_len=1200, max_tokens=1), 0.0)[0].message
    assert reply.status_code == 400 and "max_queued_tokens" in reply.message


def test_prompt_that_never_fits_answers_400(core):
    reply = core.on_submit(b"G", submit("big", prompt_len=100 * 16, max_tokens=1), 0.0)[0].message
    assert reply.status_code == 400 and "never fit" in reply.message


def test_a_prompt_past_every_prefill_workers_cache_answers_400():
    """A prefill worker refuses a prompt its KV cache cannot hold (and a job it refuses can
    never run): admitted because a decode worker held it, the request failed as a 500 after
    its wait in the queue. The client's request is what is wrong: 400 at once."""
    c = ClusterScheduler(SchedulerLimits())
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill", blocks=4), 0.0)  # 64 tokens
    c.on_hello(b"D", hello("d", "decode", blocks=100), 0.0)
    reply = c.on_submit(b"G", submit("long", prompt_len=100, max_tokens=1), 0.0)[0].message
    assert reply.status_code == 400 and "prefill" in reply.message and "64" in reply.message
    assert c.on_submit(b"G", submit("fits", prompt_len=60, max_tokens=1), 0.0)[0].message.accepted


def test_a_prompt_only_the_larger_prefill_workers_hold_goes_to_one_of_them():
    """Prefill workers of two sizes: a prompt past the smaller's cache waits for a larger one,
    never placed where it would be refused; a short one goes to the smaller meanwhile."""
    c = ClusterScheduler(SchedulerLimits(prefill_window_tokens=128))
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"S", hello("small", "prefill", blocks=4), 0.0)  # 64 tokens
    c.on_hello(b"B", hello("big", "prefill", blocks=100), 0.0)
    c.on_hello(b"D", hello("d", "decode", blocks=100, seats=8), 0.0)
    c.on_submit(b"G", submit("first", prompt_len=100, max_tokens=1), 0.0)
    assert c.requests["first"].prefill_peer_id == "big"
    c.on_submit(b"G", submit("second", prompt_len=100, max_tokens=1), 0.0)
    assert c.requests["second"].phase == Phase.QUEUED  # the big window is full, not the small
    c.on_submit(b"G", submit("short", prompt_len=20, max_tokens=1), 0.0)
    assert c.requests["short"].prefill_peer_id == "small"


def test_refused_reservation_requeues_and_tries_later(core):
    core.on_submit(b"G", submit("r"), 0.0)
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=False, num_free_blocks=0), 0.0
    )
    assert not sent(out, wire.Reserve)  # the worker reported no room
    assert core.requests["r"].phase == Phase.QUEUED
    out = core.on_heartbeat(b"D", heartbeat("d", free=100), 0.5)
    assert sent(out, wire.Reserve)


def lost_deltas(out) -> list[wire.TokenDelta]:
    return [d for o in sent(out, wire.Tokens) if o.identity == b"G" for d in o.message.deltas]


def resumed(request_id: str, attempt: str, outputs: list[int]) -> wire.Submit:
    return dataclasses.replace(submit(attempt), output_token_ids=outputs, resumed_from=request_id)


def test_silent_prefill_worker_gives_its_requests_back_to_the_gateway(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    core.on_hello(b"P2", hello("p2", "prefill"), 1.0)
    core.on_heartbeat(b"D", heartbeat("d"), 2.5)
    core.on_heartbeat(b"P2", heartbeat("p2"), 2.5)
    out = core.tick(3.5)  # p (holding the prefill job) has been silent for 3.5 s > 3 s
    assert core.registry.get("p") is None
    # Its first token may have reached the client: only the gateway knows, so it decides.
    (delta,) = lost_deltas(out)
    assert delta.request_id == "r" and delta.finish_reason == "lost" and "p " in delta.error
    assert [o.identity for o in sent(out, wire.Cancel)] == [b"D", b"P"]  # reservation freed
    assert "r" not in core.requests
    out = core.on_submit(b"G", resumed("r", "r~1", []), 3.6)
    assert sent(out, wire.Reserve) and core.requests["r~1"].phase == Phase.RESERVING


def test_a_worker_whose_connection_closed_leaves_within_the_grace_unless_it_beats(core):
    grace = core.limits.disconnect_grace_s
    assert grace < core.limits.heartbeat_timeout_s
    run_to_decoding(core, "r")
    core.on_hello(b"D2", hello("d2", "decode"), 0.0)
    assert core.on_connection_closed(b"G", 0.1) is None  # a gateway's: no worker marked
    assert core.on_connection_closed(b"D2", 0.1).peer_id == "d2"
    core.on_heartbeat(b"D2", heartbeat("d2"), 0.2)  # back on a new connection: forgiven
    assert core.on_connection_closed(b"D", 0.3).peer_id == "d"
    for peer in (b"P", b"D2"):
        core.on_heartbeat(peer, heartbeat(peer.decode().lower()), 0.3 + grace)
    core.tick(0.3 + grace)  # not yet past the grace
    assert core.registry.get("d") is not None
    out = core.tick(0.31 + grace)  # long before the heartbeat timeout
    assert core.registry.get("d") is None and core.registry.get("d2") is not None
    (delta,) = lost_deltas(out)  # what it held goes back to its gateway
    assert delta.request_id == "r" and delta.finish_reason == "lost"


def test_a_scheduler_just_started_holds_submits_until_its_workers_are_back():
    core = ClusterScheduler(SchedulerLimits(heartbeat_timeout_s=3.0))
    core.await_workers_until(1.5)
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    assert core.on_submit(b"G", submit("a"), 0.1) == []  # no worker yet: no 503 either
    assert core.on_submit(b"G", submit("b"), 0.2) == []
    assert core.on_submit(b"G", submit("c"), 0.2) == []
    core.on_cancel(wire.Cancel(request_id="b", reason="client gone"), 0.3)
    assert core.on_hello(b"P", hello("p", "prefill"), 0.4) == [] and core.tick(0.45) == []
    out = core.on_hello(b"D", hello("d", "decode"), 0.5)  # both back: admitted, in order
    replies = [o.message for o in sent(out, wire.SubmitReply)]
    assert [(r.request_id, r.accepted) for r in replies] == [("a", True), ("c", True)]
    assert {o.message.request_id for o in sent(out, wire.Reserve)} == {"a", "c"}
    assert len(core.awaiting_workers) == 0 and "b" not in core.requests


def test_submits_held_for_workers_that_never_come_are_refused_when_the_wait_ends():
    core = ClusterScheduler(SchedulerLimits(heartbeat_timeout_s=3.0))
    core.await_workers_until(1.5)
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)  # (a prefill worker alone serves nothing)
    assert core.on_submit(b"G", submit("a"), 0.1) == []
    assert core.tick(1.4) == []
    (reply,) = sent(core.tick(1.5), wire.SubmitReply)
    assert reply.message.status_code == 503 and "no prefill or no decode" in reply.message.message
    (late,) = sent(core.on_submit(b"G", submit("b"), 1.6), wire.SubmitReply)  # not held now
    assert late.message.status_code == 503


def test_a_core_never_told_to_wait_refuses_at_once():
    bare = ClusterScheduler(SchedulerLimits())
    bare.on_hello(b"G", hello("g", "gateway"), 0.0)
    (reply,) = sent(bare.on_submit(b"G", submit("a"), 0.0), wire.SubmitReply)
    assert reply.message.status_code == 503  # (the simulator's, and the tests')


def test_a_resumed_request_is_not_refused_for_load(core):
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)  # one in RESERVING, the rest queue
    replies = [core.on_submit(b"G", submit(f"q{i}"), 0.0)[0].message for i in range(6)]
    assert replies[-1].status_code == 429
    (reply,) = sent(core.on_submit(b"G", resumed("r", "r~1", [7]), 0.0), wire.SubmitReply)
    assert reply.message.accepted and "r~1" in core.queue


def test_a_resumed_request_is_prefilled_with_its_tokens(core):
    out = core.on_submit(b"G", resumed("r", "r~1", [7, 8, 9]), 0.0)
    (reserve,) = sent(out, wire.Reserve)
    assert reserve.message.num_tokens == 20 + 3 + 1  # prompt, its tokens, the next one
    out = core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r~1", ok=True, num_free_blocks=90), 0.0
    )
    (job,) = sent(out, wire.PrefillJob)
    assert job.message.output_token_ids == [7, 8, 9]


def test_decode_worker_lost_mid_stream_goes_back_to_the_gateway(core):
    run_to_decoding(core, "r")
    core.on_heartbeat(b"P", heartbeat("p"), 3.0)
    out = core.tick(3.5)
    (delta,) = lost_deltas(out)
    assert delta.finish_reason == "lost" and "worker d stopped responding" in delta.error
    # If d was only stalled, it stops generating for nobody.
    assert [o.identity for o in sent(out, wire.Cancel)] == [b"D"]
    assert "r" not in core.requests


def test_a_worker_saying_goodbye_leaves_rotation_at_once(core):
    """A worker stopping (SIGTERM) says GOODBYE: its requests go back to their gateways now,
    where a silent one's waited out the heartbeat timeout (10 s of stalled streams), and no
    new work goes to it. From another connection the message is not the worker's."""
    run_to_decoding(core, "r")
    assert core.on_goodbye(b"X", wire.Goodbye(peer_id="d"), 1.0) == []  # not d's connection
    assert core.registry.get("d") is not None and "r" in core.requests
    out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 1.0)
    (delta,) = lost_deltas(out)
    assert delta.finish_reason == "lost" and "worker d stopped" in delta.error
    assert core.registry.get("d") is None and "r" not in core.requests
    (reply,) = sent(core.on_submit(b"G", submit("s"), 1.0), wire.SubmitReply)
    assert reply.message.status_code == 503  # no decode worker left


def test_a_decode_worker_dropped_while_reserving_lets_the_reservation_go(core):
    """If it was only stalled, its reservation would outlive the attempt: asked again when it
    rejoined, it refused the request as a duplicate until the lease ran out."""
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_heartbeat(b"P", heartbeat("p"), 3.0)
    out = core.tick(3.5)
    assert [(o.identity, o.message.request_id) for o in sent(out, wire.Cancel)] == [(b"D", "r")]
    assert core.requests["r"].phase == Phase.QUEUED
    out = core.on_hello(b"D", hello("d", "decode"), 4.0)  # back: asked again, after the cancel
    (reserve,) = sent(out, wire.Reserve)
    assert reserve.identity == b"D" and reserve.message.request_id == "r"


def test_a_worker_that_reconnected_is_sent_to_where_it_now_listens(core):
    """A dropped and re-made connection is a new ROUTER identity: its heartbeats kept it
    registered while every RESERVE and job went to the dead connection."""
    core.on_heartbeat(b"D-again", heartbeat("d"), 1.0)
    out = core.on_submit(b"G", submit("r"), 1.0)
    (reserve,) = sent(out, wire.Reserve)
    assert reserve.identity == b"D-again"


def test_a_prefill_job_its_worker_never_got_goes_back_in_two_heartbeats(core):
    """A job dropped on its way (a reset connection) waited out the prefill timeout (300 s)
    while the worker's heartbeats said it held nothing."""
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    assert core.requests["r"].phase == Phase.PREFILLING
    core.on_heartbeat(b"P", heartbeat("p"), 0.5)  # sent before the job arrived: allowed for
    assert core.requests["r"].phase == Phase.PREFILLING
    out = core.on_heartbeat(b"P", heartbeat("p"), 1.0)
    (delta,) = lost_deltas(out)
    assert delta.request_id == "r" and "no longer holds it" in delta.error
    assert not core.registry.get("p").request_ids and not core.registry.get("d").request_ids


def test_only_heartbeats_in_a_row_that_leave_a_request_out_lose_it(core):
    """One stale heartbeat, then ones that list it, then one more stale: two in all, not in a
    row (the count never started again, and lost the request)."""
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    listed = dataclasses.replace(heartbeat("p"), request_ids=["r"])
    for beat, held in enumerate([heartbeat("p"), listed, listed, heartbeat("p"), listed]):
        assert lost_deltas(core.on_heartbeat(b"P", held, 0.5 * (beat + 1))) == []
    assert core.requests["r"].phase == Phase.PREFILLING


def test_a_prefill_job_its_worker_lists_is_left_alone(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    core.on_heartbeat(b"P", heartbeat("p"), 0.5)  # one stale beat, then it holds it
    for beat in range(1, 5):
        listed = dataclasses.replace(heartbeat("p"), request_ids=["r"])
        assert lost_deltas(core.on_heartbeat(b"P", listed, 0.5 + beat)) == []
    core.on_request_done(
        wire.RequestDone(request_id="r", peer_id="p", phase="prefill", finish_reason=None,
                         num_prompt_tokens=20, num_output_tokens=1), 5.0)  # fmt: skip
    core.on_heartbeat(b"D", heartbeat("d"), 6.0)  # one stale decode beat: not yet lost
    assert core.requests["r"].phase == Phase.DECODING


def test_late_joining_worker_is_used_at_once():
    c = ClusterScheduler(SchedulerLimits())
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode", blocks=1), 0.0)
    c.on_submit(b"G", submit("fits", prompt_len=10, max_tokens=4), 0.0)
    c.on_submit(b"G", submit("waits", prompt_len=10, max_tokens=4), 0.0)
    assert c.requests["waits"].phase == Phase.QUEUED  # d's only block is promised
    out = c.on_hello(b"D2", hello("d2", "decode"), 1.0)
    (reserve,) = sent(out, wire.Reserve)
    assert reserve.identity == b"D2" and reserve.message.request_id == "waits"


def test_transfer_failure_reroutes(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    out = core.on_request_done(
        wire.RequestDone(
            request_id="r",
            peer_id="p",
            phase="prefill",
            finish_reason="error",
            num_prompt_tokens=20,
            num_output_tokens=1,
        ),
        1.0,
    )
    assert [o.identity for o in sent(out, wire.Cancel)] == [b"P", b"D"]  # both let go
    (delta,) = lost_deltas(out)  # its first token went out: the gateway resumes it
    assert delta.finish_reason == "lost" and "r" not in core.requests


def test_reservation_timeout_requeues(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_heartbeat(b"D", heartbeat("d"), 5.0)
    core.on_heartbeat(b"P", heartbeat("p"), 5.0)
    out = core.tick(5.5)  # reserve_timeout_s = 5
    assert sent(out, wire.Cancel) and sent(out, wire.Reserve)


@pytest.mark.parametrize("late_ok", [True, False])
def test_a_late_answer_from_a_worker_passed_over_is_dropped(core, late_ok):
    """After a reservation timed out on d and went to d2, d's late answer was taken for d2's:
    a yes sent the prefill to d2 with d's cached blocks (d2 then refused the KV), a no requeued
    the request and left d2's reservation behind."""
    core.on_hello(b"D2", hello("d2", "decode"), 0.0)
    out = core.on_submit(b"G", submit("r"), 0.0)
    (first,) = sent(out, wire.Reserve)
    passed_over = "d" if first.identity == b"D" else "d2"
    for identity, peer in ((b"D", "d"), (b"D2", "d2"), (b"P", "p")):
        core.on_heartbeat(identity, heartbeat(peer, free=100 if peer != passed_over else 0), 5.0)
    out = core.tick(5.5)  # reserve_timeout_s = 5
    (again,) = sent(out, wire.Reserve)
    assert again.identity != first.identity
    late = wire.ReserveReply(request_id="r", peer_id=passed_over, ok=late_ok, num_free_blocks=90)
    assert core.on_reserve_reply(late, 5.6) == []
    assert core.requests["r"].phase == Phase.RESERVING
    chosen = "d2" if passed_over == "d" else "d"
    answer = wire.ReserveReply(request_id="r", peer_id=chosen, ok=True, num_free_blocks=90)
    (job,) = sent(core.on_reserve_reply(answer, 5.7), wire.PrefillJob)
    assert job.message.decode_peer_id == chosen


@pytest.mark.parametrize("late_ok", [True, False])
def test_a_late_answer_to_the_same_workers_earlier_reservation_is_dropped(core, late_ok):
    """The one decode worker, asked again after its reservation timed out, answers both: its
    answer to the first was taken for the second's (a no requeued the request and left the
    second reservation held with no cancel; a yes sent the prefill to a reservation let go)."""
    out = core.on_submit(b"G", submit("r"), 0.0)
    (first,) = sent(out, wire.Reserve)
    for identity, peer in ((b"D", "d"), (b"P", "p")):
        core.on_heartbeat(identity, heartbeat(peer), 5.0)
    (again,) = sent(core.tick(5.5), wire.Reserve)  # reserve_timeout_s = 5: d asked again
    assert again.identity == first.identity == b"D"
    assert (first.message.attempt, again.message.attempt) == (1, 2)
    late = wire.ReserveReply(request_id="r", peer_id="d", ok=late_ok, num_free_blocks=90,
                             attempt=1)  # fmt: skip
    assert core.on_reserve_reply(late, 5.6) == []
    assert core.requests["r"].phase == Phase.RESERVING
    answer = wire.ReserveReply(request_id="r", peer_id="d", ok=True, num_free_blocks=90,
                               attempt=2)  # fmt: skip
    (job,) = sent(core.on_reserve_reply(answer, 5.7), wire.PrefillJob)
    assert job.message.decode_peer_id == "d"


@pytest.mark.parametrize("phase_steps", [0, 1, 2])
def test_cancel_reaches_every_party(core, phase_steps):
    core.on_submit(b"G", submit("r"), 0.0)
    if phase_steps >= 1:
        core.on_reserve_reply(
            wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
        )
    out = core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)
    targets = {o.identity for o in sent(out, wire.Cancel)}
    assert targets == ({b"D", b"P"} if phase_steps >= 1 else {b"D"})
    assert "r" not in core.requests
    assert not core.registry.get("d").request_ids and not core.registry.get("p").request_ids


def test_cancel_of_queued_request_frees_its_queue_slot(core):
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)
    core.on_submit(b"G", submit("first"), 0.0)  # takes the only seat: nothing more dispatches
    core.on_submit(b"G", submit("r"), 0.0)
    assert core.queue and core.num_queued_tokens == 20
    assert core.on_cancel(wire.Cancel(request_id="r", reason="x"), 0.0) == []
    assert not core.queue and core.num_queued_tokens == 0


def test_heartbeat_from_unknown_peer_asks_it_to_register_again(core):
    (out,) = core.on_heartbeat(b"Q", heartbeat("stranger"), 0.0)
    assert out.identity == b"Q" and out.message.error == wire.UNKNOWN_PEER
    assert not out.message.accepted


def test_stale_prefill_report_from_an_abandoned_attempt_is_ignored(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    core.on_heartbeat(b"D", heartbeat("d"), 3.0)
    core.tick(3.5)  # p is dropped; the gateway gets r back
    core.on_hello(b"P", hello("p", "prefill"), 4.0)  # p comes back
    core.on_submit(b"G", resumed("r", "r~1", []), 4.0)  # and gets r~1
    assert core.requests["r~1"].phase == Phase.RESERVING
    stale = wire.RequestDone(
        request_id="r",
        peer_id="p",
        phase="prefill",
        finish_reason="error",
        num_prompt_tokens=20,
        num_output_tokens=1,
    )
    assert core.on_request_done(stale, 4.1) == []
    assert core.requests["r~1"].phase == Phase.RESERVING


def busy_heartbeat(peer_id: str, steps: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        peer_id=peer_id, num_waiting=1, num_running=1, num_free_blocks=100,
        num_total_blocks=100, steps_completed=steps, sent_at=0.0,
    )  # fmt: skip


def test_worker_busy_without_progress_is_unhealthy_until_it_moves_again():
    c = ClusterScheduler(SchedulerLimits(progress_timeout_s=5.0, heartbeat_timeout_s=100.0))
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode"), 0.0)
    c.on_heartbeat(b"D", busy_heartbeat("d", steps=10), 1.0)
    for t in (2.0, 4.0, 7.0):  # heartbeats keep coming, the step count does not move
        c.on_heartbeat(b"D", busy_heartbeat("d", steps=10), t)
    status = c.cluster_status(7.0)
    assert status.num_decode == 0 and status.num_prefill == 1
    reply = c.on_submit(b"G", submit("r"), 7.0)[0].message
    assert reply.status_code == 503 and "making progress" in reply.message
    c.on_heartbeat(b"D", busy_heartbeat("d", steps=11), 8.0)  # it moved: back in rotation
    assert c.cluster_status(8.0).num_decode == 1
    assert c.on_submit(b"G", submit("r"), 8.0)[0].message.accepted


def test_the_status_names_the_largest_decode_pool_of_the_workers_in_rotation():
    """The gateway caps a default max_tokens to it (a request past it is refused 400)."""
    c = ClusterScheduler(SchedulerLimits(progress_timeout_s=5.0, heartbeat_timeout_s=100.0))
    assert c.cluster_status(0.0).max_decode_pool_tokens == 0  # none yet
    c.on_hello(b"D", hello("d", "decode", blocks=100), 0.0)
    c.on_hello(b"E", hello("e", "decode", blocks=40), 0.0)
    assert c.cluster_status(0.5).max_decode_pool_tokens == 100 * 16
    for t in (1.0, 2.0, 7.0):  # d stalls: out of rotation, its pool no longer counts
        c.on_heartbeat(b"D", busy_heartbeat("d", steps=10), t)
        c.on_heartbeat(b"E", busy_heartbeat("e", steps=int(t)), t)
    assert c.cluster_status(7.0).max_decode_pool_tokens == 40 * 16


def test_a_request_only_a_stalled_decode_worker_can_hold_answers_503_not_400():
    """The big decode worker stalls: a request only it can hold was answered 400, "can never
    fit", a client error no client retries, for a worker that moves again a moment later (and a
    resumed request was failed for good). It is 503 with Retry-After, as with no worker at all;
    past every registered worker's cache it is still 400."""
    c = ClusterScheduler(SchedulerLimits(progress_timeout_s=5.0, heartbeat_timeout_s=100.0))
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"S", hello("small", "decode", blocks=10), 0.0)  # 160 tokens
    c.on_hello(b"D", hello("d", "decode"), 0.0)  # 1,600 tokens
    for t in (1.0, 7.0):  # busy, the step count standing still: stalled
        c.on_heartbeat(b"D", busy_heartbeat("d", steps=10), t)
    reply = c.on_submit(b"G", submit("r", prompt_len=500), 7.0)[0].message
    assert reply.status_code == 503 and reply.retry_after_s
    assert "not making progress" in reply.message and "1600 tokens" in reply.message
    reply = c.on_submit(b"G", submit("r", prompt_len=2000), 7.0)[0].message
    assert reply.status_code == 400 and "never fit" in reply.message
    c.on_heartbeat(b"D", busy_heartbeat("d", steps=11), 8.0)  # it moved: the request fits
    assert c.on_submit(b"G", submit("r", prompt_len=500), 8.0)[0].message.accepted


def test_idle_worker_is_healthy_however_long_it_waits(core):
    for t in (10.0, 100.0, 1000.0):
        core.on_heartbeat(b"D", heartbeat("d"), t)
        core.on_heartbeat(b"P", heartbeat("p"), t)
    assert core.cluster_status(1000.0).num_decode == 1


def test_a_request_queued_past_the_limit_gets_a_timeout():
    c = ClusterScheduler(SchedulerLimits(max_queue_time_s=5.0, heartbeat_timeout_s=100.0))
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode", seats=1), 0.0)
    c.on_submit(b"G", submit("first"), 0.0)  # holds the only decode slot (never confirmed)
    c.requests["first"].phase_deadline = float("inf")
    c.on_submit(b"G", submit("r"), 0.0)
    assert c.tick(4.0) == [] and c.requests["r"].phase == Phase.QUEUED
    out = c.tick(5.5)
    (tokens,) = sent(out, wire.Tokens)
    (delta,) = tokens.message.deltas
    assert tokens.identity == b"G" and delta.finish_reason == "timeout"
    assert "queued 6 s" in delta.error and "max_queue_time_s 5" in delta.error
    assert "r" not in c.requests and "r" not in c.queue and c.num_queued_tokens == 0


def test_a_worker_still_holding_an_abandoned_request_is_told_again(core):
    run_to_decoding(core, "r")
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)  # that cancel is lost
    held = dataclasses.replace(heartbeat("d"), request_ids=["r", "unknown-to-me"])
    out = core.on_heartbeat(b"D", held, 2.0)
    (cancel,) = sent(out, wire.Cancel)
    assert cancel.identity == b"D" and cancel.message.request_id == "r"
    assert cancel.message.reason == "abandoned"  # "unknown-to-me" may be a restart's survivor
    run_to_decoding(core, "s", now=3.0)
    live = dataclasses.replace(heartbeat("d"), request_ids=["s"])
    assert not sent(core.on_heartbeat(b"D", live, 4.0), wire.Cancel)  # a live one is left alone


def test_the_memory_of_abandoned_requests_is_bounded_and_forgets_the_oldest_first(core):
    run_to_decoding(core, "r")
    core.on_cancel(wire.Cancel(request_id="r", reason="client gone"), 1.0)
    for number in range(MAX_ABANDONED - 1):  # (the one way in: a real life is too slow here)
        core._abandon(f"x{number}")
    core._abandon("r")  # given up on again: it keeps its place, the oldest
    assert len(core.abandoned) == MAX_ABANDONED and next(iter(core.abandoned)) == "r"
    core._abandon("newest")
    assert len(core.abandoned) == MAX_ABANDONED
    assert "r" not in core.abandoned and "x0" in core.abandoned and "newest" in core.abandoned
    held = dataclasses.replace(heartbeat("d"), request_ids=["r", "x0"])
    (cancel,) = sent(core.on_heartbeat(b"D", held, 2.0), wire.Cancel)
    assert cancel.message.request_id == "x0"  # r is forgotten: its worker's word is believed


def test_a_sequence_handed_back_for_recompute_goes_to_its_gateway(core):
    run_to_decoding(core, "r")
    done = wire.RequestDone(request_id="r", peer_id="d", phase="decode",
                            finish_reason="preempted", num_prompt_tokens=20,
                            num_output_tokens=3)  # fmt: skip
    out = core.on_request_done(done, 1.0)
    (delta,) = lost_deltas(out)
    assert delta.finish_reason == "preempted" and "preempted on d" in delta.error
    assert "r" not in core.requests and not core.registry.get("d").request_ids


def test_where_a_stream_ended_goes_to_its_gateway(core):
    """The stream's last delta travels on another connection: the gateway learns the end from
    the scheduler too, so a lost one does not leave the request waiting."""
    run_to_decoding(core, "r")
    done = wire.RequestDone(request_id="r", peer_id="d", phase="decode", finish_reason="stop",
                            num_prompt_tokens=20, num_output_tokens=4,
                            output_length=5)  # fmt: skip
    (ended,) = sent(core.on_request_done(done, 1.0), wire.StreamEnded)
    assert ended.identity == b"G" and ended.message == wire.StreamEnded(
        request_id="r", finish_reason="stop", output_length=5
    )
    assert not sent(core.on_request_done(done, 1.1), wire.StreamEnded)  # once: it is forgotten


def test_a_request_over_at_its_first_token_tells_its_gateway_where_it_ended(core):
    core.on_submit(b"G", submit("r", max_tokens=1), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    done = wire.RequestDone(request_id="r", peer_id="p", phase="prefill", finish_reason="length",
                            num_prompt_tokens=20, num_output_tokens=1,
                            output_length=1)  # fmt: skip
    (ended,) = sent(core.on_request_done(done, 0.1), wire.StreamEnded)
    assert ended.message.output_length == 1 and ended.message.finish_reason == "length"


def test_no_stream_end_is_told_for_a_request_that_goes_on(core):
    core.on_submit(b"G", submit("r"), 0.0)
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90), 0.0
    )
    handed_on = wire.RequestDone(request_id="r", peer_id="p", phase="prefill",
                                 finish_reason=None, num_prompt_tokens=20,
                                 num_output_tokens=1)  # fmt: skip
    assert not sent(core.on_request_done(handed_on, 0.1), wire.StreamEnded)
    preempted = wire.RequestDone(request_id="r", peer_id="d", phase="decode",
                                 finish_reason="preempted", num_prompt_tokens=20,
                                 num_output_tokens=3)  # fmt: skip
    assert not sent(core.on_request_done(preempted, 0.2), wire.StreamEnded)


def beat(core: ClusterScheduler, held: list[str], now: float) -> list:
    return core.on_heartbeat(b"D", dataclasses.replace(heartbeat("d"), request_ids=held), now)


def test_a_decoding_request_its_worker_stops_listing_goes_back_to_its_gateway(core):
    """Its REQUEST_DONE was lost (a reset connection): held here it would take a seat and count
    as in flight forever. One heartbeat may be stale (sent before the worker took the KV)."""
    run_to_decoding(core, "r")
    assert not lost_deltas(beat(core, [], 1.0))
    out = beat(core, [], 2.0)
    (delta,) = lost_deltas(out)
    assert delta.request_id == "r" and delta.finish_reason == "lost"
    assert "d no longer holds it" in delta.error
    assert "r" not in core.requests and not core.registry.get("d").request_ids


def test_a_listed_request_or_a_reservation_is_left_alone(core):
    run_to_decoding(core, "r")
    core.on_submit(b"G", submit("s"), 0.5)  # reserving on d: the RESERVE may not be there yet
    for t in (1.0, 2.0, 3.0):
        assert not lost_deltas(beat(core, ["r"], t))
    assert core.requests["r"].phase == Phase.DECODING and "s" in core.requests


def test_a_full_list_of_held_ids_proves_nothing_missing(core):
    """A worker holding more than a heartbeat carries lists only the first ones."""
    run_to_decoding(core, "r")
    full = [f"other-{i}" for i in range(wire.MAX_HELD_IDS)]
    for t in (1.0, 2.0, 3.0):
        assert not lost_deltas(beat(core, full, t))
    assert core.requests["r"].phase == Phase.DECODING


# -- speculative prefill ---------------------------------------------------------------------


def busy(core: ClusterScheduler, peer_id: str = "d", identity: bytes = b"D") -> None:
    """The decode worker reports a running batch: its answers wait for a step."""
    core.on_heartbeat(identity, dataclasses.replace(heartbeat(peer_id), num_running=3), 0.0)


def test_a_busy_decode_workers_reservation_and_the_prefill_go_out_together(core):
    busy(core)
    out = core.on_submit(b"G", submit("r"), 0.0)
    (reserve,) = sent(out, wire.Reserve)
    (job,) = sent(out, wire.PrefillJob)
    assert reserve.identity == b"D" and job.identity == b"P"
    assert job.message.await_grant and job.message.num_skip_blocks == 0
    assert core.requests["r"].phase == Phase.RESERVING and core.take_dispatched()[0].speculative
    reply = wire.ReserveReply(
        peer_id="d", request_id="r", ok=True, num_free_blocks=90, num_cached_blocks=1
    )
    (grant,) = core.on_reserve_reply(reply, 0.0)
    assert grant.identity == b"P" and grant.message == wire.PrefillGrant(
        request_id="r", num_skip_blocks=1
    )
    assert core.requests["r"].phase == Phase.PREFILLING


def test_an_idle_decode_worker_answers_first(core):
    out = core.on_submit(b"G", submit("r"), 0.0)
    assert sent(out, wire.Reserve) and not sent(out, wire.PrefillJob)
    assert not core.take_dispatched()[0].speculative


def test_speculation_is_off_when_asked():
    core = ClusterScheduler(SchedulerLimits(speculative_prefill=False))
    for identity, peer, role in ((b"G", "g", "gateway"), (b"P", "p", "prefill"),
                                 (b"D", "d", "decode")):  # fmt: skip
        core.on_hello(identity, hello(peer, role), 0.0)
    busy(core)
    assert not sent(core.on_submit(b"G", submit("r"), 0.0), wire.PrefillJob)


def test_no_speculation_without_room_to_spare(core):
    full = dataclasses.replace(heartbeat("d", free=3), num_running=3)  # 3 blocks; it needs 2
    core.on_heartbeat(b"D", full, 0.0)
    assert not sent(core.on_submit(b"G", submit("r"), 0.0), wire.PrefillJob)


@pytest.mark.parametrize("how", ["refused", "timed out", "prefill worker lost"])
def test_a_speculative_request_that_cannot_go_on_goes_back_to_its_gateway(core, how):
    """Its first token may have reached the client: the gateway resumes it, the queue never
    sees it again (which would send that token twice)."""
    busy(core)
    core.on_submit(b"G", submit("r"), 0.0)
    if how == "refused":
        reply = wire.ReserveReply(peer_id="d", request_id="r", ok=False, num_free_blocks=0)
        out = core.on_reserve_reply(reply, 0.5)
    elif how == "timed out":  # both workers alive, the reservation's answer lost
        later = core.limits.reserve_timeout_s + 1
        core.on_heartbeat(b"P", heartbeat("p"), later)
        core.on_heartbeat(b"D", dataclasses.replace(heartbeat("d"), num_running=3), later)
        out = core.tick(later)
    else:
        for t in (1.0, 2.0, 3.0, 4.0):  # the decode worker beats on, the prefill worker is silent
            core.on_heartbeat(b"D", dataclasses.replace(heartbeat("d"), num_running=3), t)
        out = core.tick(4.0)
    (delta,) = lost_deltas(out)
    assert delta.request_id == "r" and delta.finish_reason == "lost"
    assert "r" not in core.requests and len(core.queue) == 0
    cancelled = {o.identity for o in sent(out, wire.Cancel)}
    assert b"P" in cancelled  # the prefill worker drops its parked KV
    assert not core.registry.get("d").request_ids


def test_a_speculative_request_done_at_its_first_token_frees_its_reservation(core):
    busy(core)
    core.on_submit(b"G", submit("r", max_tokens=1), 0.0)
    done = wire.RequestDone(request_id="r", peer_id="p", phase="prefill", finish_reason="length",
                            num_prompt_tokens=20, num_output_tokens=1)  # fmt: skip
    out = core.on_request_done(done, 0.1)
    assert b"D" in {o.identity for o in sent(out, wire.Cancel)} and "r" not in core.requests
    late = wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=90)
    assert core.on_reserve_reply(late, 0.2) == []  # the reservation's answer comes too late


def raising_for(core: ClusterScheduler, name: str, request_id: str) -> None:
    """The core's `name` (a method taking the request first) raises for `request_id`, a bug
    that request alone hits, and works for every other."""
    real = getattr(core, name)

    def method(request, *args, **kwargs):
        if request.request_id == request_id:
            raise RuntimeError("injected")
        return real(request, *args, **kwargs)

    setattr(core, name, method)


def test_a_dead_workers_other_requests_go_back_past_one_that_raises(core):
    """The worker is out of the registry once dropped: a request of its left unhandled would
    wait for nobody until its gateway's limit (an hour, decoding). So when handing one back
    raises, the others still go back to their gateways, and the error is raised after."""
    for request_id in ("a", "b"):
        run_to_decoding(core, request_id)
    poison, other = list(core.registry.get("d").request_ids)  # the first handled raises
    raising_for(core, "_lose", poison)
    core.on_heartbeat(b"P", heartbeat("p"), 3.0)  # d is silent from here
    with pytest.raises(RuntimeError, match="injected"):
        core.tick(3.5)
    out = core.take_outbox()  # what the service sends when a handler raised
    assert [d.request_id for d in lost_deltas(out)] == [other]
    assert [o.message.request_id for o in sent(out, wire.Cancel)] == [other]
    assert other not in core.requests and core.registry.get("d") is None


def test_the_ticks_other_due_requests_are_settled_past_one_that_raises(core):
    """The tick takes every due deadline off its heap before settling them: one left unsettled
    would never be looked at again. Past one whose requeue raises, the others go back to the
    queue (and are dispatched again at the next pass)."""
    for request_id in ("a", "b"):
        core.on_submit(b"G", submit(request_id), 0.0)
    assert [core.requests[r].phase for r in "ab"] == [Phase.RESERVING] * 2
    core.on_heartbeat(b"D", heartbeat("d"), 5.0)
    core.on_heartbeat(b"P", heartbeat("p"), 5.0)
    raising_for(core, "_requeue", "a")
    with pytest.raises(RuntimeError, match="injected"):
        core.tick(5.5)  # reserve_timeout_s = 5: both are due
    out = core.take_outbox()
    assert [(o.identity, o.message.request_id) for o in sent(out, wire.Cancel)] == [(b"D", "b")]
    assert core.requests["b"].phase == Phase.QUEUED
    (reserve,) = sent(core.dispatch(5.6), wire.Reserve)
    assert reserve.message.request_id == "b"


def failed_deltas(out) -> list[wire.TokenDelta]:
    return [d for d in lost_deltas(out) if d.finish_reason == "error"]


def test_a_request_whose_placement_raises_fails_and_the_pass_stops_there(core):
    """Out of the queue, a request whose placement raised would wait for nobody (QUEUED, in no
    queue) until its gateway gave up on it. It fails to its gateway instead; the pass stops at
    it (a bug every request hits fails one a pass), and the rest are placed by the next."""
    core.on_heartbeat(b"D", heartbeat("d", free=0), 0.0)  # no room: both wait in the queue
    for request_id in ("a", "b"):
        core.on_submit(b"G", submit(request_id), 0.1)
    raising_for(core, "_reserve", "a")
    out = core.on_heartbeat(b"D", heartbeat("d"), 0.2)
    [(request_id, error)] = core.take_placement_failures()
    assert request_id == "a" and str(error) == "injected"
    (delta,) = failed_deltas(out)
    assert delta.request_id == "a" and "failed to place" in delta.error
    assert "RuntimeError" in delta.error and not sent(out, wire.Reserve)
    assert "a" not in core.requests and not core.take_dispatched()
    assert core.requests["b"].phase == Phase.QUEUED and len(core.queue) == 1
    assert core.num_queued_tokens == 20  # b's alone
    (reserve,) = sent(core.dispatch(0.3), wire.Reserve)
    assert reserve.message.request_id == "b" and core.num_queued_tokens == 0


def test_when_a_placement_raises_midway_it_is_undone_on_the_workers(core):
    """Raised after its reservation went out: the decode worker hears a cancel, both workers'
    room comes back, and the SUBMIT that began the pass stands (accepted, then failed)."""
    raising_for(core, "_speculates", "a")  # after the RESERVE is built, before the log
    out = core.on_submit(b"G", submit("a"), 0.0)
    assert [request_id for request_id, _ in core.take_placement_failures()] == ["a"]
    assert [type(o.message) for o in out] == [
        wire.SubmitReply,
        wire.Reserve,
        wire.Cancel,
        wire.Tokens,
    ]
    assert out[0].message.accepted and out[2].identity == b"D"
    assert [d.request_id for d in failed_deltas(out)] == ["a"]
    assert not core.registry.get("d").request_ids and not core.registry.get("p").request_ids
    assert core.registry.held_tokens(core.registry.get("p")) == 0 and core.num_queued_tokens == 0
    assert not core.requests and not core.take_dispatched()
    run_to_decoding(core, "b")  # the next request goes its whole way


_GOODBYE_ORDER = """
from tests.unit.test_scheduler_core import hello, run_to_decoding, lost_deltas
from services.scheduler.core import ClusterScheduler, SchedulerLimits
from shared import wire

core = ClusterScheduler(SchedulerLimits(max_queued_requests=64))
core.on_hello(b"G", hello("g", "gateway"), 0.0)
core.on_hello(b"P", hello("p", "prefill"), 0.0)
core.on_hello(b"D", hello("d", "decode", seats=64), 0.0)
for i in range(12):
    run_to_decoding(core, f"request-{i}")
out = core.on_goodbye(b"D", wire.Goodbye(peer_id="d"), 1.0)
print(",".join(delta.request_id for delta in lost_deltas(out)))
"""


def test_a_lost_workers_requests_go_back_in_the_same_order_whatever_the_string_hashing():
    """They were taken in a set's order, which follows the process's string hashing: a
    simulation that loses a worker re-routed them differently from run to run."""
    orders = set()
    for seed in ("1", "2", "3"):
        environ = dict(os.environ, PYTHONHASHSEED=seed)
        ran = subprocess.run(
            [sys.executable, "-c", _GOODBYE_ORDER],
            capture_output=True,
            text=True,
            env=environ,
            check=True,
        )
        orders.add(ran.stdout.strip())
    assert len(orders) == 1 and len(orders.pop().split(",")) == 12


def test_an_empty_prompt_answers_400_even_when_the_wait_forecast_runs(core):
    """A prefill computes the logits of a prompt's last token: an empty prompt has none. It was
    admitted, and with a deadline, a backlog whose first tokens all came out (nothing in hand)
    and no prefill rate measured, the forecast's pace was 0 tokens/s: the SUBMIT raised
    ZeroDivisionError, which ends the scheduler's loop and every request in it."""
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)
    run_to_decoding(core, "r0")  # the only seat decodes: what comes next is queued
    core.on_submit(b"G", submit("q"), 0.0)
    core.on_heartbeat(b"P", heartbeat("p"), 2.5)
    core.on_heartbeat(b"D", dataclasses.replace(heartbeat("d"), request_ids=["r0"]), 2.5)
    core.tick(5.0)  # a backlog of 5 s with no first token
    empty = dataclasses.replace(submit("e", prompt_len=0), first_token_deadline_s=1.0)
    (reply,) = sent(core.on_submit(b"G", empty, 5.0), wire.SubmitReply)
    assert reply.message.status_code == 400 and "empty" in reply.message.message
    (reply,) = sent(core.on_submit(b"G", submit("f", prompt_len=0), 5.0), wire.SubmitReply)
    assert reply.message.status_code == 400  # without a deadline too: no prefill could run it


@pytest.mark.parametrize(
    "name, value",
    [
        ("reserve_timeout_s", float("nan")),  # a NaN deadline atop the heap stopped every other
        ("prefill_timeout_s", 0.0),
        ("heartbeat_timeout_s", -1.0),
        ("progress_timeout_s", float("nan")),
        ("max_queue_time_s", float("nan")),
        ("retry_after_s", 0.0),  # Retry-After 0, negative, NaN or endless: a retry storm or none
        ("retry_after_s", float("nan")),
        ("retry_after_s", float("inf")),
        ("max_queued_requests", 0),  # every request refused 429 for ever
        ("max_queued_tokens", 0),
        ("prefill_window_tokens", 0),
        ("local_prefill_max_tokens", -1),
    ],
)
def test_limits_that_would_break_the_core_are_refused_by_name(name, value):
    """The service checks its settings, but the core is also built from limits by hand (the
    planner's simulator, the load tools): the limits hold the rule, as they do for the shares."""
    with pytest.raises(ValueError, match=name):
        SchedulerLimits(**{name: value})


def test_limits_at_their_edges_are_accepted():
    SchedulerLimits(
        max_queued_requests=1,
        max_queued_tokens=1,
        prefill_window_tokens=1,
        local_prefill_max_tokens=0,  # never prefill on the decode worker
        heartbeat_timeout_s=math.inf,  # (timeouts may be endless: never)
        max_queue_time_s=math.inf,
    )
