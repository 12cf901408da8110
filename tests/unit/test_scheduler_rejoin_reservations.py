"""Failure handling of the scheduler's core, reviewed: a decode worker dropped while it held a
reservation, whose cancel never reached it (its link was down past the scheduler's hold for
undelivered messages), comes back under the same peer id still holding that reservation (a
decode worker keeps them across registrations until their lease, 300 s)."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from services.scheduler.core import (
    MAX_DROPPED_WORKERS,
    ClusterScheduler,
    Phase,
    SchedulerLimits,
    remember,
)
from shared import wire
from tests.unit.test_scheduler_core import heartbeat, hello, sent, submit


@pytest.fixture
def core() -> ClusterScheduler:
    c = ClusterScheduler(SchedulerLimits(heartbeat_timeout_s=3.0))
    c.on_hello(b"G", hello("g", "gateway"), 0.0)
    c.on_hello(b"P", hello("p", "prefill"), 0.0)
    c.on_hello(b"D", hello("d", "decode"), 0.0)
    return c


def drop_d_while_r_reserves(core: ClusterScheduler, *alive: tuple[bytes, str]) -> None:
    (reserve,) = sent(core.on_submit(b"G", submit("r"), 0.0), wire.Reserve)
    assert reserve.identity == b"D"
    for identity, peer_id in ((b"P", "p"), *alive):
        core.on_heartbeat(identity, heartbeat(peer_id, free=10), 3.0)
    core.tick(3.5)  # d silent: dropped, r back in the queue (the cancel to d is lost)
    assert core.requests["r"].decode_peer_id != "d" and core.registry.get("d") is None


def test_a_decode_worker_back_after_a_lost_cancel_lets_the_old_reservation_go_first(core):
    """Asked again with its old reservation held, it refused the request as a duplicate: the
    refusal put it back in the queue and the next dispatch asked the same worker again, a
    RESERVE and a refusal at network speed until the lease ran out."""
    drop_d_while_r_reserves(core)
    assert core.requests["r"].phase == Phase.QUEUED  # no decode worker left
    out = core.on_hello(b"D2", hello("d", "decode"), 4.0)
    to_d = [(type(o.message), o.message.request_id) for o in out if o.identity == b"D2"]
    assert to_d == [(wire.Cancel, "r"), (wire.Reserve, "r")]


def test_the_old_reservation_is_let_go_when_the_request_went_elsewhere(core):
    core.on_hello(b"E", hello("e", "decode"), 0.0)
    core.on_heartbeat(b"E", heartbeat("e", free=10), 0.0)  # less room: r goes to d
    drop_d_while_r_reserves(core, (b"E", "e"))
    assert core.requests["r"].decode_peer_id == "e"
    out = core.on_hello(b"D2", hello("d", "decode"), 4.0)
    (cancel,) = sent(out, wire.Cancel)
    assert cancel.identity == b"D2" and cancel.message.request_id == "r"
    assert core.requests["r"].decode_peer_id == "e"  # its placement untouched
    out = core.on_hello(b"D3", hello("d", "decode"), 5.0)  # told once: nothing dropped since
    assert not sent(out, wire.Cancel)


def test_a_worker_dropped_with_nothing_reserved_is_not_remembered(core):
    core.tick(3.5)  # p and d silent: dropped, holding nothing
    assert not core.dropped_reservations


def test_a_memory_of_peers_gone_keeps_the_newest_within_its_bound():
    memory: OrderedDict[str, list[str]] = OrderedDict()
    for i in range(MAX_DROPPED_WORKERS + 5):
        remember(memory, f"w{i}", [f"r{i}"], MAX_DROPPED_WORKERS)
    remember(memory, "w10", ["again"], MAX_DROPPED_WORKERS)  # (seen again: the newest)
    remember(memory, "d", ["r"], MAX_DROPPED_WORKERS)
    assert len(memory) == MAX_DROPPED_WORKERS
    assert "w0" not in memory and "w10" in memory and memory["w10"] == ["r10", "again"]
    assert list(memory)[-2:] == ["w10", "d"]
