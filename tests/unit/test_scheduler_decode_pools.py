"""Decode workers whose KV pools differ (a cluster of mixed hardware, or of workers started with
different `--num-kv-blocks`): a request goes only to a decode worker whose whole pool can hold its
prompt plus max_tokens, which refuses any other (400 after its prefill: `Engine.add_prefilled`),
and one that only a busy big worker can hold waits for it without holding up the rest."""

from __future__ import annotations

import pytest

from services.scheduler.core import ClusterScheduler, Phase, SchedulerLimits
from shared import wire

BLOCK_SIZE = 16


def hello(peer_id: str, role: str, blocks: int = 0, seats: int = 8) -> wire.Hello:
    return wire.Hello(
        schema_version=wire.SCHEMA_VERSION,
        role=role,
        peer_id=peer_id,
        model="m",
        address=f"ipc://{peer_id}" if role != "prefill" else None,
        num_kv_blocks=blocks,
        block_size=0 if role == "gateway" else BLOCK_SIZE,
        max_num_seqs=0 if role == "gateway" else seats,
    )


def heartbeat(peer_id: str, free: int, total: int) -> wire.Heartbeat:
    return wire.Heartbeat(
        peer_id=peer_id,
        num_waiting=0,
        num_running=0,
        num_free_blocks=free,
        num_total_blocks=total,
        steps_completed=0,
        sent_at=0.0,
    )


def submit(request_id: str, prompt_len: int, max_tokens: int, bulk: bool = False) -> wire.Submit:
    return wire.Submit(
        request_id=request_id,
        prompt_token_ids=[5] * prompt_len,
        sampling=wire.SamplingSpec(max_tokens=max_tokens),
        tenant="t",
        priority=0,
        gateway_peer_id="g",
        arrival_time=0.0,
        bulk=bulk,
    )


def reserves(outgoing) -> dict[str, str]:
    """request id -> the decode worker asked to reserve for it."""
    return {
        o.message.request_id: o.identity.decode()
        for o in outgoing
        if isinstance(o.message, wire.Reserve)
    }


@pytest.fixture(params=["native", "python"])
def core(request) -> ClusterScheduler:
    """A gateway, two prefill workers, a small decode worker (4 blocks: 64 tokens) and a big
    one (64 blocks: 1,024 tokens)."""
    c = ClusterScheduler(SchedulerLimits(indexes=request.param))
    c.on_hello(b"g", hello("g", "gateway"), 0.0)
    c.on_hello(b"p1", hello("p1", "prefill", blocks=100), 0.0)
    c.on_hello(b"p2", hello("p2", "prefill", blocks=100), 0.0)
    c.on_hello(b"small", hello("small", "decode", blocks=4), 0.0)
    c.on_hello(b"big", hello("big", "decode", blocks=64), 0.0)
    return c


def test_a_request_only_a_big_pool_holds_goes_to_the_big_worker(core):
    """The small worker has more blocks free, and would be picked by room alone."""
    core.on_heartbeat(b"big", heartbeat("big", free=3, total=64), 0.0)
    out = core.on_submit(b"g", submit("long", prompt_len=20, max_tokens=200), 0.0)
    assert reserves(out) == {"long": "big"}


def test_a_request_any_pool_holds_still_goes_by_room(core):
    core.on_heartbeat(b"big", heartbeat("big", free=3, total=64), 0.0)
    out = core.on_submit(b"g", submit("short", prompt_len=20, max_tokens=20), 0.0)
    assert reserves(out) == {"short": "small"}


def test_one_only_a_full_big_worker_holds_waits_and_the_rest_go_on(core):
    """The big worker has no room now: the long request waits in the queue (not reserved on
    the small worker, which would refuse it after its prefill), and a short one submitted after
    it is placed meanwhile."""
    core.on_heartbeat(b"big", heartbeat("big", free=0, total=64), 0.0)
    out = core.on_submit(b"g", submit("long", prompt_len=20, max_tokens=200), 0.0)
    assert reserves(out) == {}
    assert core.requests["long"].phase == Phase.QUEUED
    out = core.on_submit(b"g", submit("short", prompt_len=20, max_tokens=20), 0.0)
    assert reserves(out) == {"short": "small"}
    out = core.on_heartbeat(b"big", heartbeat("big", free=64, total=64), 0.1)
    assert reserves(out) == {"long": "big"}


def test_a_batch_line_only_a_big_pool_holds_goes_to_the_big_worker(core):
    core.on_heartbeat(b"big", heartbeat("big", free=3, total=64), 0.0)
    out = core.on_submit(b"g", submit("line", prompt_len=20, max_tokens=200, bulk=True), 0.0)
    assert reserves(out) == {"line": "big"}


def test_a_request_no_pool_holds_is_refused(core):
    out = core.on_submit(b"g", submit("huge", prompt_len=20, max_tokens=2000), 0.0)
    (reply,) = [o.message for o in out if isinstance(o.message, wire.SubmitReply)]
    assert not reply.accepted and reply.status_code == 400


def test_one_admitted_for_a_big_worker_that_left_is_not_placed_on_a_small_one(core):
    """Its worker may come back (a restart): it waits for one to hold it, or its queue time."""
    core.on_heartbeat(b"big", heartbeat("big", free=0, total=64), 0.0)
    out = core.on_submit(b"g", submit("long", prompt_len=20, max_tokens=200), 0.0)
    assert reserves(out) == {}
    core.on_goodbye(b"big", wire.Goodbye(peer_id="big"), 0.1)
    out = core.on_heartbeat(b"small", heartbeat("small", free=4, total=4), 0.2)
    assert reserves(out) == {} and core.requests["long"].phase == Phase.QUEUED
    out = core.on_hello(b"big", hello("big", "decode", blocks=64), 0.3)
    assert reserves(out) == {"long": "big"}
