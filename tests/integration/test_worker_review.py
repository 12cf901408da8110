"""A worker driven turn by turn (its `_handle`, its `_step`) where the order of what arrives
matters: several messages handled before one step, as a busy worker's loop drains them."""

from __future__ import annotations

import dataclasses

import pytest
import zmq
from structlog.testing import capture_logs

from services.decode.service import DecodeWorker
from shared import wire
from shared.engine.sampling_params import SamplingParams
from tests.integration.test_decode_worker import PROMPT, decode_config, prefilled_transfer


@pytest.fixture
def decode(tmp_path, tiny_model_dir):
    context = zmq.Context()
    gateway = context.socket(zmq.PULL)
    gateway.setsockopt(zmq.LINGER, 0)
    gateway.bind(f"ipc://{tmp_path}/g.sock")
    # (Its scheduler is nobody: its messages queue.)
    worker = DecodeWorker(decode_config(tmp_path, tiny_model_dir), context)
    yield worker, gateway, f"ipc://{tmp_path}/g.sock", tiny_model_dir
    worker.close()
    context.destroy(linger=0)


def admitted(worker, model_dir, request_id: str, gateway_address: str, **first) -> None:
    """A reservation, then its KV (with its first delta changed by `first`), admitted."""
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    transfer, _ = prefilled_transfer(model_dir, request_id, gateway_address, params)
    transfer = dataclasses.replace(
        transfer, first_delta=dataclasses.replace(transfer.first_delta, **first)
    )
    reserve = wire.Reserve(request_id=request_id, num_tokens=len(PROMPT) + 1, lease_s=30)
    worker._handle(reserve, None)
    assert worker._admit(transfer).ok


def test_first_deltas_with_prompt_logprobs_each_go_in_a_message_of_their_own(decode, monkeypatch):
    """The decode worker streams each transfer's first delta again, prompt logprobs and all
    (up to a header's bound: the transfer carried it), with its first token. Two such admitted
    before one step went in one Tokens message, whose header was past the bound: the encode
    raised in the step, and the worker ended with every sequence it ran. The bound is lowered
    here between one scored delta's size and two's."""
    worker, gateway, gateway_address, model_dir = decode
    scores = [-1.5] * 200  # some 1,800 bytes in a header
    for request_id in ("a", "b"):
        admitted(worker, model_dir, request_id, gateway_address, prompt_logprobs=scores)
    monkeypatch.setattr(wire, "MAX_HEADER_BYTES", 3000)
    worker._step()
    received = {}
    while len(received) < 2 and gateway.poll(2000):
        deltas = wire.decode(gateway.recv_multipart()).deltas
        received.update((delta.request_id, delta) for delta in deltas)
    assert set(received) == {"a", "b"}
    assert all(d.prompt_logprobs == scores and len(d.token_ids) == 2 for d in received.values())


def test_a_kv_whose_reservation_was_cancelled_is_refused_without_a_warning(decode):
    """A stop string in the first token (or a client gone during the prefill) cancels the
    request before its KV arrives: the refusal is the usual end, logged at info, and its blocks
    are free. A KV refused for a fault (here a reservation too small) still warns."""
    worker, _, gateway_address, model_dir = decode
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    num_free = worker.blocks.num_free_blocks
    transfer, _ = prefilled_transfer(model_dir, "cut", gateway_address, params)
    worker._handle(wire.Reserve(request_id="cut", num_tokens=len(PROMPT) + 1, lease_s=30), None)
    worker._handle(wire.Cancel(request_id="cut", reason="stopped at its first token"), None)
    with capture_logs() as logs:
        assert not worker._admit(transfer).ok
    assert [(e["event"], e["log_level"]) for e in logs] == [("kv refused", "info")]
    assert worker.blocks.num_free_blocks == num_free
    small, _ = prefilled_transfer(model_dir, "small", gateway_address, params)
    worker._handle(wire.Reserve(request_id="small", num_tokens=1, lease_s=30), None)
    with capture_logs() as logs:
        assert not worker._admit(small).ok
    assert [(e["event"], e["log_level"]) for e in logs] == [("kv refused", "warning")]
