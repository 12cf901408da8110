"""The prefill worker's protocol: first token to the gateway, KV to the decode target, and a
transfer that is never acknowledged is abandoned and reported for re-routing."""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time

import pytest
import zmq

from services.prefill import service as prefill_service
from services.prefill.service import PrefillWorker
from services.scheduler.core import ClusterScheduler, SchedulerLimits
from services.worker.config import WorkerConfig
from shared import wire
from tests.integration.conftest import FakeScheduler, WorkerThread
from tests.unit.test_scheduler_core import hello, sent

PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 3, 99, 41]


@pytest.fixture
def setup(running):
    return running[:4]


@pytest.fixture
def running(tmp_path, tiny_model_dir):
    yield from run_worker(tmp_path, tiny_model_dir, transfer_timeout_s=0.5)


def run_worker(tmp_path, model_dir, **settings):
    context = zmq.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/s.sock")
    gateway = context.socket(zmq.PULL)
    gateway.bind(f"ipc://{tmp_path}/g.sock")
    decode = context.socket(zmq.ROUTER)  # plays the decode worker's KV socket
    decode.bind(f"ipc://{tmp_path}/d.sock")
    config = WorkerConfig(
        scheduler_address=f"ipc://{tmp_path}/s.sock",
        peer_id="p",
        model=str(model_dir),
        dtype="float32",
        kv_cache_bytes=1 << 20,
        block_size=4,
        **settings,
    )
    worker = WorkerThread(PrefillWorker(config, context)).start()
    scheduler.expect(wire.Heartbeat)
    yield scheduler, gateway, decode, tmp_path, worker.worker
    worker.stop()
    for sock in (gateway, decode, scheduler.socket):
        sock.close(linger=0)
    context.term()


def job(
    tmp_path, request_id: str, max_tokens: int = 8, cache_salt: str | None = None, **sampling
) -> wire.PrefillJob:
    return wire.PrefillJob(
        cache_salt=cache_salt,
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingSpec(max_tokens=max_tokens, temperature=0.0, **sampling),
        gateway_address=f"ipc://{tmp_path}/g.sock",
        decode_peer_id="d",
        decode_address=f"ipc://{tmp_path}/d.sock",
    )


def test_first_token_streams_and_kv_reaches_decode(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(job(tmp_path, "r1", ignore_eos=True))
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.request_id == "r1" and len(first.token_ids) == 1 and first.finish_reason is None
    assert first.index == 0
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.num_tokens == len(PROMPT)
    assert transfer.output_token_ids == first.token_ids
    assert transfer.first_delta == first  # the decode worker streams it again
    assert transfer.keys.shape[1] == 3 and transfer.keys.shape == transfer.values.shape
    wire.send_to(decode, identity, wire.KvAck(request_id="r1", ok=True, error=None))
    done = scheduler.expect(wire.RequestDone)
    assert done.phase == "prefill" and done.finish_reason is None
    assert done.output_length is None  # its stream goes on at the decode worker
    assert scheduler.expect(wire.Heartbeat).step_s > 0  # its step, timed for the routing


def test_a_resumed_jobs_first_token_says_its_place_after_the_tokens_it_was_given(setup):
    scheduler, gateway, decode, tmp_path = setup
    resumed = dataclasses.replace(job(tmp_path, "r~1", ignore_eos=True), output_token_ids=[5, 6])
    scheduler.send(resumed)
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.index == 2 and len(first.token_ids) == 1
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.output_token_ids == [5, 6, *first.token_ids] and transfer.first_delta == first
    wire.send_to(decode, identity, wire.KvAck(request_id="r~1", ok=True, error=None))
    done = scheduler.expect(wire.RequestDone)
    assert done.request_id == "r~1" and done.num_output_tokens == 1  # made here: [5, 6] were not


def test_a_resumed_job_over_at_its_first_token_says_where_its_stream_ended(setup):
    scheduler, gateway, decode, tmp_path = setup
    resumed = dataclasses.replace(
        job(tmp_path, "r~1", max_tokens=3, ignore_eos=True), output_token_ids=[5, 6]
    )
    scheduler.send(resumed)
    assert gateway.poll(10_000)
    assert wire.recv(gateway).deltas[0].finish_reason == "length"
    done = scheduler.expect(wire.RequestDone)
    assert (done.finish_reason, done.num_output_tokens, done.output_length) == ("length", 1, 3)


def test_a_resumed_job_already_at_max_tokens_ends_at_once_without_another_token(setup):
    """A resumed job whose earlier output already holds max_tokens tokens (its stream's end
    was lost) ends at once, "length", where its output ends: it was prefilled and given one
    token more than its client asked for, at index max_tokens (as the decode worker ends
    such a transfer or local prefill)."""
    scheduler, gateway, decode, tmp_path = setup
    resumed = dataclasses.replace(
        job(tmp_path, "r~1", max_tokens=2, ignore_eos=True), output_token_ids=[5, 6]
    )
    scheduler.send(resumed)
    assert gateway.poll(10_000)
    (delta,) = wire.recv(gateway).deltas
    assert (delta.token_ids, delta.index, delta.finish_reason) == ([], 2, "length")
    done = scheduler.expect(wire.RequestDone)
    assert (done.phase, done.finish_reason) == ("prefill", "length")
    assert (done.num_output_tokens, done.output_length) == (0, 2)
    assert not decode.poll(300)  # no KV went
    assert scheduler.expect(wire.Heartbeat).request_ids == []


def test_a_job_with_max_tokens_below_one_is_refused_naming_it(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(job(tmp_path, "zero", max_tokens=0))
    assert gateway.poll(10_000)
    (delta,) = wire.recv(gateway).deltas
    assert delta.finish_reason == "error" and "max_tokens" in delta.error
    assert scheduler.expect(wire.RequestDone).finish_reason == "rejected"


def test_a_bulk_job_hands_its_class_on_with_the_kv(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(dataclasses.replace(job(tmp_path, "line", ignore_eos=True), bulk=True))
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.bulk  # the decode worker preempts it before interactive sequences
    wire.send_to(decode, identity, wire.KvAck(request_id="line", ok=True, error=None))
    assert scheduler.expect(wire.RequestDone).request_id == "line"


def test_a_speculative_jobs_first_token_streams_and_its_kv_waits_for_the_grant(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(dataclasses.replace(job(tmp_path, "spec", ignore_eos=True), await_grant=True))
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.request_id == "spec"  # the first token, at once
    assert not decode.poll(500)  # no KV before the reservation is confirmed
    scheduler.send(wire.PrefillGrant(request_id="spec", num_skip_blocks=1))
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.first_block == 1 and transfer.num_tokens == len(PROMPT)  # block 0 skipped
    assert transfer.first_delta == first
    wire.send_to(decode, identity, wire.KvAck(request_id="spec", ok=True, error=None))
    assert scheduler.expect(wire.RequestDone).finish_reason is None


def test_a_grant_with_a_negative_block_count_sends_the_whole_kv(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(dataclasses.replace(job(tmp_path, "odd", ignore_eos=True), await_grant=True))
    assert gateway.poll(10_000)
    wire.recv(gateway)
    scheduler.send(wire.PrefillGrant(request_id="odd", num_skip_blocks=-3))
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.first_block == 0 and transfer.num_tokens == len(PROMPT)
    wire.send_to(decode, identity, wire.KvAck(request_id="odd", ok=True, error=None))
    assert scheduler.expect(wire.RequestDone).finish_reason is None


def test_a_cancelled_speculative_job_frees_its_kv_and_a_late_grant_sends_nothing(setup):
    scheduler, gateway, decode, tmp_path = setup
    free_before = scheduler.expect(wire.Heartbeat).num_free_blocks
    scheduler.send(dataclasses.replace(job(tmp_path, "gone", ignore_eos=True), await_grant=True))
    assert gateway.poll(10_000)
    wire.recv(gateway)
    scheduler.send(wire.Cancel(request_id="gone", reason="lost"))
    scheduler.send(wire.PrefillGrant(request_id="gone", num_skip_blocks=0))
    assert not decode.poll(1_000)

    def idle(beat: wire.Heartbeat) -> bool:
        return "gone" not in beat.request_ids and beat.num_free_blocks == free_before

    assert scheduler.expect(wire.Heartbeat, timeout_s=10, where=idle)


def test_a_grant_whose_shipping_raises_ends_the_request_at_its_gateway_and_scheduler(running):
    """The job left the parked set before its KV shipped: when shipping raised, the guard found
    nothing to end, and neither the gateway nor the scheduler heard of the request again."""
    scheduler, gateway, decode, tmp_path, worker = running
    scheduler.send(dataclasses.replace(job(tmp_path, "spec", ignore_eos=True), await_grant=True))
    assert gateway.poll(10_000)
    wire.recv(gateway)

    def export_fails(*_):
        raise RuntimeError("the KV copy failed")

    worker.engine.export_kv = export_fails
    scheduler.send(wire.PrefillGrant(request_id="spec", num_skip_blocks=0))
    assert gateway.poll(10_000)
    assert wire.recv(gateway).deltas[0].finish_reason == "error"
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("spec", "rejected")
    assert worker.held_request_ids() == []


def test_a_grant_for_a_job_over_at_its_first_token_is_not_kept(running):
    """A grant that came while the prefill ran was kept for the KV; a job that ended at its
    first token sends none, and the grant stayed for the worker's life."""
    scheduler, gateway, decode, tmp_path, worker = running
    spec = dataclasses.replace(job(tmp_path, "one", max_tokens=1), await_grant=True)
    scheduler.send(spec)
    scheduler.send(wire.PrefillGrant(request_id="one", num_skip_blocks=0))
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("one", "length")
    assert not decode.poll(300) and worker.grants == {}


def test_unacknowledged_transfer_is_abandoned_and_reported(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(job(tmp_path, "lost", ignore_eos=True))
    assert decode.poll(10_000)  # the KV arrives, but no ack is ever sent
    done = scheduler.expect(wire.RequestDone, timeout_s=10)
    assert done.request_id == "lost" and done.finish_reason == "error"


def test_kv_for_a_decode_worker_that_never_answers_is_dropped_with_its_socket(running):
    """Its KV address unreachable (a firewall, a wrong address): once the transfer timed out,
    the socket goes with the KV queued in it, so nothing stale reaches the worker should it come
    back, and the next job to the address ships normally."""
    scheduler, gateway, decode, tmp_path, worker = running
    silent = f"ipc://{tmp_path}/silent.sock"
    scheduler.send(
        dataclasses.replace(job(tmp_path, "lost", ignore_eos=True), decode_address=silent)
    )
    done = scheduler.expect(wire.RequestDone, timeout_s=10)
    assert done.request_id == "lost" and done.finish_reason == "error"
    assert silent not in worker.decode_sockets
    back = decode.context.socket(zmq.ROUTER)  # the decode worker comes back
    try:
        back.bind(silent)
        assert not back.poll(1000)  # the timed-out transfer's KV is gone
        again = dataclasses.replace(job(tmp_path, "next", ignore_eos=True), decode_address=silent)
        scheduler.send(again)
        assert back.poll(10_000)
        assert wire.decode(back.recv_multipart()[1:]).request_id == "next"
    finally:
        back.close(linger=0)


def test_a_full_kv_queue_to_a_decode_worker_fails_the_transfer_at_once(
    tmp_path, tiny_model_dir, monkeypatch
):
    """Past its queue's bound a send would block the worker's loop for good (no heartbeats, no
    other job): the transfer fails at once instead, for the scheduler to re-route."""
    monkeypatch.setattr(prefill_service, "KV_SEND_QUEUE", 1)
    running = run_worker(tmp_path, tiny_model_dir, transfer_timeout_s=60.0)
    scheduler, gateway, decode, tmp_path, worker = next(running)
    try:
        silent = f"ipc://{tmp_path}/silent.sock"
        for request_id in ("a", "b", "c"):
            lost = job(tmp_path, request_id, ignore_eos=True)
            scheduler.send(dataclasses.replace(lost, decode_address=silent))
        # Long before the 60 s timeout: a queue full.
        done = scheduler.expect(wire.RequestDone, timeout_s=20)
        assert done.finish_reason == "error"
        scheduler.send(job(tmp_path, "fine", ignore_eos=True))  # the loop goes on
        assert decode.poll(10_000)
    finally:
        next(running, None)


def test_request_over_at_its_first_token_ends_in_prefill(setup):
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(job(tmp_path, "one", max_tokens=1))
    assert gateway.poll(10_000)
    delta = wire.recv(gateway).deltas[0]
    assert delta.finish_reason == "length"
    done = scheduler.expect(wire.RequestDone)
    assert (done.finish_reason, done.output_length) == ("length", 1)
    assert not decode.poll(300)  # no KV was sent


def test_invalid_job_gets_an_error_to_the_gateway(setup):
    scheduler, gateway, decode, tmp_path = setup
    bad = wire.PrefillJob(
        request_id="bad",
        prompt_token_ids=[5, 10_000],  # outside the tiny model's vocabulary
        sampling=wire.SamplingSpec(max_tokens=4),
        gateway_address=f"ipc://{tmp_path}/g.sock",
        decode_peer_id="d",
        decode_address=f"ipc://{tmp_path}/d.sock",
    )
    scheduler.send(bad)
    assert gateway.poll(10_000)
    delta = wire.recv(gateway).deltas[0]
    assert delta.finish_reason == "error" and "prompt" in delta.error
    done = scheduler.expect(wire.RequestDone)
    assert (done.finish_reason, done.output_length) == ("rejected", 0)


def test_a_repeated_prompt_computes_only_its_last_block_and_says_so(setup):
    """The worker's prefix cache: the second prompt of a tenant skips its cached full blocks
    (8 of 11 tokens at block size 4; the last block runs for its logits) and the first delta
    says so; another tenant's prompt finds nothing."""
    scheduler, gateway, decode, tmp_path = setup
    cached = {}
    for request_id, salt in [("a1", "tenant-a"), ("a2", "tenant-a"), ("b1", "tenant-b")]:
        scheduler.send(job(tmp_path, request_id, max_tokens=1, cache_salt=salt))
        assert gateway.poll(10_000)
        delta = wire.recv(gateway).deltas[0]
        cached[request_id] = delta.num_cached_tokens
        assert scheduler.expect(wire.RequestDone).finish_reason == "length"
    assert cached == {"a1": 0, "a2": 8, "b1": 0}


def test_a_transfer_of_an_earlier_registration_that_fails_is_lost_at_its_gateway(setup):
    """The scheduler restarted (or dropped this worker) while a transfer was in flight: the
    transfer's failure went only to the new scheduler, which does not know the request and
    ignores it, and the client waited out its request timeout. Its gateway is told it is lost,
    and resumes it."""
    scheduler, gateway, decode, tmp_path = setup
    scheduler.send(job(tmp_path, "old", ignore_eos=True))
    assert decode.poll(10_000)  # the KV arrives; no ack will come
    first = wire.recv(gateway).deltas[0]
    assert first.request_id == "old" and first.finish_reason is None
    forgotten = wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=False,
                              error=wire.UNKNOWN_PEER, heartbeat_interval_s=0.1)  # fmt: skip
    scheduler.send(forgotten)
    scheduler.expect(wire.Hello)  # registers again (and is welcomed)
    done = scheduler.expect(wire.RequestDone, timeout_s=10)
    assert (done.request_id, done.finish_reason) == ("old", "error")
    assert gateway.poll(5_000)
    lost = wire.recv(gateway).deltas[0]
    assert (lost.request_id, lost.finish_reason) == ("old", "lost")
    assert "not acknowledged in time" in lost.error


# -- across a scheduler restart: the worker registers again ----------------------------------


def register_again(scheduler: FakeScheduler) -> None:
    """The scheduler answers a heartbeat that it does not know the worker (it restarted)."""
    forgotten = wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=False,
                              error=wire.UNKNOWN_PEER, heartbeat_interval_s=0.1)  # fmt: skip
    scheduler.send(forgotten)
    scheduler.expect(wire.Hello)


def hold_prefills(worker: PrefillWorker) -> threading.Event:
    """The worker's prefills make no progress until the event is set (a long prompt)."""
    may_run = threading.Event()
    real_step = worker.engine.step

    def held_step():
        if not may_run.is_set():
            time.sleep(0.01)
            return []
        return real_step()

    worker.engine.step = held_step
    return may_run


def told_of(scheduler: FakeScheduler, request_id: str) -> list[wire.Message]:
    """What the worker tells the scheduler of the request (its cancels and reports)."""

    def of_it(message: wire.Message) -> bool:
        kinds = wire.Cancel | wire.RequestDone
        return isinstance(message, kinds) and message.request_id == request_id

    told = []
    with contextlib.suppress(TimeoutError):
        while True:
            told.append(scheduler.expect(wire.Message, timeout_s=1.0, where=of_it))
    return told


def assert_a_restarted_scheduler_lets_the_reservation_go(told: list, request_id: str) -> None:
    """Told so, a restarted scheduler (the real core) has the decode worker's reservation for
    the request let go, whether that worker's listing of it came before or (as usual: it
    lists it a heartbeat after it registers again) after."""
    for listed_first in (True, False):
        new = ClusterScheduler(SchedulerLimits())
        new.on_hello(b"G", hello("g", "gateway"), 0.0)
        new.on_hello(b"P", hello("p", "prefill"), 0.0)
        new.on_hello(b"D", hello("d", "decode"), 0.0)
        listing = wire.Heartbeat(peer_id="d", num_waiting=0, num_running=0, num_free_blocks=90,
                                 num_total_blocks=100, steps_completed=0, sent_at=0.0,
                                 request_ids=[request_id])  # fmt: skip
        out = new.on_heartbeat(b"D", listing, 1.0) if listed_first else []
        for message in told:
            if isinstance(message, wire.Cancel):
                out += new.on_cancel(message, 1.0)
            else:
                out += new.on_request_done(message, 1.0)
        if not listed_first:
            out += new.on_heartbeat(b"D", listing, 1.0)
        cancels = [(o.identity, o.message.request_id) for o in sent(out, wire.Cancel)]
        assert cancels == [(b"D", request_id)], f"listed first: {listed_first}"
        assert not new.adopted.holds(request_id)
        assert request_id not in new.registry.get("d").request_ids


def test_a_speculative_job_orphaned_by_a_scheduler_restart_frees_its_decode_reservation(running):
    """The scheduler restarted while a speculative job awaited its grant: the prefill worker let
    the job go and told its gateway, which resumes the request under a new id; but the decode
    worker's reservation for the old id, adopted by the new scheduler from its heartbeat, held
    its blocks and a seat for nobody until its lease ran out (minutes)."""
    scheduler, gateway, decode, tmp_path, worker = running
    scheduler.send(dataclasses.replace(job(tmp_path, "spec", ignore_eos=True), await_grant=True))
    assert gateway.poll(10_000)
    assert wire.recv(gateway).deltas[0].finish_reason is None
    register_again(scheduler)
    assert gateway.poll(5_000)
    assert wire.recv(gateway).deltas[0].finish_reason == "lost"
    assert_a_restarted_scheduler_lets_the_reservation_go(told_of(scheduler, "spec"), "spec")
    assert worker.held_request_ids() == []


def test_a_job_of_an_earlier_registration_over_at_its_first_token_frees_its_reservation(
    running,
):
    """Accepted before the scheduler restarted, prefilled after, and over at its first token:
    its report reached the new scheduler before the decode worker listed the request, and was
    dropped; the reservation, adopted then, was held for nobody until its lease ran out."""
    scheduler, gateway, decode, tmp_path, worker = running
    prefills_may_run = hold_prefills(worker)
    scheduler.send(job(tmp_path, "one", max_tokens=1))
    scheduler.expect(wire.Heartbeat, where=lambda beat: "one" in beat.request_ids)
    register_again(scheduler)
    prefills_may_run.set()
    assert gateway.poll(10_000)
    assert wire.recv(gateway).deltas[0].finish_reason == "length"
    told = told_of(scheduler, "one")
    assert [m.finish_reason for m in told if isinstance(m, wire.RequestDone)] == ["length"]
    assert_a_restarted_scheduler_lets_the_reservation_go(told, "one")


def test_a_job_of_an_earlier_registration_whose_kv_fails_after_it_is_lost_at_its_gateway(
    running,
):
    """Accepted before the scheduler restarted, prefilled after the worker registered again
    (a long prompt): its transfer counted as the new registration's, so when it failed (its
    decode worker went down with the old scheduler) only the new scheduler, which does not
    know the request, heard. A gateway that had the first token before it saw the restart
    waited for its watch of the orphaned stream to give up (30 s to a minute of silence).
    Its gateway is told at once that it is lost, and resumes it."""
    scheduler, gateway, decode, tmp_path, worker = running
    prefills_may_run = hold_prefills(worker)
    silent = f"ipc://{tmp_path}/silent.sock"  # its decode worker is gone
    scheduler.send(
        dataclasses.replace(job(tmp_path, "old", ignore_eos=True), decode_address=silent)
    )
    scheduler.expect(wire.Heartbeat, where=lambda beat: "old" in beat.request_ids)
    register_again(scheduler)
    prefills_may_run.set()
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.request_id == "old" and first.finish_reason is None
    done = scheduler.expect(wire.RequestDone, timeout_s=10)
    assert (done.request_id, done.finish_reason) == ("old", "error")
    assert gateway.poll(5_000), "its gateway never heard"
    lost = wire.recv(gateway).deltas[0]
    assert (lost.request_id, lost.finish_reason) == ("old", "lost")


def test_a_job_of_an_earlier_registration_that_fails_in_its_step_frees_its_reservation(
    running, monkeypatch
):
    """Accepted before the scheduler restarted, prefilled after, and failed for good in its
    step (here its prompt's logprobs past a header's bound; a grammar or the sampler the same
    way): its "rejected" reached the new scheduler before the decode worker listed the
    request, and was dropped; the reservation, adopted then, was held for nobody until its
    lease ran out, as one over at its first token was."""
    scheduler, gateway, decode, tmp_path, worker = running
    prefills_may_run = hold_prefills(worker)
    scored = job(tmp_path, "scored", ignore_eos=True)
    sampling = dataclasses.replace(scored.sampling, prompt_logprobs=5)
    scheduler.send(dataclasses.replace(scored, sampling=sampling))
    scheduler.expect(wire.Heartbeat, where=lambda beat: "scored" in beat.request_ids)
    register_again(scheduler)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 600)  # (the scored delta's is some 900)
    prefills_may_run.set()
    assert gateway.poll(10_000)
    assert wire.recv(gateway).deltas[0].finish_reason == "error"
    told = told_of(scheduler, "scored")
    monkeypatch.undo()
    assert [m.finish_reason for m in told if isinstance(m, wire.RequestDone)] == ["rejected"]
    assert_a_restarted_scheduler_lets_the_reservation_go(told, "scored")
