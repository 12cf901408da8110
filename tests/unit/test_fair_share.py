"""The fair-share policy on hand-made arrivals: work conservation, the share bound between
backlogged parties, aging, no banked credit, priorities, shortest prompt first within a party,
and FCFS as a switch."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.scheduler import fair_share
from services.scheduler.fair_share import FairQueue, FairShareConfig, Party, QueuedRequest

_ids = itertools.count()


def request(tenant: str, tokens: int, arrival: float, priority: int = 0) -> QueuedRequest:
    return QueuedRequest(f"r{next(_ids)}", tenant, tokens, priority, arrival)


arrivals = st.lists(
    st.tuples(
        st.sampled_from(["a", "b", "c"]),  # tenant
        st.integers(1, 3000),  # prompt tokens
        st.floats(0, 100, allow_nan=False),  # arrival
        st.integers(-2, 2),  # priority
    ),
    min_size=1,
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(arrivals, st.data())
def test_work_conserving_it_serves_whenever_something_admissible_waits(items, data):
    queued = [request(*item) for item in items]
    refused = data.draw(st.sets(st.sampled_from([r.request_id for r in queued])))
    assert_serves_whenever_admissible(queued, refused)


def assert_serves_whenever_admissible(queued: list[QueuedRequest], refused: set[str]) -> None:
    """Work conservation: while anything admissible waits, a choice returns an admissible one."""
    queue = FairQueue(FairShareConfig())
    for item in queued:
        queue.push(item)
    while len(queue):
        admissible = [r for r in queue if r.request_id not in refused]
        chosen = queue.pop_next(0.0, lambda r: r.request_id not in refused)
        if not admissible:
            assert chosen is None
            break
        assert chosen is not None and chosen.request_id not in refused


@settings(max_examples=150, deadline=None)
@given(
    sizes=st.lists(st.tuples(st.integers(1, 2000), st.integers(1, 2000)), min_size=5, max_size=80),
    weight_b=st.sampled_from([1.0, 2.0, 0.5]),
)
def test_two_backlogged_parties_stay_within_one_request_of_each_other(sizes, weight_b):
    """Both parties always have work queued; after every choice their weighted service differs
    by at most the largest single charge (VTC's bound)."""
    config = FairShareConfig(tenant_weights={"b": weight_b}, max_wait_s=1e9)
    queue = FairQueue(config)
    a, b = Party("a", "long"), Party("b", "long")
    pending = {"a": [s for s, _ in sizes], "b": [s for _, s in sizes]}
    largest = max(max(pending["a"]), max(pending["b"]) / weight_b)
    for tenant in ("a", "b"):  # one request each in the queue at a time; the next on service
        queue.push(request(tenant, 1024 + pending[tenant].pop(), 0.0))
    for _ in range(len(sizes) - 1):
        served = queue.pop_next(0.0)
        queue.push(request(served.tenant, 1024 + pending[served.tenant].pop(), 0.0))
        assert abs(queue.counters[a] - queue.counters[b]) <= largest + 1024 * max(1, 1 / weight_b)


def test_a_tenant_sending_ten_times_more_gets_an_equal_share_while_both_wait():
    queue = FairQueue(FairShareConfig(max_wait_s=1e9))
    for i in range(200):
        queue.push(request("heavy", 100, i * 0.01))
        if i % 10 == 0:
            queue.push(request("light", 100, i * 0.01))
    served = [queue.pop_next(5.0).tenant for _ in range(40)]
    assert served.count("light") == 20  # light is backlogged with all its 20 requests


@settings(max_examples=150, deadline=None)
@given(arrivals, st.floats(0.5, 20))
def test_while_requests_are_overdue_every_other_choice_serves_the_oldest(items, max_wait):
    """Serve one request per time unit as they arrive. Whenever overdue requests wait, of two
    consecutive choices at least one is the oldest overdue request: an overdue request waits at
    most two choices per older overdue one."""
    queue = FairQueue(FairShareConfig(max_wait_s=max_wait))
    pending = sorted((request(*item) for item in items), key=lambda r: r.arrival)
    now, previous_was_oldest_overdue = 0.0, False
    while pending or len(queue):
        while pending and pending[0].arrival <= now:
            queue.push(pending.pop(0))
        overdue = [r for r in queue if now - r.arrival >= max_wait]
        oldest = min(overdue, key=lambda r: r.arrival, default=None)
        chosen = queue.pop_next(now)
        if oldest is not None:
            assert chosen is oldest or previous_was_oldest_overdue
        previous_was_oldest_overdue = oldest is not None and chosen is oldest
        now += 1.0


def test_a_flooding_tenant_cannot_take_everything_through_aging():
    queue = FairQueue(FairShareConfig(max_wait_s=10.0))
    for i in range(100):
        queue.push(request("heavy", 100, 0.0 + i * 0.01))  # all overdue soon
    served = []
    for t in range(40):
        queue.push(request("light", 100, 100.0 + t))
        served.append(queue.pop_next(100.0 + t).tenant)
        # As the scheduler's dispatch loop ends: a choice with no room, which changes nothing.
        assert queue.pop_next(100.0 + t, lambda _: False) is None
    assert served.count("light") >= 19  # every other choice is fair, and light is least served


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 40), st.integers(1, 2000))
def test_a_newcomer_is_served_within_two_choices_of_a_flood(flood, size):
    queue = FairQueue(FairShareConfig(max_wait_s=1e9))
    for i in range(flood):
        queue.push(request("flood", size, float(i)))
    for _ in range(flood // 2):
        queue.pop_next(100.0)
    newcomer = request("newcomer", size, 100.0)
    queue.push(newcomer)
    first_two = [queue.pop_next(100.0), queue.pop_next(100.0)]
    assert newcomer in first_two


def test_an_idle_party_banks_no_credit():
    queue = FairQueue(FairShareConfig(max_wait_s=1e9))
    for i in range(50):
        queue.push(request("busy", 100, float(i)))
    for _ in range(40):
        queue.pop_next(60.0)  # busy has 4000 tokens of service; idle had none and wanted none
    for i in range(20):
        queue.push(request("idle", 100, 60.0 + i))
    order = [queue.pop_next(100.0).tenant for _ in range(10)]
    # Without the virtual time, idle would take ten turns in a row; it alternates instead.
    assert order.count("idle") <= 6 and order.count("busy") >= 4


def test_short_and_long_prompts_are_separate_parties():
    queue = FairQueue(FairShareConfig(class_thresholds=(1024,), max_wait_s=1e9))
    for i in range(10):
        queue.push(request("t", 4000, float(i)))  # long prompts, first in line
    for i in range(10):
        queue.push(request("t", 50, 10.0 + i))
    order = [queue.pop_next(30.0).num_prompt_tokens for _ in range(12)]
    assert order[:2] == [4000, 50]  # the shorts' party catches up on token cost, not count
    assert order.count(50) >= 10


def test_priority_orders_within_a_tenant_then_arrival():
    queue = FairQueue(FairShareConfig())
    low, high, high_later = (
        request("t", 10, 0.0),
        request("t", 10, 1.0, 5),
        request("t", 10, 2.0, 5),
    )
    for item in (low, high, high_later):
        queue.push(item)
    assert [queue.pop_next(3.0) for _ in range(3)] == [high, high_later, low]


def test_within_a_priority_the_shorter_prompt_goes_first_then_the_earlier_arrival():
    queue = FairQueue(FairShareConfig())
    long_early, short, short_later, urgent_long = (
        request("t", 900, 0.0),
        request("t", 40, 1.0),
        request("t", 40, 2.0),
        request("t", 800, 3.0, 1),
    )
    for item in (long_early, short, short_later, urgent_long):
        queue.push(item)
    assert [queue.pop_next(4.0) for _ in range(4)] == [urgent_long, short, short_later, long_early]


def test_aging_bounds_a_longer_prompts_wait_behind_a_stream_of_shorter_ones():
    queue = FairQueue(FairShareConfig(max_wait_s=10.0))
    longer = request("t", 900, 0.0)
    queue.push(longer)
    served_at = None
    for second in range(1, 60):  # a shorter prompt of the same party every second, served at once
        queue.push(request("t", 40, float(second)))
        if queue.pop_next(float(second)) is longer:
            served_at = second
            break
    assert served_at == 10  # overdue at its 10th second, then served first


def test_fcfs_serves_in_arrival_order_whatever_the_tenant():
    queue = FairQueue(FairShareConfig(policy="fcfs"))
    items = [request("heavy", 500, float(i)) for i in range(5)] + [request("light", 5, 9.0)]
    for item in reversed(items):
        queue.push(item)
    assert [queue.pop_next(10.0) for _ in range(6)] == items


def test_removed_requests_are_never_served():
    queue = FairQueue(FairShareConfig())
    kept, dropped = request("a", 10, 0.0), request("a", 10, 1.0)
    queue.push(kept)
    queue.push(dropped)
    assert queue.remove(dropped.request_id) == dropped
    assert queue.remove(dropped.request_id) is None
    assert queue.pop_next(2.0) == kept and queue.pop_next(2.0) is None
    with pytest.raises(ValueError, match="already queued"):
        queue.push(kept)
        queue.push(kept)


def test_output_tokens_are_charged_to_the_requests_party():
    queue = FairQueue(FairShareConfig(output_token_cost=2.0))
    party = queue.party_for("t", 50)
    queue.charge(party, num_prompt_tokens=50, num_output_tokens=10)
    assert queue.counters[party] == 70.0 and queue.served_tokens[party] == 60


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"policy": "lottery"}, "policy must be one of"),
        ({"class_thresholds": (100, 50), "class_names": ("a", "b", "c"),
          "class_weights": (1, 1, 1)}, "increasing"),
        ({"class_thresholds": (100,), "class_names": ("short",)}, "class_names needs 2"),
        ({"class_weights": (1.0, 0.0)}, "weights must be positive"),
        ({"tenant_weights": {"x": -1.0}}, "weights must be positive"),
        ({"tenant_weights": {"x": float("inf")}}, "weights must be positive and finite"),
        ({"max_wait_s": 0}, "max_wait_s"),
        ({"output_token_cost": -1}, "non-negative"),
        # Infinite: every counter charged becomes inf (a refund then NaN), so the accounts tie
        # and the first tenant by name is served for good; an infinite bulk weight charges no
        # bulk party anything, with the same effect among the batch jobs.
        ({"prompt_token_cost": float("inf")}, "finite"),
        ({"output_token_cost": float("inf")}, "finite"),
        ({"bulk_weight": float("inf")}, "bulk_weight must be positive and finite"),
    ],
)  # fmt: skip
def test_bad_settings_are_refused_with_their_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        FairShareConfig(**kwargs)


def test_fcfs_is_strict_when_the_oldest_cannot_be_placed():
    queue = FairQueue(FairShareConfig(policy="fcfs", max_wait_s=1.0))
    big, small = request("t", 5000, 0.0), request("t", 10, 1.0)
    queue.push(big)
    queue.push(small)
    assert queue.pop_next(10.0, lambda r: r is not big) is None  # as the peers: head-of-line
    assert queue.pop_next(10.0) == big


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_resuming_work_goes_before_anything_new_oldest_first(policy):
    queue = FairQueue(FairShareConfig(policy=policy))
    fresh = [request("a", 10, arrival=t) for t in (0.0, 1.0)]
    late, early = (QueuedRequest(f"r{next(_ids)}", "b", 500, 0, t, resumed=True) for t in (9, 5))
    for item in (*fresh, late, early):
        queue.push(item)
    # Not admissible now (no room for its 500 tokens): the next one goes, nothing blocks.
    assert queue.pop_next(10.0, lambda i: i.num_prompt_tokens < 100) is fresh[0]
    assert [queue.pop_next(10.0) for _ in range(3)] == [early, late, fresh[1]]


def serve_and_let_go(queue: FairQueue, tenant: str, now: float) -> Party:
    """One request of `tenant` queued, served and finished, as the core tracks it."""
    item = request(tenant, 10, now)
    party = queue.party_for(tenant, 10)
    queue.track(party)
    queue.push(item)
    assert queue.pop_next(now) is item
    queue.untrack(party)
    return party


def test_accounts_do_not_grow_with_every_tenant_name_ever_sent():
    # Tenants come from the client's `user` field: a hub naming each end user, or a client
    # sending random names, must not grow the scheduler's accounts without bound. Served one
    # at a time, nothing is ever backlogged, the virtual time stands still and every party
    # leaves ahead of it: the bound on those is what holds.
    queue = FairQueue(FairShareConfig())
    for i in range(3 * fair_share.MAX_IDLE_PARTIES_AHEAD):
        serve_and_let_go(queue, f"user-{i}", now=i / 1000)
    assert queue.virtual_time == 0.0
    assert len(queue.counters) <= 2 * fair_share.MAX_IDLE_PARTIES_AHEAD
    assert len(queue.served_tokens) <= 2 * fair_share.MAX_IDLE_PARTIES_AHEAD


def test_a_forgotten_party_re_enters_as_a_newcomer_and_a_busy_one_keeps_its_account(
    monkeypatch,
):
    monkeypatch.setattr(fair_share, "MAX_IDLE_PARTIES_AHEAD", 0)
    queue = FairQueue(FairShareConfig())
    idle = serve_and_let_go(queue, "idle", now=0.0)
    running = queue.party_for("running", 10)
    queue.track(running)  # its request runs: reports will charge it yet
    queue.push(request("running", 10, 0.0))
    queue.pop_next(0.0)
    queue.push(request("waiting", 10, 0.0))  # backlogged
    assert queue.forget_idle_parties() == 1
    assert idle not in queue.counters and idle not in queue.served_tokens
    assert queue.counters[running] == 10.0 and queue.party_for("waiting", 10) in queue.counters
    queue.charge(running, num_output_tokens=3)  # the running request's report
    assert queue.counters[running] == 16.0
