"""A message whose handling raises costs the request it names, not the worker and its batch: a
real worker loop (the tiny model, in a thread), its sockets, and the test playing the scheduler,
the gateway and the peer worker. The exception is injected once into the engine (no known one
is left: `test_worker_odd_values.py` looks for them); the worker must answer for the request as
its refusals do, let go of what the request held, count it, and serve the next request."""

from __future__ import annotations

import dataclasses
import time

import pytest
import zmq

from services.decode.service import DecodeWorker
from services.prefill.service import PrefillWorker
from services.worker.config import WorkerConfig
from shared import wire, wire_codec
from shared.engine.sampling_params import SamplingParams
from shared.failures import DEFAULT_LIMIT, FailureWindow, PersistentFailures
from tests.helpers import FailingModel, writes_into
from tests.integration.conftest import FakeScheduler, WorkerThread
from tests.integration.test_decode_worker import PROMPT, prefilled_transfer, stream_until_done


def raise_once(obj: object, name: str) -> None:
    """`obj.name` raises RuntimeError the first time it is called, and works after."""
    real = getattr(obj, name)

    def once(*args, **kwargs):
        setattr(obj, name, real)
        raise RuntimeError("injected")

    setattr(obj, name, once)


def next_delta(gateway: zmq.Socket) -> wire.TokenDelta:
    assert gateway.poll(10_000), "no delta streamed"
    return wire.recv(gateway).deltas[0]


def failures(worker, kind: str) -> float | None:
    return worker.events.registry.get_sample_value("tandem:message_failures_total", {"type": kind})


@pytest.fixture
def parties(tmp_path):
    context = zmq.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/s.sock")
    gateway = context.socket(zmq.PULL)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.bind(f"ipc://{tmp_path}/g.sock")
    yield context, scheduler, gateway, tmp_path
    context.destroy(linger=0)


def config(tmp_path, model_dir, **overrides) -> WorkerConfig:
    return WorkerConfig(
        scheduler_address=f"ipc://{tmp_path}/s.sock",
        model=str(model_dir),
        dtype="float32",
        kv_cache_bytes=1 << 20,
        block_size=4,
        **overrides,
    )


@pytest.fixture
def prefill(parties, tiny_model_dir):
    context, scheduler, gateway, tmp_path = parties
    decode = context.socket(zmq.ROUTER)  # plays the decode worker's KV socket
    decode.setsockopt(zmq.LINGER, 0)
    decode.bind(f"ipc://{tmp_path}/d.sock")
    worker = PrefillWorker(config(tmp_path, tiny_model_dir, peer_id="p"), context)
    thread = WorkerThread(worker).start()
    scheduler.expect(wire.Heartbeat)
    yield scheduler, gateway, decode, worker, tmp_path
    thread.stop()


def prefill_job(tmp_path, request_id: str) -> wire.PrefillJob:
    return wire.PrefillJob(
        request_id=request_id,
        prompt_token_ids=PROMPT,
        sampling=wire.SamplingSpec(max_tokens=8, temperature=0.0, ignore_eos=True),
        gateway_address=f"ipc://{tmp_path}/g.sock",
        decode_peer_id="d",
        decode_address=f"ipc://{tmp_path}/d.sock",
    )


def prefills_the_next_prompt(scheduler, gateway, decode, tmp_path) -> None:
    """The worker serves on: a prompt's first token streams, its KV ships and is acknowledged,
    and the scheduler hears the prefill is done."""
    scheduler.send(prefill_job(tmp_path, "r1"))
    assert next_delta(gateway).request_id == "r1"
    assert decode.poll(10_000)
    identity, transfer = wire.recv_from(decode)
    assert transfer.request_id == "r1"
    wire.send_to(decode, identity, wire.KvAck(request_id="r1", ok=True, error=None))
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("r1", None)


def test_a_prefill_job_that_raises_ends_its_request_and_the_worker_serves_on(prefill):
    scheduler, gateway, decode, worker, tmp_path = prefill
    raise_once(worker.engine, "add_request")
    scheduler.send(prefill_job(tmp_path, "poison"))
    delta = next_delta(gateway)
    assert (delta.request_id, delta.finish_reason) == ("poison", "error")
    assert delta.error == (
        "the prefill worker failed on this request's PrefillJob (RuntimeError; its log has the "
        "traceback)"
    )
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("poison", "rejected")  # not re-routed
    assert failures(worker, "PrefillJob") == 1

    prefills_the_next_prompt(scheduler, gateway, decode, tmp_path)
    heartbeat = scheduler.expect(wire.Heartbeat)
    assert heartbeat.request_ids == [] and heartbeat.num_running == 0


def test_a_prompt_the_model_fails_on_alone_ends_for_good_and_the_worker_serves_on(prefill):
    """A poison prompt by itself in a prefill worker (the idle cluster's case): the forward
    raises on it alone, the model runs a token of its own, so the request is to blame. It ends
    for good (an error to its gateway, "rejected" to the scheduler: resumed, it would end the
    next worker), and the worker prefills the next prompt. It used to exit, and the request,
    resumed, ended the next one, a bounded number of times."""
    scheduler, gateway, decode, worker, tmp_path = prefill
    engine = worker.engine
    engine.model = failing = FailingModel(engine.model, writes_into(engine, "poison"))
    scheduler.send(prefill_job(tmp_path, "poison"))
    delta = next_delta(gateway)
    assert (delta.request_id, delta.finish_reason) == ("poison", "error")
    assert delta.error == "the model failed on this request (RuntimeError)"
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("poison", "rejected")
    assert failing.num_raised == 1 and engine.num_model_failures == 1

    prefills_the_next_prompt(scheduler, gateway, decode, tmp_path)
    deadline = time.monotonic() + 5  # counted at the next heartbeat
    while worker.events.registry.get_sample_value("tandem:model_failures_total") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_messages_that_keep_failing_end_the_worker(parties, tiny_model_dir):
    """Straight through the guard, no thread (which would die with the worker)."""
    context, scheduler, gateway, tmp_path = parties
    worker = PrefillWorker(config(tmp_path, tiny_model_dir, peer_id="p"), context)
    worker.failures = FailureWindow(clock=lambda: 0.0)  # (the machine's speed does not decide)
    worker.engine.add_request = lambda *args, **kwargs: 1 / 0
    jobs = [prefill_job(tmp_path, f"r{index}") for index in range(DEFAULT_LIMIT + 1)]
    try:
        for job in jobs[:-1]:
            worker._handle_guarded(job, None)  # each refused, as above
        with pytest.raises(PersistentFailures):
            worker._handle_guarded(jobs[-1], None)
    finally:
        worker.close()
    assert failures(worker, "PrefillJob") == DEFAULT_LIMIT + 1
    refused = [next_delta(gateway) for _ in range(DEFAULT_LIMIT)]
    assert [delta.request_id for delta in refused] == [job.request_id for job in jobs[:-1]]
    assert all("ZeroDivisionError" in delta.error for delta in refused)


@pytest.fixture
def decode(parties, tiny_model_dir):
    context, scheduler, gateway, tmp_path = parties
    settings = config(tmp_path, tiny_model_dir, peer_id="d", address=f"ipc://{tmp_path}/d.sock")
    worker = DecodeWorker(settings, context)
    thread = WorkerThread(worker).start()
    scheduler.expect(wire.Heartbeat)
    peer = context.socket(zmq.DEALER)  # plays the prefill worker
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(settings.address)
    yield scheduler, gateway, peer, worker, f"ipc://{tmp_path}/g.sock", tiny_model_dir
    thread.stop()


def test_a_kv_transfer_that_raises_is_refused_its_blocks_freed_and_the_worker_serves_on(decode):
    scheduler, gateway, peer, worker, gateway_address, model_dir = decode
    total = worker.blocks.num_blocks
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for request_id in ("poison", "r1"):
        scheduler.send(wire.Reserve(request_id=request_id, num_tokens=len(PROMPT) + 1, lease_s=30))
        assert scheduler.expect(wire.ReserveReply).ok
        if request_id == "poison":
            raise_once(worker.engine, "add_prefilled")
        transfer, _ = prefilled_transfer(model_dir, request_id, gateway_address, params)
        wire.send(peer, transfer)
        assert peer.poll(10_000)
        ack = wire.recv(peer)
        if request_id == "poison":
            # Refused as a KV the worker cannot take: the prefill worker reports the attempt
            # failed, and the request is resumed elsewhere (a bounded number of times).
            assert (ack.request_id, ack.ok) == ("poison", False)
            assert "failed on this request's KvTransfer (RuntimeError" in ack.error
            beat = scheduler.expect(wire.Heartbeat, where=lambda h: h.num_free_blocks == total)
            assert beat.request_ids == []  # its reservation let go
    assert ack.ok and ack.request_id == "r1"
    assert len(stream_until_done(gateway)) == 4
    assert failures(worker, "KvTransfer") == 1


def test_a_reservation_that_raises_is_refused_and_the_worker_serves_on(decode):
    scheduler, gateway, peer, worker, gateway_address, model_dir = decode
    raise_once(worker.engine, "pin_cached_prefix")
    reserve = wire.Reserve(request_id="poison", num_tokens=len(PROMPT) + 1, lease_s=30,
                           token_ids=PROMPT)  # fmt: skip
    scheduler.send(reserve)
    reply = scheduler.expect(wire.ReserveReply)
    assert (reply.request_id, reply.ok) == ("poison", False)
    assert reply.num_free_blocks == worker.blocks.num_blocks
    scheduler.send(wire.Reserve(request_id="r1", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    assert failures(worker, "Reserve") == 1


def test_a_sequence_the_sampler_fails_on_ends_with_its_error_and_the_worker_goes_on(decode):
    """The sampler's own guard (`LLMEngine._sample`; a shared batch is
    `tests/engine/test_engine.py`'s), in a real decode worker: a sequence whose parameters make
    the sampler raise (a stop id past the vocabulary, put back past the engine's check) ends
    with the error at its gateway and the scheduler; the next decodes to the end."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = decode
    real = worker.engine.add_prefilled

    def add_then_poison(request_id, *args, **kwargs):
        real(request_id, *args, **kwargs)
        if request_id == "poison":
            seq = worker.engine._sequences[request_id]
            seq.params = dataclasses.replace(seq.params, stop_token_ids=(10**9,), min_tokens=3)

    worker.engine.add_prefilled = add_then_poison
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    for request_id in ("poison", "r1"):  # both reserved before either decodes and reports
        scheduler.send(wire.Reserve(request_id=request_id, num_tokens=len(PROMPT) + 6, lease_s=30))
        assert scheduler.expect(wire.ReserveReply).ok
    for request_id in ("poison", "r1"):
        transfer, _ = prefilled_transfer(model_dir, request_id, gateway_address, params)
        wire.send(peer, transfer)
        assert peer.poll(10_000) and wire.recv(peer).ok
    ended = {}
    while len(ended) < 2:
        delta = next_delta(gateway)
        if delta.finish_reason is not None:
            ended[delta.request_id] = (delta.finish_reason, delta.error)
    assert ended == {
        "poison": ("abort", "the sampler failed on this request (IndexError)"),
        "r1": ("length", None),
    }
    reports = [scheduler.expect(wire.RequestDone) for _ in range(2)]
    assert {(done.request_id, done.finish_reason) for done in reports} == {
        ("poison", "abort"),
        ("r1", "length"),
    }
    assert worker.engine.num_sampler_failures == 1
    deadline = time.monotonic() + 5  # counted as the step that ended it returns
    while worker.events.registry.get_sample_value("tandem:sampler_failures_total") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_sequence_the_model_fails_on_ends_with_its_error_and_the_worker_goes_on(decode):
    """The model's own guard (`LLMEngine._forward`; by hand in `tests/engine/test_engine.py`),
    in a real decode worker: once a second request joins it, a sequence whose chunk makes the
    forward raise, in its batch and alone, ends with the error at its gateway and the
    scheduler; the worker lives, and the other request decodes to the end."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = decode
    engine = worker.engine
    poison_writes = writes_into(engine, "poison")
    engine.model = failing = FailingModel(
        engine.model, lambda batch, size: "r1" in engine._sequences and poison_writes(batch, size)
    )
    lengths = {"poison": 60, "r1": 6}  # the poison still decoding when r1 joins it
    for request_id, max_tokens in lengths.items():
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        num_tokens = len(PROMPT) + max_tokens
        scheduler.send(wire.Reserve(request_id=request_id, num_tokens=num_tokens, lease_s=30))
        assert scheduler.expect(wire.ReserveReply).ok
        transfer, _ = prefilled_transfer(model_dir, request_id, gateway_address, params)
        wire.send(peer, transfer)
        assert peer.poll(10_000) and wire.recv(peer).ok
    ended, num_tokens = {}, dict.fromkeys(lengths, 0)
    while len(ended) < 2:
        assert gateway.poll(10_000), "no delta streamed"
        for delta in wire.recv(gateway).deltas:  # (the step's deltas travel together)
            num_tokens[delta.request_id] += len(delta.token_ids)
            if delta.finish_reason is not None:
                ended[delta.request_id] = (delta.finish_reason, delta.error)
    assert ended == {
        "poison": ("abort", "the model failed on this request (RuntimeError)"),
        "r1": ("length", None),
    }
    assert num_tokens["r1"] == 6 and num_tokens["poison"] < 60
    reports = [scheduler.expect(wire.RequestDone) for _ in range(2)]
    assert {(done.request_id, done.finish_reason) for done in reports} == {
        ("poison", "abort"),
        ("r1", "length"),
    }
    assert failing.num_raised == 2 and engine.num_model_failures == 1
    deadline = time.monotonic() + 5  # counted at the next heartbeat
    while worker.events.registry.get_sample_value("tandem:model_failures_total") != 1:
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_scheduler_messages_from_a_peer_socket_are_dropped(decode):
    """The KV socket takes KV from any prefill worker: a scheduler's message arriving there
    (a HelloAck saying the scheduler forgot this worker, a Reserve, a Cancel) is not the
    scheduler's. Taken for one, a HelloAck made the worker say HELLO again, and the scheduler
    then dropped the worker with every request on it."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = decode
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    scheduler.send(wire.Reserve(request_id="r1", num_tokens=len(PROMPT) + 64, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, prefilled_transfer(model_dir, "r1", gateway_address, params)[0])
    assert peer.poll(10_000) and wire.recv(peer).ok
    forgotten = wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=False,
                              error=wire.UNKNOWN_PEER, heartbeat_interval_s=0.1)  # fmt: skip
    wire.send(peer, forgotten)
    wire.send(peer, wire.Reserve(request_id="r2", num_tokens=8, lease_s=30))
    wire.send(peer, wire.Cancel(request_id="r1", reason="not from the scheduler"))
    with pytest.raises(TimeoutError):
        scheduler.expect(wire.Hello, timeout_s=1.5)
    assert "r2" not in worker.reservations
    assert len(stream_until_done(gateway)) == 64  # r1 ran to its end, not cancelled


def test_kv_too_large_for_one_message_ends_its_request_not_the_worker(prefill, monkeypatch):
    """A prompt whose KV is more than a message may carry (a tensor travels in frames of 256
    MiB each, up to 64 GiB) made the KvTransfer's encode raise in the worker's step: the worker
    ended, and so did each worker the request was resumed on. The limit is lowered here so the
    tiny model's KV passes it; the request ends for good, and the worker serves on."""
    scheduler, gateway, decode, worker, tmp_path = prefill
    monkeypatch.setattr(wire_codec, "MAX_TENSOR_BYTES", 64)
    scheduler.send(prefill_job(tmp_path, "huge"))
    assert next_delta(gateway).request_id == "huge"  # its first token streamed
    delta = next_delta(gateway)
    assert (delta.request_id, delta.finish_reason) == ("huge", "error")
    assert "its KV cannot be sent" in delta.error and "than a message can carry" in delta.error
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("huge", "rejected")  # not re-routed
    monkeypatch.undo()
    prefills_the_next_prompt(scheduler, gateway, decode, tmp_path)
    assert scheduler.expect(wire.Heartbeat).request_ids == []


def test_prompt_logprobs_too_large_for_one_header_end_their_request_not_the_worker(
    prefill, monkeypatch
):
    """A first token with its prompt's logprobs goes in a message of its own, whose header is
    bounded (16 MiB: a prompt of some 80,000 tokens with 20 top logprobs each). Past the bound
    the encode raised in the worker's step and ended the worker. The bound is lowered here
    below the scored delta's size, above the worker's other messages'."""
    scheduler, gateway, decode, worker, tmp_path = prefill
    scored = prefill_job(tmp_path, "scored")
    sampling = dataclasses.replace(scored.sampling, prompt_logprobs=5)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 1024)
    scheduler.send(dataclasses.replace(scored, sampling=sampling))
    delta = next_delta(gateway)
    assert (delta.request_id, delta.finish_reason) == ("scored", "error")
    assert "its prompt logprobs cannot be sent" in delta.error and "more than" in delta.error
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("scored", "rejected")
    assert not decode.poll(500)  # no KV went
    monkeypatch.undo()
    prefills_the_next_prompt(scheduler, gateway, decode, tmp_path)
    assert scheduler.expect(wire.Heartbeat).request_ids == []


def test_kv_awaiting_a_grant_is_let_go_when_the_scheduler_forgets_the_worker(prefill):
    """A speculative prefill's KV waits for the scheduler's grant (the decode worker's room
    confirmed). A scheduler that restarted (or dropped this worker) sends none: the KV stayed
    out of the pool, listed in every heartbeat, for the worker's life, and the client, which
    had its first token, waited for the rest. Registering again, the worker lets it go and
    tells the gateway the attempt is lost, which resumes it from its tokens."""
    scheduler, gateway, decode, worker, tmp_path = prefill
    job = dataclasses.replace(prefill_job(tmp_path, "parked"), await_grant=True)
    scheduler.send(job)
    first = next_delta(gateway)
    assert first.request_id == "parked" and first.token_ids
    assert scheduler.expect(wire.Heartbeat, where=lambda h: "parked" in h.request_ids)
    forgotten = wire.HelloAck(schema_version=wire.SCHEMA_VERSION, accepted=False,
                              error=wire.UNKNOWN_PEER, heartbeat_interval_s=0.1)  # fmt: skip
    scheduler.send(forgotten)
    scheduler.expect(wire.Hello)
    lost = next_delta(gateway)
    assert (lost.request_id, lost.finish_reason) == ("parked", "lost")
    assert "registered again" in lost.error
    assert scheduler.expect(wire.Heartbeat).request_ids == []
    assert worker.engine.block_manager.num_free_blocks == worker.engine.block_manager.num_blocks
    assert not decode.poll(200)  # no KV went anywhere


@pytest.mark.parametrize("worker_class", [PrefillWorker, DecodeWorker])
def test_a_stopping_worker_says_goodbye(parties, tiny_model_dir, worker_class):
    """On SIGTERM (a scale-down, a rolling restart) the worker tells the scheduler, which
    re-routes what it held at once instead of after a heartbeat timeout of silence."""
    context, scheduler, gateway, tmp_path = parties
    settings = config(tmp_path, tiny_model_dir, peer_id="w", address=f"ipc://{tmp_path}/w.sock")
    thread = WorkerThread(worker_class(settings, context)).start()
    scheduler.expect(wire.Heartbeat)
    thread.stop()
    assert scheduler.expect(wire.Goodbye, timeout_s=5).peer_id == "w"


def test_kv_whose_repeated_first_delta_is_too_large_goes_without_the_repeat(prefill, monkeypatch):
    """A first token with its prompt's logprobs fits a header of its own, but the KV transfer
    carries that delta again (for a gateway the first copy never reached) with the prompt's
    ids and the rest: past the bound, the request ended for good after its first token
    streamed ("its KV cannot be sent"), a prompt the cluster serves fine a little shorter. The
    KV goes without the repeat (a gateway missing the first token resumes the request). The
    bound is lowered here between the scored delta's message and the transfer's header."""
    scheduler, gateway, decode, worker, tmp_path = prefill
    scored = prefill_job(tmp_path, "probe")
    scored = dataclasses.replace(
        scored, sampling=dataclasses.replace(scored.sampling, prompt_logprobs=5)
    )
    scheduler.send(scored)
    assert gateway.poll(10_000)
    delta_header = len(gateway.recv_multipart()[1])
    assert decode.poll(10_000)
    identity, *frames = decode.recv_multipart()
    transfer_header = len(frames[1])
    assert delta_header < transfer_header
    wire.send_to(decode, identity, wire.KvAck(request_id="probe", ok=True, error=None))
    assert scheduler.expect(wire.RequestDone).finish_reason is None
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", (delta_header + transfer_header) // 2)
    scheduler.send(dataclasses.replace(scored, request_id="scored"))
    first = next_delta(gateway)
    assert (first.request_id, first.finish_reason) == ("scored", None)
    assert first.prompt_logprobs is not None
    assert decode.poll(10_000), "no KV went"
    identity, transfer = wire.recv_from(decode)
    assert (transfer.request_id, transfer.first_delta) == ("scored", None)
    assert transfer.output_token_ids == first.token_ids
    assert not gateway.poll(200)  # no error followed the first token
    wire.send_to(decode, identity, wire.KvAck(request_id="scored", ok=True, error=None))
    done = scheduler.expect(wire.RequestDone)
    assert (done.request_id, done.finish_reason) == ("scored", None)
