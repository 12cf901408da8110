"""A gateway gone (its process died): its requests are called off wherever they stand, queued or
placed, and it is forgotten. They ran to `max_tokens` for nobody: their tokens went to a
stream address no one read. The core's part here; the service's (a gateway unreachable for a
heartbeat timeout is gone) in tests/integration/test_scheduler_gateway_gone.py."""

from __future__ import annotations

import dataclasses

from services.scheduler.core import MAX_GONE_GATEWAYS, ClusterScheduler, Phase, SchedulerLimits
from shared import wire
from tests.unit.test_scheduler_core import hello, sent, submit


def submit_from(gateway: str, request_id: str) -> wire.Submit:
    return dataclasses.replace(submit(request_id), gateway_peer_id=gateway)


def with_workers(core: ClusterScheduler) -> ClusterScheduler:
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode", seats=1), 0.0)
    return core


def test_a_gone_gateways_requests_are_called_off_where_they_stand_and_others_go_on():
    core = ClusterScheduler(SchedulerLimits(heartbeat_timeout_s=3.0))
    for identity, peer_id, role in ((b"G", "g", "gateway"), (b"H", "h", "gateway"),
                                    (b"P", "p", "prefill")):  # fmt: skip
        core.on_hello(identity, hello(peer_id, role), 0.0)
    core.on_hello(b"D", hello("d", "decode", seats=2), 0.0)
    core.on_submit(b"G", submit_from("g", "prefilling"), 0.0)
    reply = wire.ReserveReply(request_id="prefilling", peer_id="d", ok=True, num_free_blocks=90)
    assert sent(core.on_reserve_reply(reply, 0.1), wire.PrefillJob)
    core.on_submit(b"G", submit_from("g", "reserving"), 0.2)
    core.on_submit(b"G", submit_from("g", "queued"), 0.3)
    core.on_submit(b"H", submit_from("h", "other"), 0.4)
    phases = {request_id: r.phase for request_id, r in core.requests.items()}
    assert phases == {"prefilling": Phase.PREFILLING, "reserving": Phase.RESERVING,
                      "queued": Phase.QUEUED, "other": Phase.QUEUED}  # fmt: skip

    out = core.on_gateway_gone("g", 1.0)

    cancels = sorted((o.identity, o.message.request_id) for o in sent(out, wire.Cancel))
    assert cancels == [(b"D", "prefilling"), (b"D", "reserving"), (b"P", "prefilling")]
    assert all(o.message.reason == "its gateway is gone" for o in sent(out, wire.Cancel))
    assert list(core.requests) == ["other"] and "g" not in core.gateways
    assert core.num_queued_tokens == 0  # "other" left the queue: dispatched to the seats freed
    (reserve,) = sent(out, wire.Reserve)
    assert (reserve.identity, reserve.message.request_id) == (b"D", "other")
    refused = core.on_submit(b"G", submit_from("g", "late"), 1.1)  # a SUBMIT needs a HELLO again
    (reply,) = sent(refused, wire.SubmitReply)
    assert not reply.message.accepted and "has not said HELLO" in reply.message.message


def test_a_gateway_unknown_or_gone_already_changes_nothing():
    core = ClusterScheduler(SchedulerLimits())
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    assert core.on_gateway_gone("nobody", 1.0) == []
    assert core.on_gateway_gone("g", 1.0) == [] and not core.gateways
    assert core.on_gateway_gone("g", 2.0) == []


def test_a_gateway_back_under_its_peer_id_is_told_its_called_off_requests_were_lost():
    """Not dead after all (its link was cut past the heartbeat timeout): the requests called
    off are lost to it, and it resumes each from the tokens its clients have. Told it waited:
    one it had queued waited out its first-token limit (a 504), knowing nothing of its end."""
    core = with_workers(ClusterScheduler(SchedulerLimits()))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    for request_id in ("a", "b"):  # (the first reserving, the second queued)
        core.on_submit(b"G", submit_from("g", request_id), 0.0)
    core.on_gateway_gone("g", 1.0)
    out = core.on_hello(b"G2", hello("g", "gateway"), 2.0)
    (told,) = sent(out, wire.Tokens)
    assert told.identity == b"G2"
    assert [(d.request_id, d.finish_reason) for d in told.message.deltas] == [
        ("a", "lost"),
        ("b", "lost"),
    ]
    assert "could not reach this gateway" in told.message.deltas[0].error
    assert not sent(core.on_hello(b"G3", hello("g", "gateway"), 3.0), wire.Tokens)  # told once


def test_gateways_gone_are_remembered_within_a_bound():
    core = with_workers(ClusterScheduler(SchedulerLimits()))
    for n in range(MAX_GONE_GATEWAYS + 1):
        core.on_hello(b"G", hello(f"g{n}", "gateway"), 0.0)
        core.on_submit(b"G", submit_from(f"g{n}", f"r{n}"), 0.0)
        core.on_gateway_gone(f"g{n}", 1.0)
    assert len(core.gone_gateways) == MAX_GONE_GATEWAYS and "g0" not in core.gone_gateways
