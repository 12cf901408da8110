"""The decode worker's protocol: reservations as leases, KV admission and refusal, streaming."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import msgpack
import pytest
import zmq

from services.decode.service import DecodeWorker, Route
from services.worker.config import WorkerConfig
from shared import wire
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.loader import load_model
from shared.engine.prefix_cache import chain_hashes, root_hash
from shared.engine.sampling_params import SamplingParams
from shared.wire_convert import sampling_spec
from tests.integration.conftest import FakeScheduler, WorkerThread

PROMPT = [5, 17, 33, 9, 101, 7, 64, 12, 3, 99, 41, 8, 55, 21, 13, 77, 3, 250]


def decode_config(tmp_path, model_dir) -> WorkerConfig:
    """A decode worker `d` of the tiny model, its scheduler at `s.sock`, its KV at `d.sock`."""
    return WorkerConfig(
        scheduler_address=f"ipc://{tmp_path}/s.sock",
        address=f"ipc://{tmp_path}/d.sock",
        peer_id="d",
        model=str(model_dir),
        dtype="float32",
        kv_cache_bytes=1 << 20,
        block_size=4,
    )


@pytest.fixture
def setup(tmp_path, tiny_model_dir):
    context = zmq.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/s.sock")
    gateway = context.socket(zmq.PULL)
    gateway.bind(f"ipc://{tmp_path}/g.sock")
    config = decode_config(tmp_path, tiny_model_dir)
    worker = WorkerThread(DecodeWorker(config, context)).start()
    scheduler.expect(wire.Heartbeat)
    peer = context.socket(zmq.DEALER)
    peer.setsockopt(zmq.LINGER, 0)
    peer.connect(config.address)
    yield scheduler, gateway, peer, worker.worker, f"ipc://{tmp_path}/g.sock", tiny_model_dir
    worker.stop()
    peer.close()
    gateway.close()
    scheduler.socket.close()
    context.term()


def prefilled_transfer(model_dir, request_id, gateway_address, params, prompt=PROMPT):
    """What a prefill worker would send: the prompt's KV and the first token (and the delta
    that streamed it), computed here."""
    loaded = load_model(model_dir)
    engine = LLMEngine(
        loaded.model, EngineConfig(num_blocks=64, block_size=4, retain_finished=True)
    )
    (result,) = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    keys, values = engine.export_kv(result.request_id)
    return wire.KvTransfer(
        request_id=request_id,
        prompt_token_ids=prompt,
        output_token_ids=result.token_ids,
        sampling=sampling_spec(params),
        gateway_address=gateway_address,
        num_tokens=len(prompt),
        block_size=4,
        keys=keys,
        values=values,
        first_delta=wire.TokenDelta(request_id=request_id, token_ids=result.token_ids, index=0),
    ), loaded


def total_blocks(worker) -> int:
    return worker.blocks.num_blocks


def test_reserve_transfer_decode_and_stream(setup):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    transfer, loaded = prefilled_transfer(model_dir, "r1", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="r1", num_tokens=len(PROMPT) + 1, lease_s=30, attempt=3))
    reply = scheduler.expect(wire.ReserveReply)
    assert reply.ok and reply.attempt == 3  # (the scheduler tells its answers apart by it)
    wire.send(peer, transfer)
    ack = wire.recv(peer) if peer.poll(10_000) else None
    assert ack is not None and ack.ok, ack
    # The decode worker streams the first token again, ahead of its own: the gateway keeps
    # each once, by position, whichever arrives first.
    tokens = stream_until_done(gateway)
    assert tokens[0] == transfer.output_token_ids[0]
    expected = (
        LLMEngine(loaded.model, EngineConfig(num_blocks=64, block_size=4))
        .generate([PROMPT], params)[0]
        .token_ids
    )
    assert tokens == expected
    done = scheduler.expect(wire.RequestDone)
    assert (done.phase, done.finish_reason, done.num_output_tokens) == ("decode", "length", 5)
    assert done.output_length == len(tokens) == 6  # where its stream ended: the gateway checks
    heartbeat = scheduler.expect(wire.Heartbeat, where=lambda h: h.num_running == 0)
    assert heartbeat.num_free_blocks == total_blocks(worker)


def test_kv_without_reservation_is_refused(setup):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    transfer, _ = prefilled_transfer(model_dir, "nores", gateway_address, SamplingParams())
    wire.send(peer, transfer)
    assert peer.poll(10_000)
    ack = wire.recv(peer)
    assert not ack.ok and "no reservation" in ack.error


def test_lapsed_lease_frees_blocks_and_refuses_late_kv(setup):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    scheduler.send(wire.Reserve(request_id="slow", num_tokens=40, lease_s=0.3))
    reply = scheduler.expect(wire.ReserveReply)
    assert reply.ok and reply.num_free_blocks == total_blocks(worker) - 10
    time.sleep(0.6)
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert heartbeat.num_free_blocks == total_blocks(worker)
    transfer, _ = prefilled_transfer(model_dir, "slow", gateway_address, SamplingParams())
    wire.send(peer, transfer)
    assert peer.poll(10_000) and not wire.recv(peer).ok


def test_reservation_beyond_the_pool_is_refused(setup):
    scheduler, *_rest = setup
    worker = _rest[2]
    scheduler.send(
        wire.Reserve(
            request_id="huge", num_tokens=4 * total_blocks(worker) + 1, lease_s=5, attempt=2
        )
    )
    refused = scheduler.expect(wire.ReserveReply)
    assert not refused.ok and refused.attempt == 2


def test_cancel_of_a_reservation_frees_it(setup):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    scheduler.send(wire.Reserve(request_id="c", num_tokens=20, lease_s=60))
    assert scheduler.expect(wire.ReserveReply).ok
    scheduler.send(wire.Cancel(request_id="c", reason="test"))
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert heartbeat.num_free_blocks == total_blocks(worker)


def test_wrong_shaped_kv_is_refused_and_blocks_return(setup):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    transfer, _ = prefilled_transfer(model_dir, "bad", gateway_address, SamplingParams())
    scheduler.send(wire.Reserve(request_id="bad", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    broken = wire.KvTransfer(
        **{
            **{
                f: getattr(transfer, f)
                for f in (
                    "request_id",
                    "prompt_token_ids",
                    "output_token_ids",
                    "sampling",
                    "gateway_address",
                    "num_tokens",
                    "block_size",
                )
            },
            "keys": transfer.keys[:, :, :, :1].contiguous(),
            "values": transfer.values[:, :, :, :1].contiguous(),
        }
    )
    wire.send(peer, broken)
    assert peer.poll(10_000)
    ack = wire.recv(peer)
    assert not ack.ok and "shape" in ack.error
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert heartbeat.num_free_blocks == total_blocks(worker)


@pytest.mark.parametrize("spoil", ["cut", "extra_frame", "bad_field"])
def test_a_kv_transfer_that_fails_to_decode_is_refused_at_once_and_its_blocks_return(setup, spoil):
    """A KV transfer whose frames do not decode (a tensor frame cut short, a frame too many, a
    field out of bounds) but whose header names its request is refused by that id: dropped
    unanswered, its prefill worker waited out its transfer timeout (30 s) before the request
    was re-routed, and the reservation stayed held. The worker serves on: the request's sound
    KV, under a new reservation, is admitted and decoded."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, "cut", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="cut", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    frames = [bytes(frame) for frame in wire.encode(transfer)]
    if spoil == "cut":
        frames[2] = frames[2][:-4]  # the keys' frame, 4 bytes short
    elif spoil == "extra_frame":
        frames.append(b"\0" * 8)
    else:
        header = msgpack.unpackb(frames[1])  # (packed by hand: the sender's wire refuses it)
        header["block_size"] = "four"
        frames[1] = msgpack.packb(header, use_bin_type=True)
    peer.send_multipart(frames)
    assert peer.poll(5_000), "no answer to the KV that failed to decode"
    ack = wire.recv(peer)
    assert (ack.request_id, ack.ok) == ("cut", False) and "decode" in ack.error
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert "cut" not in heartbeat.request_ids
    scheduler.send(wire.Reserve(request_id="cut", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, transfer)
    assert peer.poll(10_000) and wire.recv(peer).ok
    assert len(stream_until_done(gateway)) == 3


def test_a_kv_transfer_that_fails_to_decode_leaves_a_running_request_alone(setup):
    """A transfer that does not decode, naming a request already decoding here (a duplicate,
    or a faulty peer's), is refused without touching that request."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, "r", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="r", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, transfer)
    assert peer.poll(10_000) and wire.recv(peer).ok
    frames = [bytes(frame) for frame in wire.encode(transfer)]
    peer.send_multipart([*frames[:2], frames[2][:-4], *frames[3:]])
    assert peer.poll(5_000)
    assert not wire.recv(peer).ok
    assert len(stream_until_done(gateway)) == 40  # it decoded on to its end


@pytest.mark.parametrize(
    "spoiled",
    [{"token_ids": [12345]}, {"index": 5}, {"request_id": "other"}, {"token_ids": []},
     {"finish_reason": "stop"}],
    ids=["token", "index", "request", "empty", "finished"],
)  # fmt: skip
def test_a_transfer_whose_first_delta_is_not_its_output_is_refused(setup, spoiled):
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, "r1", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="r1", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    first = dataclasses.replace(transfer.first_delta, **spoiled)
    wire.send(peer, dataclasses.replace(transfer, first_delta=first))
    assert peer.poll(10_000)
    ack = wire.recv(peer)
    assert not ack.ok and "first_delta" in ack.error
    assert not gateway.poll(200)  # nothing streamed
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert heartbeat.num_running == 0


def test_worker_registers_again_when_the_scheduler_forgot_it(setup):
    scheduler, *_ = setup
    scheduler.expect(wire.Heartbeat, where=lambda beat: not beat.cache_full)  # past the first
    scheduler.send(
        wire.HelloAck(
            schema_version=wire.SCHEMA_VERSION,
            accepted=False,
            error=wire.UNKNOWN_PEER,
            heartbeat_interval_s=0.0,
        )
    )
    hello = scheduler.expect(wire.Hello)
    assert hello.peer_id == "d" and hello.role == "decode"
    # Its next heartbeat carries its cache's whole set (the scheduler forgot it; the next full
    # set came up to 20 heartbeats later, 10 s at the default interval).
    assert scheduler.expect(wire.Heartbeat).cache_full


def stream_until_done(gateway, start: int = 0) -> list[int]:
    """The request's tokens from output position `start` on, from its deltas, each delta
    checked to start where the last ended."""
    tokens = []
    while True:
        assert gateway.poll(10_000), "no tokens streamed"
        delta = wire.recv(gateway).deltas[0]
        assert delta.index == start + len(tokens), (delta.index, start, tokens)
        tokens += delta.token_ids
        if delta.finish_reason:
            return tokens


def first_turn_here(setup, params: SamplingParams) -> tuple[list[int], Any]:
    """Turn 1 decoded on this worker (its KV handed over, its reply streamed): turn 2's prompt
    (turn 1's, the reply and three more tokens) and the model that prefilled it."""
    scheduler, gateway, peer, _, gateway_address, model_dir = setup
    transfer, loaded = prefilled_transfer(model_dir, "t1", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="t1", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, transfer)
    assert peer.poll(10_000) and wire.recv(peer).ok
    reply = stream_until_done(gateway)
    return PROMPT + reply + [9, 9, 9], loaded


def local_job(prompt: list[int], params: SamplingParams, gateway_address: str) -> wire.PrefillJob:
    """Turn 2 prefilled on the decode worker that holds its first five blocks."""
    return wire.PrefillJob(
        request_id="t2",
        prompt_token_ids=prompt,
        sampling=sampling_spec(params),
        gateway_address=gateway_address,
        decode_peer_id="d",
        decode_address="unused",
        num_skip_blocks=5,
    )


def test_next_turn_reservation_pins_cached_blocks_and_takes_only_the_rest(setup):
    """Turn 1 runs here; turn 2's reservation finds turn 1's prompt and reply blocks in the
    decode cache and pins them; a transfer carrying everything is refused, one carrying only
    the missing blocks is admitted, and the answer is the one a single engine gives."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, loaded = first_turn_here(setup, params)  # 18 + 6 + 3 tokens; 23 ran here

    def reserve(request_id: str) -> wire.ReserveReply:
        scheduler.send(
            wire.Reserve(
                request_id=request_id,
                num_tokens=len(prompt_2) + 1,
                lease_s=30,
                token_ids=prompt_2,
            )
        )
        return scheduler.expect(wire.ReserveReply)

    assert reserve("t2").num_cached_blocks == 23 // 4
    full, _ = prefilled_transfer(model_dir, "t2", gateway_address, params, prompt=prompt_2)
    wire.send(peer, full)  # carries block 0 on: this worker holds blocks 0-4 already
    assert peer.poll(10_000)
    refused = wire.recv(peer)
    assert not refused.ok and "first block 0" in refused.error
    assert reserve("t2").num_cached_blocks == 5
    partial = dataclasses.replace(
        full, first_block=5, keys=full.keys[:, 5:].clone(), values=full.values[:, 5:].clone()
    )
    wire.send(peer, partial)
    assert peer.poll(10_000) and wire.recv(peer).ok
    tokens = stream_until_done(gateway)
    expected = (
        LLMEngine(loaded.model, EngineConfig(num_blocks=64, block_size=4))
        .generate([prompt_2], params)[0]
        .token_ids
    )
    assert tokens == expected


def test_next_turn_prefilled_here_streams_the_right_answer_without_a_handoff(setup):
    """Conditional disaggregation: turn 2's short suffix is prefilled on the decode worker
    that kept turn 1; its first delta counts the cached tokens, and its prefill phase and then
    its decode phase are reported."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, loaded = first_turn_here(setup, params)
    assert scheduler.expect(wire.RequestDone).phase == "decode"
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(prompt_2) + 1, lease_s=30, token_ids=prompt_2)
    )
    assert scheduler.expect(wire.ReserveReply).num_cached_blocks == 5
    scheduler.send(local_job(prompt_2, params, gateway_address))
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.index == 0 and len(first.token_ids) == 1
    assert first.num_cached_tokens == 20  # the 5 blocks pinned: 23 tokens ran here in turn 1
    tokens = first.token_ids + stream_until_done(gateway, start=1)
    expected = (
        LLMEngine(loaded.model, EngineConfig(num_blocks=64, block_size=4))
        .generate([prompt_2], params)[0]
        .token_ids
    )
    assert tokens == expected
    phases = [scheduler.expect(wire.RequestDone) for _ in range(2)]
    assert [(d.phase, d.finish_reason) for d in phases] == [("prefill", None), ("decode", "length")]
    assert [d.output_length for d in phases] == [None, len(tokens)]
    assert worker.engine.num_computed_prompt_tokens < len(prompt_2)


def test_a_local_prefills_blocks_are_not_offered_before_the_engine_takes_them(setup):
    """The reservation of a prompt prefilled here went back to the pool as the job arrived, for
    the engine to take again at its next step: a RESERVE handled in between was offered them
    (and could evict the cached prefix the job was routed here for)."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, _ = first_turn_here(setup, params)
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(prompt_2) + 1, lease_s=30, token_ids=prompt_2)
    )
    reserved = scheduler.expect(wire.ReserveReply)
    assert reserved.ok and reserved.num_cached_blocks == 5
    job = local_job(prompt_2, params, gateway_address)
    greedy = wire.Reserve(request_id="x", num_tokens=(reserved.num_free_blocks + 1) * 4, lease_s=30)
    scheduler.send(job)
    scheduler.send(greedy)  # handled with the job, before the engine's next step
    refused = scheduler.expect(wire.ReserveReply)
    assert refused.request_id == "x" and not refused.ok
    assert gateway.poll(10_000)
    first = wire.recv(gateway).deltas[0]
    assert first.num_cached_tokens == 20  # its prefix was still there


def test_a_turn_evicted_to_host_ram_is_still_announced_and_pinned_from_there(setup):
    """A reservation that needs the whole pool evicts turn 1's cached blocks: they move to the
    host tier, the heartbeats keep announcing them (never as evicted), and turn 2's reservation
    copies them back and pins them, so only the rest would be sent."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, _ = first_turn_here(setup, params)
    turn_hashes = list(chain_hashes(root_hash(worker.engine.cache_key), prompt_2[:20], 4))
    everything = total_blocks(worker) * 4
    scheduler.send(wire.Reserve(request_id="hog", num_tokens=everything, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    scheduler.send(wire.Cancel(request_id="hog", reason="test"))
    announced: set[int] = set()

    def announces_the_turn(heartbeat: wire.Heartbeat) -> bool:
        assert not set(turn_hashes) & set(heartbeat.cache_evicted), "reported gone"
        announced.update(heartbeat.cache_stored)
        return set(turn_hashes) <= announced and worker.engine.host_tier.num_demoted_blocks > 0

    scheduler.expect(wire.Heartbeat, where=announces_the_turn)
    assert all(worker.engine.host_tier.holds(h) for h in turn_hashes)
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(prompt_2) + 1, lease_s=30, token_ids=prompt_2)
    )
    assert scheduler.expect(wire.ReserveReply).num_cached_blocks == 5
    assert worker.engine.host_tier.num_promoted_blocks == 5
    scheduler.send(  # turn 2 prefilled here: the blocks from host RAM count as host hits
        local_job(prompt_2, params, gateway_address)
    )
    assert gateway.poll(10_000) and wire.recv(gateway).deltas[0].num_cached_tokens == 20
    stream_until_done(gateway, start=1)
    assert worker.engine.prefix_cache.num_host_hit_tokens == 20
    assert worker.engine.config.finished_retention_s == 30.0  # the decode role's think time


def test_received_kv_is_named_by_the_reservations_tenant_not_the_transfers_salt(setup):
    """A prefill worker that shares its cache between tenants sends no salt; this worker does
    not share: the turn's blocks must be named by its tenant (as the RESERVE looked them up),
    so the tenant's next turn finds them and a request of no tenant does not."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, "t1", gateway_address, params)
    scheduler.send(
        wire.Reserve(request_id="t1", num_tokens=len(PROMPT) + 1, lease_s=30, cache_salt="acme")
    )
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, dataclasses.replace(transfer, cache_salt=None))
    assert peer.poll(10_000) and wire.recv(peer).ok
    prompt_2 = PROMPT + stream_until_done(gateway) + [9, 9, 9]  # 23 tokens ran here

    def num_cached_blocks(request_id: str, salt: str | None) -> int:
        scheduler.send(
            wire.Reserve(
                request_id=request_id,
                num_tokens=len(prompt_2) + 1,
                lease_s=30,
                token_ids=prompt_2,
                cache_salt=salt,
            )
        )
        return scheduler.expect(wire.ReserveReply).num_cached_blocks

    assert num_cached_blocks("other", None) == 0
    assert num_cached_blocks("t2", "acme") == 23 // 4


def test_a_transfer_already_at_max_tokens_ends_at_once_without_another_token(setup):
    """A transfer whose output already holds max_tokens tokens (a faulty or foreign prefill
    worker, which should have ended it at its first token) used to decode one more token than
    the client asked for: it ends at once, "length", as the prefill worker ends such a one."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, "full", gateway_address, params)
    scheduler.send(wire.Reserve(request_id="full", num_tokens=len(PROMPT) + 1, lease_s=30))
    assert scheduler.expect(wire.ReserveReply).ok
    wire.send(peer, transfer)
    assert peer.poll(10_000) and wire.recv(peer).ok
    assert gateway.poll(10_000)
    (delta,) = wire.recv(gateway).deltas
    assert delta.token_ids == transfer.output_token_ids and delta.index == 0
    assert delta.finish_reason == "length"
    done = scheduler.expect(wire.RequestDone)
    assert (done.phase, done.finish_reason) == ("decode", "length")
    assert (done.num_output_tokens, done.output_length) == (0, 1)
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert heartbeat.num_running == 0 and "full" not in heartbeat.request_ids


def test_a_resumed_job_prefilled_here_continues_after_its_earlier_output(setup):
    """A job with output tokens from an earlier attempt (a resumed request) prefilled here:
    its earlier tokens are part of what is computed, the stream goes on after them, and
    max_tokens counts them, as on a prefill worker and after a KV transfer. (The scheduler
    sends no resumed request here today; this worker took the prompt alone, regenerated the
    earlier tokens and streamed them at the wrong places, max_tokens past the client's.)"""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, loaded = first_turn_here(setup, params)
    scheduler.expect(wire.RequestDone)
    expected = (
        LLMEngine(loaded.model, EngineConfig(num_blocks=64, block_size=4))
        .generate([prompt_2], params)[0]
        .token_ids
    )
    earlier = expected[:2]
    tokens = [*prompt_2, *earlier]
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(tokens) + 1, lease_s=30, token_ids=tokens)
    )
    assert scheduler.expect(wire.ReserveReply).num_cached_blocks == 5
    job = local_job(prompt_2, params, gateway_address)
    job = dataclasses.replace(job, output_token_ids=earlier)
    scheduler.send(job)
    assert stream_until_done(gateway, start=2) == expected[2:]
    phases = [scheduler.expect(wire.RequestDone) for _ in range(2)]
    assert [(d.phase, d.finish_reason) for d in phases] == [("prefill", None), ("decode", "length")]
    assert phases[1].output_length == len(expected)


def test_a_resumed_job_prefilled_here_at_max_tokens_ends_at_once(setup):
    """A resumed job whose earlier output already holds max_tokens tokens ends at once,
    "length", without another token (as a transfer at max_tokens does)."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, _ = first_turn_here(setup, params)
    scheduler.expect(wire.RequestDone)
    earlier = [11, 12, 13, 14, 15, 16]
    tokens = [*prompt_2, *earlier]
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(tokens) + 1, lease_s=30, token_ids=tokens)
    )
    assert scheduler.expect(wire.ReserveReply).ok
    job = local_job(prompt_2, params, gateway_address)
    job = dataclasses.replace(job, output_token_ids=earlier)
    scheduler.send(job)
    assert gateway.poll(10_000)
    (delta,) = wire.recv(gateway).deltas
    assert (delta.token_ids, delta.index, delta.finish_reason) == ([], 6, "length")
    done = scheduler.expect(wire.RequestDone)
    assert (done.phase, done.finish_reason, done.output_length) == ("decode", "length", 6)
    heartbeat = scheduler.expect(
        wire.Heartbeat, where=lambda h: h.num_free_blocks == total_blocks(worker)
    )
    assert "t2" not in heartbeat.request_ids


def test_a_local_job_with_max_tokens_below_one_is_refused_naming_it(setup):
    """A job's sampling is checked before its max_tokens is read: max_tokens 0 is a refusal
    naming it, not an end at "length" with no token."""
    scheduler, gateway, peer, worker, gateway_address, model_dir = setup
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    prompt_2, _ = first_turn_here(setup, params)
    scheduler.expect(wire.RequestDone)
    scheduler.send(
        wire.Reserve(request_id="t2", num_tokens=len(prompt_2) + 1, lease_s=30, token_ids=prompt_2)
    )
    assert scheduler.expect(wire.ReserveReply).ok
    job = local_job(prompt_2, params, gateway_address)
    scheduler.send(
        dataclasses.replace(job, sampling=dataclasses.replace(job.sampling, max_tokens=0))
    )
    assert gateway.poll(10_000)
    (delta,) = wire.recv(gateway).deltas
    assert delta.finish_reason == "error" and "max_tokens" in delta.error
    done = scheduler.expect(wire.RequestDone)
    assert (done.phase, done.finish_reason) == ("prefill", "rejected")


def test_a_hand_back_of_an_earlier_registrations_sequence_tells_its_gateway_too(
    tmp_path, tiny_model_dir
):
    """A sequence handed back for recompute after the worker registered again (a scheduler
    restart) is told its gateway directly as well as reported: the new scheduler drops a
    report on an id the worker has not listed to it yet, and the gateway waited 30-60 s for
    its orphan watch. One of the current registration is only reported (the scheduler tells
    the gateway)."""
    context = zmq.Context()
    scheduler = FakeScheduler(context, f"ipc://{tmp_path}/s.sock")
    gateway = context.socket(zmq.PULL)
    gateway_address = f"ipc://{tmp_path}/g.sock"
    gateway.bind(gateway_address)
    # (Its loop not run: the test calls it.)
    worker = DecodeWorker(decode_config(tmp_path, tiny_model_dir), context)
    try:
        assert worker.streams.check(gateway_address) is None
        worker.routes["old"] = Route(gateway_address, 8, 3, 1, registration=0)
        worker._on_registered_again()  # (a restarted scheduler welcomed it)
        now = worker._registration
        worker.routes["new"] = Route(gateway_address, 8, 3, 1, registration=now)
        worker._hand_back("new")
        worker._hand_back("old")
        reports = [scheduler.expect(wire.RequestDone) for _ in range(2)]
        assert [(r.request_id, r.finish_reason) for r in reports] == [
            ("new", "preempted"),
            ("old", "preempted"),
        ]
        assert gateway.poll(5_000)
        (told,) = wire.recv(gateway).deltas
        assert (told.request_id, told.finish_reason) == ("old", "preempted")
        assert "scheduler restart" in told.error
        assert not gateway.poll(500)  # the current registration's: the scheduler tells it
    finally:
        worker.close()
        gateway.close()
        scheduler.socket.close()
        context.term()
