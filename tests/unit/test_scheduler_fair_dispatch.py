"""The scheduler core under the fair-share policy: the prefill window, who is dispatched first,
what is charged, and the policy's settings and status."""

from __future__ import annotations

import dataclasses

import pytest

from services.scheduler.core import MAX_PARTIES_SHOWN, ClusterScheduler, SchedulerLimits
from services.scheduler.fair_share import FairShareConfig, Party
from services.scheduler.service import SchedulerConfig
from shared import wire
from shared.config import ConfigError, config_from_args
from tests.unit.test_scheduler_core import heartbeat, hello, sent, submit


def make_core(policy: str = "fair", window: int = 100) -> ClusterScheduler:
    core = ClusterScheduler(
        SchedulerLimits(
            prefill_window_tokens=window,
            fair_share=FairShareConfig(policy=policy, class_thresholds=(60,), max_wait_s=1e6),
        )
    )
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill", blocks=1000), 0.0)  # (a 5,000-token prompt)
    core.on_hello(b"D", hello("d", "decode", blocks=1000), 0.0)
    return core


def tenant_submit(request_id: str, tenant: str, prompt_len: int = 20) -> wire.Submit:
    return dataclasses.replace(submit(request_id, prompt_len), tenant=tenant)


def reserved(outgoing) -> list[str]:
    return [o.message.request_id for o in sent(outgoing, wire.Reserve)]


def finish_prefill(core: ClusterScheduler, request_id: str, now: float) -> list:
    core.on_reserve_reply(
        wire.ReserveReply(peer_id="d", request_id=request_id, ok=True, num_free_blocks=900), now
    )
    done = wire.RequestDone(
        request_id=request_id,
        peer_id="p",
        phase="prefill",
        finish_reason=None,
        num_prompt_tokens=20,
        num_output_tokens=1,
    )
    return core.on_request_done(done, now)


def test_the_window_holds_requests_back_in_the_scheduler():
    core = make_core(window=100)
    dispatched = []
    for i in range(10):
        dispatched += reserved(core.on_submit(b"G", submit(f"r{i}", prompt_len=20), 0.0))
    assert dispatched == ["r0", "r1", "r2", "r3", "r4"]  # 5 x 20 tokens fill the window
    assert len(core.queue) == 5
    assert reserved(finish_prefill(core, "r0", 1.0)) == ["r5"]  # one leaves, one more goes


def test_one_big_prompt_in_hand_and_the_window_left_to_small_ones():
    core = make_core(window=100)  # big: more than 50 tokens
    assert reserved(core.on_submit(b"G", submit("long", prompt_len=5000), 0.0)) == ["long"]
    assert reserved(core.on_submit(b"G", submit("long2", prompt_len=60), 0.0)) == []
    shorts = []
    for i in range(6):
        shorts += reserved(core.on_submit(b"G", submit(f"s{i}", prompt_len=20), 0.0))
    assert shorts == ["s0", "s1", "s2", "s3", "s4"]  # 100 tokens of small ones beside the big one
    assert reserved(finish_prefill(core, "long", 1.0)) == ["long2"]


@pytest.mark.parametrize("policy", ["fair", "fcfs"])
def test_a_light_tenant_goes_ahead_of_a_heavy_backlog_only_under_fair(policy):
    core = make_core(policy, window=40)  # two 20-token prompts in hand at a time
    in_hand = []
    for i in range(6):
        in_hand += reserved(core.on_submit(b"G", tenant_submit(f"h{i}", "heavy"), 0.0))
    in_hand += reserved(core.on_submit(b"G", tenant_submit("light", "light"), 0.1))
    assert in_hand == ["h0", "h1"]
    order = []
    for step in range(5):
        dispatched = reserved(finish_prefill(core, in_hand.pop(0), 1.0 + step))
        in_hand += dispatched
        order += dispatched
    if policy == "fair":
        assert order[0] == "light"
    else:
        assert order == ["h2", "h3", "h4", "h5", "light"]


def test_generated_tokens_are_charged_and_a_requeue_refunds_the_prompt():
    core = make_core()
    core.on_submit(b"G", tenant_submit("r", "t", prompt_len=20), 0.0)
    party = Party("t", "short")
    assert core.queue.counters[party] == 20.0  # the prompt, charged at dispatch
    refused = wire.ReserveReply(peer_id="d", request_id="r", ok=False, num_free_blocks=0)
    assert reserved(core.on_reserve_reply(refused, 0.0)) == []
    assert core.queue.counters[party] == 0.0  # back in the queue: refunded
    assert reserved(core.on_heartbeat(b"D", heartbeat("d", free=1000), 0.5)) == ["r"]
    assert core.queue.counters[party] == 20.0  # charged again when dispatched again
    finish_prefill(core, "r", 1.0)
    done = wire.RequestDone(
        request_id="r",
        peer_id="d",
        phase="decode",
        finish_reason="length",
        num_prompt_tokens=20,
        num_output_tokens=7,
    )
    core.on_request_done(done, 2.0)
    # 20 prompt + (1 from prefill + 7 from decode) generated at cost 2
    assert core.queue.counters[party] == 20.0 + 2.0 * 8
    assert core.queue.served_tokens[party] == 28


def test_status_reports_policy_wait_and_service_per_party():
    core = make_core(window=100)
    core.on_submit(b"G", tenant_submit("a", "alice", prompt_len=20), 0.0)
    core.on_submit(b"G", tenant_submit("b", "bob", prompt_len=80), 0.0)
    core.on_submit(b"G", tenant_submit("c", "bob", prompt_len=80), 0.0)  # one big one at a time
    assert reserved(finish_prefill(core, "b", 5.0)) == ["c"]
    status = core.cluster_status(5.0)
    assert status.policy == "fair" and status.max_queue_wait_s == 5.0
    by_party = {(s.tenant, s.class_name): s.served_tokens for s in status.service}
    assert by_party == {("alice", "short"): 20, ("bob", "long"): 80 + 1 + 80}
    assert wire.decode(wire.encode(status)) == status


def test_scheduler_settings_build_the_policy():
    config = config_from_args(
        SchedulerConfig,
        environ={
            "TANDEM_POLICY": "fcfs",
            "TANDEM_CLASS_THRESHOLDS": "512, 4096",
            "TANDEM_CLASS_WEIGHTS": "1,1,0.5",
            "TANDEM_TENANT_WEIGHTS": "gold=4,free=0.5",
        },
    )
    fair = config.limits().fair_share
    assert fair.policy == "fcfs" and fair.class_thresholds == (512, 4096)
    assert fair.class_names == ("class0", "class1", "class2")
    assert fair.tenant_weights == {"gold": 4.0, "free": 0.5}


@pytest.mark.parametrize(
    "environ, message",
    [
        ({"TANDEM_POLICY": "random"}, "policy must be one of"),
        ({"TANDEM_CLASS_THRESHOLDS": "x"}, "TANDEM_CLASS_THRESHOLDS"),
        ({"TANDEM_CLASS_WEIGHTS": "1"}, "class_weights needs 2"),
        ({"TANDEM_TENANT_WEIGHTS": "gold"}, "is not tenant=weight"),
        ({"TANDEM_TENANT_WEIGHTS": "gold=0"}, "weights must be positive"),
        ({"TANDEM_MAX_QUEUE_WAIT_S": "0"}, "max_queue_wait_s"),
        ({"TANDEM_PREFILL_WINDOW_TOKENS": "-5"}, "prefill_window_tokens"),
    ],
)
def test_bad_fair_share_settings_fail_at_start_with_their_name(environ, message):
    with pytest.raises(ConfigError, match=message):
        config_from_args(SchedulerConfig, environ=environ)


def test_the_priority_travels_with_the_prefill_job():
    core = make_core()
    core.on_submit(b"G", dataclasses.replace(submit("r"), priority=3), 0.0)
    reply = wire.ReserveReply(peer_id="d", request_id="r", ok=True, num_free_blocks=900)
    (job,) = sent(core.on_reserve_reply(reply, 0.0), wire.PrefillJob)
    assert job.message.priority == 3


def flooded_core(bulk_max_wait_s: float) -> ClusterScheduler:
    """A window of 100 tokens (batch lines while under 50 are held), and a decode worker with
    seats and blocks to spare."""
    fair = FairShareConfig(class_thresholds=(60,), max_wait_s=1e6, bulk_max_wait_s=bulk_max_wait_s)
    core = ClusterScheduler(SchedulerLimits(prefill_window_tokens=100, fair_share=fair))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode", blocks=10_000, seats=10_000), 0.0)
    return core


def test_an_aged_batch_line_is_placed_under_a_flood_of_interactive_work():
    """README: a batch line that waited `bulk_max_wait_s` competes as interactive, so a job is
    never starved forever, even when interactive work keeps every window past the bulk share."""
    core = flooded_core(bulk_max_wait_s=10.0)
    in_hand = []
    for i in range(8):  # five in hand (100 tokens), the rest queued: a backlog throughout
        in_hand += reserved(core.on_submit(b"G", tenant_submit(f"i{i}", "chat"), 0.0))
    line = dataclasses.replace(tenant_submit("line", "job"), bulk=True)
    assert reserved(core.on_submit(b"G", line, 0.0)) == []  # the window holds 100 >= 50
    placed_at = None
    for step in range(1, 30):
        now = float(step)
        in_hand += reserved(core.on_submit(b"G", tenant_submit(f"n{step}", "chat"), now))
        dispatched = reserved(finish_prefill(core, in_hand.pop(0), now))
        in_hand += [r for r in dispatched if r != "line"]
        if "line" in dispatched:
            placed_at = now
            break
    assert placed_at is not None and placed_at >= 10.0
    reply = wire.ReserveReply(peer_id="d", request_id="line", ok=True, num_free_blocks=9000)
    (job,) = sent(core.on_reserve_reply(reply, placed_at), wire.PrefillJob)
    # It competes as interactive on the worker too: a batch line there yields to every
    # interactive prompt, which the flood keeps in hand.
    assert job.message.bulk is False


def test_a_young_batch_line_still_waits_for_spare_room():
    core = flooded_core(bulk_max_wait_s=10.0)
    in_hand = []
    for i in range(8):
        in_hand += reserved(core.on_submit(b"G", tenant_submit(f"i{i}", "chat"), 0.0))
    line = dataclasses.replace(tenant_submit("line", "job"), bulk=True)
    assert reserved(core.on_submit(b"G", line, 0.0)) == []
    for step in range(1, 9):  # younger than bulk_max_wait_s throughout
        now = float(step)
        in_hand += reserved(core.on_submit(b"G", tenant_submit(f"n{step}", "chat"), now))
        dispatched = reserved(finish_prefill(core, in_hand.pop(0), now))
        assert "line" not in dispatched
        in_hand += dispatched


def test_status_lists_a_party_with_requests_queued_past_the_cut():
    """The status shows at most MAX_PARTIES_SHOWN accounts: the ones with work queued first,
    then the most served; listed by name."""
    core = make_core(window=100)
    core.on_submit(b"G", tenant_submit("big", "aaa", prompt_len=80), 0.0)  # one big in hand
    core.on_submit(b"G", tenant_submit("late", "zzz", prompt_len=80), 0.0)  # queued behind
    for i in range(MAX_PARTIES_SHOWN + 10):
        core.queue.charge(core.queue.party_for(f"m{i:04d}", 20), num_prompt_tokens=i + 1)
    service = core.cluster_status(1.0).service
    assert len(service) == MAX_PARTIES_SHOWN
    by_party = {(s.tenant, s.class_name): s for s in service}
    assert by_party[("zzz", "long")].num_queued == 1
    assert ("aaa", "long") in by_party  # the most served of all (80 tokens)
    assert ("m0000", "short") not in by_party  # the least served is cut
    assert [(s.tenant, s.class_name) for s in service] == sorted(by_party)
    assert core.cluster_status(1.0).service == service  # the same answer every time


def test_queue_time_counts_from_the_last_time_a_request_was_queued():
    """A request whose reservation is refused goes back to the queue keeping its arrival (for
    aging), but its queue time, in the dispatch and `max_queue_wait_s`, counts from there."""
    core = make_core()
    assert reserved(core.on_submit(b"G", submit("r"), 0.0)) == ["r"]
    assert [d.queue_s for d in core.take_dispatched()] == [0.0]
    refused = wire.ReserveReply(peer_id="d", request_id="r", ok=False, num_free_blocks=900)
    assert reserved(core.on_reserve_reply(refused, 4.0)) == ["r"]  # back, and out at once
    assert [d.queue_s for d in core.take_dispatched()] == [0.0]
    assert core.cluster_status(4.0).max_queue_wait_s == 0.0
    assert core.requests["r"].arrival == 0.0  # aging still counts from the first arrival


def test_an_aged_batch_line_takes_a_seat_kept_for_interactive_requests():
    """Interactive requests holding a decode worker's batch seats (7 of 8) keep a young line
    waiting; one that waited `bulk_max_wait_s` takes the seat left to interactive work."""
    fair = FairShareConfig(max_wait_s=1e6, bulk_max_wait_s=10.0)
    core = ClusterScheduler(SchedulerLimits(prefill_window_tokens=10_000, fair_share=fair))
    core.on_hello(b"G", hello("g", "gateway"), 0.0)
    core.on_hello(b"P", hello("p", "prefill"), 0.0)
    core.on_hello(b"D", hello("d", "decode", blocks=10_000, seats=8), 0.0)
    for i in range(7):  # decoding, each in a seat
        assert reserved(core.on_submit(b"G", tenant_submit(f"i{i}", "chat"), 0.0)) == [f"i{i}"]
        finish_prefill(core, f"i{i}", 0.0)
    line = dataclasses.replace(tenant_submit("line", "job"), bulk=True)
    assert reserved(core.on_submit(b"G", line, 0.0)) == []
    assert reserved(core.tick(9.0)) == []
    assert reserved(core.tick(10.0)) == ["line"]
    assert core.requests["line"].decode_peer_id == "d"
