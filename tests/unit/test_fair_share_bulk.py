"""The fair-share policy's bulk class (batch jobs' lines): served only when no interactive
request can be placed, work conserving, never starved (bulk_max_wait_s), fair between the bulk
parties, and not holding back the interactive parties' virtual time."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler.core import ClusterScheduler, PrefillWindow, SchedulerLimits
from services.scheduler.fair_share import (
    BULK_CLASS,
    FairQueue,
    FairShareConfig,
    Party,
    QueuedRequest,
)
from shared import wire
from tests.unit.test_fair_share import assert_serves_whenever_admissible
from tests.unit.test_scheduler_core import hello, submit

_ids = itertools.count()


def request(tenant: str, tokens: int, arrival: float, bulk: bool = False) -> QueuedRequest:
    return QueuedRequest(f"r{next(_ids)}", tenant, tokens, 0, arrival, bulk=bulk)


mixed = st.lists(
    st.tuples(
        st.sampled_from(["a", "b"]),
        st.integers(1, 3000),
        st.floats(0, 100, allow_nan=False),
        st.booleans(),  # bulk
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(mixed, st.data(), st.sampled_from(["fair", "fcfs"]))
def test_bulk_goes_only_when_no_interactive_request_can_be_placed(items, data, policy):
    queue = FairQueue(FairShareConfig(policy=policy, bulk_max_wait_s=1e9, max_wait_s=1e9))
    queued = [request(*item) for item in items]
    for item in queued:
        queue.push(item)
    refused = data.draw(st.sets(st.sampled_from([r.request_id for r in queued])))
    while len(queue):
        placeable_interactive = [r for r in queue if not r.bulk and r.request_id not in refused]
        chosen = queue.pop_next(0.0, lambda r: r.request_id not in refused)
        if chosen is None:
            break
        if chosen.bulk and policy == "fair":
            assert not placeable_interactive, "a bulk line went while interactive work fitted"
        assert chosen.request_id not in refused


@settings(max_examples=150, deadline=None)
@given(mixed, st.data())
def test_work_conserving_with_bulk(items, data):
    queued = [request(*item) for item in items]
    refused = data.draw(st.sets(st.sampled_from([r.request_id for r in queued])))
    assert_serves_whenever_admissible(queued, refused)


def test_interactive_first_even_when_bulk_is_older_and_less_served():
    queue = FairQueue(FairShareConfig())
    old_bulk = request("a", 10, 0.0, bulk=True)
    queue.push(old_bulk)
    late = request("b", 500, 5.0)
    queue.push(late)
    assert queue.pop_next(6.0) is late
    assert queue.pop_next(6.0) is old_bulk


def test_aging_bounds_a_bulk_lines_wait_under_a_flood_of_interactive_work():
    """Interactive work always fills the cluster; the bulk line still goes once it has waited
    bulk_max_wait_s, through the interactive choice's aging."""
    config = FairShareConfig(bulk_max_wait_s=20.0, max_wait_s=10.0)
    queue = FairQueue(config)
    line = request("a", 10, 0.0, bulk=True)
    queue.push(line)
    now = 0.0
    served_at = None
    for step in range(200):
        now = step * 0.5
        queue.push(request("b", 100, now))  # a new interactive request every turn
        chosen = queue.pop_next(now)
        if chosen is line:
            served_at = now
            break
    assert served_at is not None, "the bulk line starved"
    assert 20.0 <= served_at <= 20.0 + 10.0 + 2.0


def test_bulk_parties_share_fairly_between_tenants():
    queue = FairQueue(FairShareConfig(bulk_max_wait_s=1e9, max_wait_s=1e9))
    for i in range(50):
        queue.push(request("a", 100, float(i), bulk=True))
        queue.push(request("b", 100, 100.0 + i, bulk=True))  # later, but as entitled
    first_twenty = [queue.pop_next(200.0).tenant for _ in range(20)]
    assert abs(first_twenty.count("a") - first_twenty.count("b")) <= 1


@pytest.mark.parametrize("indexes", ["python", "native"])
def test_a_bulk_party_joining_a_running_job_banks_no_credit(indexes):
    """Tenant a's job ran alone for 50 lines (no interactive work: the interactive virtual time
    stood still); b's job joining then shares the spare capacity with it from now on, instead
    of taking it all until b has caught up on a's 50 lines."""
    queue = FairQueue(FairShareConfig(max_wait_s=1e9, bulk_max_wait_s=1e9), indexes)
    for _ in range(100):
        queue.push(request("a", 100, 0.0, bulk=True))
    for _ in range(50):
        queue.pop_next(1.0)
    for _ in range(50):
        queue.push(request("b", 100, 2.0, bulk=True))
    next_twenty = [queue.pop_next(3.0).tenant for _ in range(20)]
    assert abs(next_twenty.count("a") - next_twenty.count("b")) <= 1


def test_bulk_is_its_own_party_and_does_not_hold_back_virtual_time():
    queue = FairQueue(FairShareConfig(max_wait_s=1e9, bulk_max_wait_s=1e9))
    assert queue.party_for("a", 10, bulk=True) == Party("a", BULK_CLASS)
    queue.push(request("a", 10, 0.0, bulk=True))  # backlogged, never served below
    for i in range(10):
        queue.push(request("b", 1000, float(i)))
        queue.pop_next(float(i))
    queue.push(request("b", 1000, 20.0))
    queue.push(request("c", 1000, 21.0))  # enters now: at b's level, not at the bulk party's
    assert queue.counters[Party("c", "short")] >= 9000


def test_bulk_settings_are_checked():
    with pytest.raises(ValueError, match="bulk_max_wait_s"):
        FairShareConfig(bulk_max_wait_s=0)
    with pytest.raises(ValueError, match="bulk_weight"):
        FairShareConfig(bulk_weight=-1)


def test_a_prefill_worker_takes_bulk_only_with_little_in_hand():
    window = PrefillWindow(2048)
    assert window.takes(40, bulk=True)
    window.hold(1000)
    assert window.takes(40, bulk=True)  # under half the window in hand
    window.hold(40)
    assert not window.takes(40, bulk=True)  # 1,040 tokens ahead: interactive only now
    assert window.takes(40)
    big = PrefillWindow(2048)
    big.hold(1500)
    assert not big.takes(10, bulk=True) and big.takes(10)


def test_the_bulk_share_of_a_window_is_a_setting():
    quarter = PrefillWindow(2048, bulk_share=0.25)
    quarter.hold(520)
    assert not quarter.takes(40, bulk=True) and quarter.takes(40)
    core = ClusterScheduler(SchedulerLimits(bulk_window_share=0.25))
    assert core.registry.prefill_room.bulk_share == 0.25
    with pytest.raises(ValueError, match="bulk_window_share"):
        SchedulerLimits(bulk_window_share=0)


def test_an_interactive_prompt_waits_only_behind_the_interactive_tokens_a_window_holds():
    window = PrefillWindow(2048)
    window.hold(300, bulk=True)
    window.hold(40)
    assert (window.held_tokens, window.interactive_tokens) == (340, 40)
    window.release(300, bulk=True)
    window.release(40)
    assert (window.held_tokens, window.bulk_tokens, window.interactive_tokens) == (0, 0, 0)


def bulk_core(**limits):
    core = ClusterScheduler(SchedulerLimits(**limits))
    for identity, peer_id, role in ((b"G", "g", "gateway"), (b"P", "p", "prefill")):
        core.on_hello(identity, hello(peer_id, role), 0.0)
    core.on_hello(b"D", hello("d", "decode"), 0.0)  # eight seats
    return core


def reserved_ids(out) -> list[str]:
    return [o.message.request_id for o in out if isinstance(o.message, wire.Reserve)]


def test_batch_lines_leave_a_decode_workers_last_seats_to_interactive_requests():
    core = bulk_core()
    placed = []
    for i in range(8):
        line = dataclasses.replace(submit(f"b{i}"), bulk=True)
        placed += reserved_ids(core.on_submit(b"G", line, 0.0))
    assert placed == [f"b{i}" for i in range(7)]  # seven eighths of eight seats
    assert len(core.queue) == 1
    assert reserved_ids(core.on_submit(b"G", submit("chat"), 0.0)) == ["chat"]
    assert len(core.queue) == 1  # the eighth line still waits for a batch seat


def test_the_bulk_seat_share_is_a_setting():
    core = bulk_core(bulk_seat_share=1.0)
    placed = []
    for i in range(8):
        line = dataclasses.replace(submit(f"b{i}"), bulk=True)
        placed += reserved_ids(core.on_submit(b"G", line, 0.0))
    assert len(placed) == 8 and not len(core.queue)
    with pytest.raises(ValueError, match="bulk_seat_share"):
        bulk_core(bulk_seat_share=1.5)


def test_a_decode_worker_joining_mid_job_takes_batch_lines():
    core = bulk_core()
    for i in range(8):  # the batch seats' index is built at the first line: d's seven
        core.on_submit(b"G", dataclasses.replace(submit(f"b{i}"), bulk=True), 0.0)
    assert len(core.queue) == 1
    out = core.on_hello(b"E", hello("e", "decode"), 0.0)
    assert reserved_ids(out) == ["b7"] and core.requests["b7"].decode_peer_id == "e"


def test_a_batch_lines_big_prompt_leaves_room_for_an_interactive_big_one():
    window = PrefillWindow(2048)
    window.hold(1500, bulk=True)
    assert window.takes(1500) and not window.takes(1500, bulk=True) and window.takes(10)
    window.hold(1500)
    assert not window.takes(1500) and not window.takes(1500, bulk=True)
    window.release(1500, bulk=True)
    assert not window.takes(1500)  # the interactive big prompt still holds its place
    window.release(1500)
    assert window.takes(1500) and window.takes(1500, bulk=True)


@pytest.mark.parametrize("indexes", ["python", "native"])
def test_an_agents_long_prompt_does_not_wait_for_a_batch_lines_prefill(indexes):
    """The engine prefills interactive prompts before batch lines, but the scheduler held a big
    interactive prompt in its queue while a batch line's big prompt was in a worker's hands:
    an agent's long context waited for the line's whole prefill (seconds on a CPU)."""
    core = ClusterScheduler(SchedulerLimits(indexes=indexes))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode", blocks=1000), 0.0)
    line = dataclasses.replace(submit("line", prompt_len=1500), bulk=True)
    assert reserved_ids(core.on_submit(b"G", line, 0.0)) == ["line"]
    reply = wire.ReserveReply(peer_id="d", request_id="line", ok=True, num_free_blocks=900)
    assert [o.message.request_id for o in core.on_reserve_reply(reply, 0.0)] == ["line"]
    assert reserved_ids(core.on_submit(b"G", submit("agent", prompt_len=1500), 0.1)) == ["agent"]
    # A second batch line's big prompt still waits, and a second agent's behind the first.
    second = dataclasses.replace(submit("line2", prompt_len=1500), bulk=True)
    assert reserved_ids(core.on_submit(b"G", second, 0.2)) == []
    assert reserved_ids(core.on_submit(b"G", submit("agent2", prompt_len=1500), 0.3)) == []
