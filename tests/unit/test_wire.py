"""The wire schema: round trips of every message, tensors without copies, real sockets, and
refusal of malformed input with a `WireError` that names the problem."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

import msgpack
import pytest
import torch
import zmq
import zmq.asyncio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import wire
from shared.engine.sampling_params import SamplingParams
from shared.wire import MessageType, WireError
from shared.wire_codec import UNTRACK_MIN_LEN, _numel

# ----------------------------------------------------------------------------------------------
# Strategies derived from the field annotations, the same way the module derives its codecs.

_SMALL = 6  # generated lists and strings stay short; the bounds have their own tests


def _tensors(spec: wire.TensorOf) -> st.SearchStrategy[torch.Tensor]:
    """Arbitrary bytes as a tensor: float tensors then hold NaNs, infinities and subnormals too."""
    ndims = st.just(spec.ndim) if spec.ndim is not None else st.integers(0, 3)
    shapes = ndims.flatmap(lambda n: st.lists(st.integers(0, 3), min_size=n, max_size=n))

    def build(dtype_name: str, shape: list[int], seed: int) -> torch.Tensor:
        dtype = getattr(torch, dtype_name)
        numel = _numel(shape)
        generator = torch.Generator().manual_seed(seed)
        raw = torch.randint(
            0, 256, (numel * dtype.itemsize,), dtype=torch.uint8, generator=generator
        )
        return raw.view(dtype).reshape(shape)

    return st.builds(build, st.sampled_from(spec.dtypes), shapes, st.integers(0, 2**32 - 1))


def strategy_for(
    tp: Any, max_len: int | None = None, spec: Any = None, bounds: Any = None
) -> st.SearchStrategy:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        meta = tp.__metadata__
        max_len = next((m.value for m in meta if isinstance(m, wire.MaxLen)), max_len)
        spec = next((m for m in meta if isinstance(m, wire.TensorOf)), spec)
        bounds = next((m for m in meta if isinstance(m, wire.Range)), bounds)
        if any(isinstance(m, wire.PackedInt32) for m in meta):  # received as a TokenArray
            ids = st.lists(st.integers(-(2**31), 2**31 - 1), max_size=_SMALL)
            return ids.map(wire.TokenArray)
        return strategy_for(args[0], max_len, spec, bounds)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | strategy_for(inner, max_len, spec, bounds)
    if origin is Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(strategy_for(args[0]), max_size=min(max_len or _SMALL, _SMALL))
    if origin is tuple:
        return st.tuples(*map(strategy_for, args))
    if tp is float:
        return st.floats(allow_nan=False)  # NaN != NaN; NaN bits are covered by the tensors
    if tp is bool:
        return st.booleans()
    if tp is int and bounds is not None:
        return st.integers(bounds.low, bounds.high)
    if tp is int:
        return st.integers(-(2**63), 2**64 - 1)  # what msgpack carries
    if tp is str:
        return st.text(max_size=min(max_len or 20, 20))
    if tp is wire.Tensor:  # (torch.Tensor, as the wire annotates it)
        return _tensors(spec or wire.TensorOf())
    if dataclasses.is_dataclass(tp):
        hints = get_type_hints(tp, include_extras=True)
        fields = {f.name: strategy_for(hints[f.name]) for f in dataclasses.fields(tp)}
        return st.builds(tp, **fields)
    raise TypeError(tp)


def assert_same(a: Any, b: Any) -> None:
    """Equal, with tensors compared bit for bit (dtype, shape and bytes); token ids received
    (a `TokenArray`) as the sequence they were sent as."""
    if isinstance(a, wire.TokenArray):
        assert a == b and list(a) == list(b)
        return
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    elif dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name))
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("cls", wire.MESSAGE_CLASSES.values(), ids=lambda c: c.__name__)
def test_every_message_round_trips(cls):
    @settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def round_trip(msg):
        frames = wire.encode(msg)
        assert wire.peek_type(frames) == cls.TYPE == wire.message_type(msg)
        assert_same(wire.decode(frames), msg)
        assert_same(wire.decode([bytes(f) for f in frames]), msg)  # copied frames, too

    round_trip()


def test_message_codes_match_the_brief():
    codes = {code.name: int(code) for code in MessageType}
    assert list(codes.values()) == list(range(1, len(codes) + 1))  # dense, from 1
    assert wire.MESSAGE_CLASSES[MessageType.KV_TRANSFER] is wire.KvTransfer
    assert all(code == cls.TYPE for code, cls in wire.MESSAGE_CLASSES.items())


def test_sampling_spec_mirrors_the_engine_defaults():
    spec, params = wire.SamplingSpec(), SamplingParams()
    names = [f.name for f in dataclasses.fields(wire.SamplingSpec)]
    assert names == [f.name for f in dataclasses.fields(SamplingParams)]
    for name in names:
        value = getattr(params, name)
        assert getattr(spec, name) == (list(value) if isinstance(value, tuple) else value), name


def cancel_frames(**fields: Any) -> list[bytes]:
    return [
        bytes([MessageType.CANCEL]),
        msgpack.packb({"request_id": "r", "reason": "x", **fields}),
    ]


def test_header_is_a_plain_map_of_fields():
    frames = wire.encode(wire.Cancel(request_id="r-1", reason="client gone"))
    assert frames[0] == b"\x06"
    assert msgpack.unpackb(frames[1]) == {"request_id": "r-1", "reason": "client gone"}


def test_defaulted_fields_may_be_left_out_and_ints_pass_as_floats():
    header = {"request_id": "r", "num_tokens": 3, "lease_s": 5}
    reserve = wire.decode([b"\x07", msgpack.packb(header)])
    assert reserve.lease_s == 5.0 and type(reserve.lease_s) is float
    job = {
        "request_id": "r",
        "prompt_token_ids": packed([1, 2]),
        "sampling": {"temperature": 0},
        "gateway_address": "g",
        "decode_peer_id": "d",
        "decode_address": "a",
    }
    decoded = wire.decode([b"\x09", msgpack.packb(job)])
    assert decoded.sampling == wire.SamplingSpec(temperature=0.0) and decoded.output_token_ids == []


def test_a_million_prompt_tokens_are_accepted():
    msg = wire.PrefillJob(
        request_id="r",
        prompt_token_ids=list(range(wire.MAX_TOKEN_IDS)),
        sampling=wire.SamplingSpec(),
        gateway_address="g",
        decode_peer_id="d",
        decode_address="a",
    )
    assert wire.decode(wire.encode(msg)) == msg


def test_a_long_prompts_logprobs_travel_on_its_first_delta():
    """As many as the prompt has tokens (past the 4,096 of other lists), with their top n."""
    num = 8191
    delta = wire.TokenDelta(
        request_id="r",
        token_ids=[7],
        prompt_logprobs=[-1.5] * num,
        prompt_top_logprobs=[[(3, -0.5), (9, -2.0)]] * num,
        index=0,
    )
    assert wire.decode(wire.encode(wire.Tokens(deltas=[delta]))) == wire.Tokens(deltas=[delta])


def test_long_lists_of_atoms_are_decoded_off_the_collectors_books():
    """A list a receiver holds long (a worker's cache events, ids in a heartbeat) would have
    every item walked in each collection it lived through."""
    long = wire.decode(heartbeat(cache_stored=list(range(UNTRACK_MIN_LEN))))
    assert long.cache_stored == list(range(UNTRACK_MIN_LEN))
    assert not gc.is_tracked(long.cache_stored)
    short = wire.decode(heartbeat(cache_stored=list(range(UNTRACK_MIN_LEN - 1))))
    assert gc.is_tracked(short.cache_stored)  # the call would cost more than it saves
    ids = [f"r{i}" for i in range(UNTRACK_MIN_LEN)]
    assert not gc.is_tracked(wire.decode(heartbeat(request_ids=ids)).request_ids)
    # A list of containers stays tracked: it could be part of a cycle.
    deltas = [wire.TokenDelta(request_id=f"r{i}", token_ids=[1]) for i in range(UNTRACK_MIN_LEN)]
    assert gc.is_tracked(wire.decode(wire.encode(wire.Tokens(deltas=deltas))).deltas)


def test_prompts_travel_as_packed_int32s_and_arrive_as_token_arrays():
    """A queued prompt is held for its whole wait: 4 bytes a token, no int objects."""
    ids = [0, 1, -1, 2**31 - 1, -(2**31), 49151]
    for sent in (ids, tuple(ids), wire.TokenArray(ids)):
        frames = wire.encode(wire.Submit(
            request_id="r", prompt_token_ids=sent, sampling=wire.SamplingSpec(), tenant="t",
            priority=0, gateway_peer_id="g", arrival_time=0.0))  # fmt: skip
        assert msgpack.unpackb(frames[1])["prompt_token_ids"] == packed(ids)
        received = wire.decode(frames).prompt_token_ids
        assert type(received) is wire.TokenArray and received.itemsize == 4
        assert received == ids and ids == received and received == tuple(ids)
        assert list(received) == ids and received.tolist() == ids
        assert (received != ids) is False and received != ids[:-1] and received != ids + [0]
    assert wire.TokenArray([1, 2]) == wire.TokenArray([1, 2]) != wire.TokenArray([2, 1])
    assert wire.TokenArray([1]) != "1" and wire.TokenArray() == []


def test_a_deltas_token_ids_may_be_any_int32():
    for ids in ([-(2**31), 2**31 - 1], [0] * 9, [2**31 - 1] * 9):  # short, and past 8: C passes
        tokens = wire.Tokens(deltas=[wire.TokenDelta(request_id="r", token_ids=ids)])
        assert wire.decode(wire.encode(tokens)).deltas[0].token_ids == ids
    for spoiled in ([0] * 8 + [2**31], [0] * 8 + [True]):
        frames = wire.encode(
            wire.Tokens(deltas=[wire.TokenDelta(request_id="r", token_ids=spoiled)])
        )
        with pytest.raises(WireError, match=re.escape("Tokens.deltas[0].token_ids[8]")):
            wire.decode(frames)


@pytest.mark.parametrize("ids", [[2**31], [-(2**31) - 1], [1.0], ["1"], [None]])
def test_token_ids_that_do_not_fit_int32_are_refused_when_sent(ids):
    message = wire.Reserve(request_id="r", num_tokens=1, lease_s=1.0, token_ids=ids)
    with pytest.raises(WireError, match="token ids must be ints within int32"):
        wire.encode(message)


WORKER_COUNTS = {
    wire.Heartbeat: (
        "num_waiting", "num_running", "num_free_blocks", "num_total_blocks", "steps_completed",
        "num_swapped", "num_swap_preemptions", "num_recompute_preemptions", "cache_events_seq",
        "num_prefix_query_tokens", "num_prefix_hit_tokens",
    ),
    wire.ReserveReply: ("num_free_blocks", "num_cached_blocks"),
    wire.RequestDone: (
        "num_prompt_tokens", "num_output_tokens", "num_cached_tokens", "output_length"
    ),
}  # fmt: skip


@pytest.mark.parametrize("cls", WORKER_COUNTS, ids=lambda c: c.__name__)
def test_the_counts_a_worker_reports_are_bounded(cls):
    """The scheduler keeps them in C (its rooms) and sums them into the status it encodes
    again: 2**64 - 1 free blocks from one worker, or a running count that sums past what
    MessagePack carries, ended its loop."""
    code, header = {
        wire.Heartbeat: heartbeat(),
        wire.ReserveReply: wire.encode(
            wire.ReserveReply(request_id="r", peer_id="d", ok=True, num_free_blocks=0)
        ),
        wire.RequestDone: wire.encode(
            wire.RequestDone(request_id="r", peer_id="p", phase="decode", finish_reason=None,
                             num_prompt_tokens=0, num_output_tokens=0)
        ),
    }[cls]  # fmt: skip
    for name in WORKER_COUNTS[cls]:
        for value in (-1, wire.MAX_COUNT + 1, 2**64 - 1):
            fields = {**msgpack.unpackb(header), name: value}
            outside = f"{cls.__name__}.{name}: {value} is outside [0, {wire.MAX_COUNT}]"
            with pytest.raises(WireError, match=re.escape(outside)):
                wire.decode([code, msgpack.packb(fields)])
        fields = {**msgpack.unpackb(header), name: wire.MAX_COUNT}
        assert getattr(wire.decode([code, msgpack.packb(fields)]), name) == wire.MAX_COUNT
    if cls is wire.Heartbeat:  # a list of counts, checked in one pass, named item by item
        beat = {**msgpack.unpackb(header), "recent_batch_sizes": [3, 2**63]}
        with pytest.raises(WireError, match=re.escape("recent_batch_sizes[1]: 922337")):
            wire.decode([code, msgpack.packb(beat)])


def test_a_list_that_fails_the_one_pass_check_is_named_item_by_item():
    for spoiled, message in (
        ([0] * 100 + [True], "cache_stored[100]: expected int, got bool"),
        ([0] * 100 + [1.5], "cache_stored[100]: expected int, got float"),
        (["0"] + [0] * 100, "cache_stored[0]: expected int, got str"),
    ):
        with pytest.raises(WireError, match=re.escape(message)):
            wire.decode(heartbeat(cache_stored=spoiled))


# ----------------------------------------------------------------------------------------------
# Tensors


def kv_transfer(
    keys: torch.Tensor, values: torch.Tensor | None = None, **fields
) -> wire.KvTransfer:
    return wire.KvTransfer(
        **{
            "request_id": "r",
            "prompt_token_ids": [1, 2, 3],
            "output_token_ids": [4],
            "sampling": wire.SamplingSpec(seed=7),
            "gateway_address": "inproc://gw",
            "num_tokens": 3,
            "block_size": 4,
            "keys": keys,
            "values": keys if values is None else values,
            **fields,
        }
    )


def random_bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Every bit pattern is fair game: NaN payloads, infinities, -0.0, subnormals."""
    numel = torch.Size(shape).numel() * dtype.itemsize
    return torch.randint(0, 256, (numel,), dtype=torch.uint8).view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", [getattr(torch, name) for name in wire.DTYPE_NAMES], ids=str)
def test_tensors_round_trip_bit_exactly(dtype):
    keys, values = random_bits((2, 3, 4, 2, 8), dtype), random_bits((2, 3, 4, 2, 8), dtype)
    decoded = wire.decode(wire.encode(kv_transfer(keys, values)))
    assert decoded.keys.dtype == dtype and decoded.keys.shape == keys.shape
    if dtype.itemsize == 2:
        assert torch.equal(decoded.keys.view(torch.int16), keys.view(torch.int16))
    assert_same(decoded.keys, keys)
    assert_same(decoded.values, values)


def test_a_transfer_carries_the_first_tokens_delta():
    first = wire.TokenDelta(request_id="r", token_ids=[4], logprobs=[-0.25],
                            top_logprobs=[[(4, -0.25)]], num_cached_tokens=2, index=0)  # fmt: skip
    keys = torch.zeros((1, 1, 4, 1, 2))
    encoded = [bytes(f) for f in wire.encode(kv_transfer(keys, first_delta=first))]
    assert wire.decode(encoded).first_delta == first
    header = msgpack.unpackb(encoded[1])
    for spoiled in ("not a delta", {**header["first_delta"], "token_ids": ["4"]}):
        frames = [encoded[0], msgpack.packb({**header, "first_delta": spoiled}), *encoded[2:]]
        with pytest.raises(WireError, match="first_delta"):
            wire.decode(frames)


def test_bf16_special_values_survive():
    values = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, 3.14])
    keys = values.to(torch.bfloat16).reshape(1, 1, 1, 1, 7)
    decoded = wire.decode(wire.encode(kv_transfer(keys)))
    assert torch.equal(decoded.keys.view(torch.int16), keys.view(torch.int16))


def test_non_contiguous_and_empty_tensors():
    base = torch.randn(2, 4, 3, 2, 8)
    keys = base.transpose(1, 2)  # [2, 3, 4, 2, 8], not contiguous
    empty = torch.empty(2, 0, 4, 2, 8, dtype=torch.bfloat16)
    decoded = wire.decode(wire.encode(kv_transfer(keys, keys)))
    assert torch.equal(decoded.keys, keys)
    decoded = wire.decode(wire.encode(kv_transfer(empty, empty)))
    assert decoded.keys.shape == empty.shape and decoded.keys.dtype == torch.bfloat16


def test_generator_state_continues_the_draws():
    generator = torch.Generator().manual_seed(1234)
    torch.rand(5, generator=generator)
    state = wire.decode(
        wire.encode(kv_transfer(torch.zeros(1, 1, 1, 1, 1), generator_state=generator.get_state()))
    ).generator_state
    resumed = torch.Generator()
    resumed.set_state(state)
    assert torch.equal(torch.rand(5, generator=resumed), torch.rand(5, generator=generator))


def test_tensor_frames_are_views_of_the_tensor_memory():
    keys = torch.zeros(1, 2, 4, 2, 8, dtype=torch.bfloat16)
    frames = wire.encode(kv_transfer(keys))
    assert isinstance(frames[2], memoryview) and frames[2].nbytes == keys.nbytes
    keys[0, 0, 0, 0, 0] = 1.0  # the frame sees the write: no copy was made
    assert (
        bytes(frames[2][:2])
        == torch.tensor([1.0], dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes()
    )


def test_frames_keep_the_tensor_memory_alive():
    keys = torch.arange(64, dtype=torch.float32).reshape(1, 2, 4, 1, 8)
    expected = keys.numpy().tobytes()
    frames = wire.encode(kv_transfer(keys))
    del keys
    gc.collect()
    torch.full((64,), -1.0)  # reuse of freed memory would show here
    assert bytes(frames[2]) == expected


def test_decode_shares_writable_frames_and_copies_immutable_ones():
    keys = torch.randn(1, 2, 4, 2, 8)
    frames = wire.encode(kv_transfer(keys))
    shared = wire.decode(frames).keys
    assert shared.data_ptr() == keys.data_ptr()  # frombuffer over the writable view
    copied = wire.decode([bytes(f) for f in frames]).keys
    assert copied.data_ptr() != keys.data_ptr() and torch.equal(copied, keys)
    copied.zero_()  # a private, writable copy


# ----------------------------------------------------------------------------------------------
# Real sockets


@pytest.fixture
def context():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def socket_pair(ctx: zmq.Context, kinds: tuple[int, int], name: str):
    receiver, sender = ctx.socket(kinds[0]), ctx.socket(kinds[1])
    for socket in (receiver, sender):
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        socket.setsockopt(zmq.RCVTIMEO, 2000)
    receiver.bind(f"inproc://{name}")
    sender.connect(f"inproc://{name}")
    return sender, receiver


@pytest.mark.parametrize(
    "kinds", [(zmq.PAIR, zmq.PAIR), (zmq.PULL, zmq.PUSH)], ids=["pair", "push-pull"]
)
def test_tensors_cross_inproc_sockets(context, kinds):
    sender, receiver = socket_pair(context, kinds, f"kv-{kinds[0]}")
    # Large enough (256 KiB each) that pyzmq really sends without copying.
    msg = kv_transfer(random_bits((2, 4, 16, 2, 64), torch.bfloat16), torch.randn(2, 4, 16, 2, 64))
    sender.send_multipart(wire.encode(msg), copy=False)
    assert_same(wire.recv(receiver), msg)
    empty = kv_transfer(
        torch.empty(2, 0, 4, 2, 8), generator_state=torch.zeros(0, dtype=torch.uint8)
    )
    wire.send(sender, empty)
    assert_same(wire.recv(receiver), empty)
    wire.send(sender, wire.Cancel(request_id="r", reason="done"))
    assert wire.recv(receiver) == wire.Cancel(request_id="r", reason="done")


def test_a_tensor_larger_than_a_frame_crosses_a_bounded_socket_in_several(context, tmp_path):
    """A long prompt's KV on a big model (Llama-3-8B's keys are 128 KiB a token in bfloat16:
    a frame's bound at 2,048 tokens) failed the request for good, after its prefill. ZeroMQ
    bounds each frame (MAXMSGSIZE, as every service sets it), so the tensor goes in several."""
    sender, receiver = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    for socket in (sender, receiver):
        socket.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    receiver.bind(f"ipc://{tmp_path}/kv")
    sender.connect(f"ipc://{tmp_path}/kv")
    big = torch.zeros(1, 2, 4, 2, (wire.MAX_MESSAGE_BYTES + (1 << 20)) // 32, dtype=torch.float16)
    big[0, 1, 3, 1, -5:] = torch.arange(5)
    msg = kv_transfer(big, values=big)
    frames = wire.encode(msg)
    assert [memoryview(f).nbytes for f in frames[2:]] == 2 * [wire.MAX_MESSAGE_BYTES, 1 << 20]
    sender.send_multipart(frames, copy=False)
    assert receiver.poll(20_000)
    received = wire.recv(receiver)
    assert torch.equal(received.keys, big) and torch.equal(received.values, big)


@pytest.fixture
def small_frames(monkeypatch):
    """Frames of 64 bytes, so that tensors split without gigabytes."""
    from shared import wire_codec

    monkeypatch.setattr(wire_codec, "MAX_MESSAGE_BYTES", 64)


def test_tensors_over_several_frames_name_their_own_frames(small_frames):
    keys = random_bits((1, 2, 4, 2, 5), torch.bfloat16)  # 160 bytes: frames of 64, 64, 32
    state = torch.arange(70, dtype=torch.uint8)  # 70 bytes: 64, 6
    msg = kv_transfer(keys, values=torch.zeros(1, 1, 1, 1, 1), generator_state=state)
    frames = wire.encode(msg)
    header = msgpack.unpackb(frames[1])
    assert [header[name]["frame"] for name in ("keys", "values", "generator_state")] == [2, 5, 6]
    assert header["keys"]["num_frames"] == 3 and "num_frames" not in header["values"]
    assert [memoryview(f).nbytes for f in frames[2:]] == [64, 64, 32, 4, 64, 6]
    assert_same(wire.decode(frames), msg)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda h, f: h["keys"].update(num_frames=2), "travels in 3 frame"),
        (lambda h, f: h["keys"].pop("num_frames"), "travels in 3 frame"),
        (lambda h, f: h["keys"].update(num_frames=-1), "travels in 3 frame"),
        (lambda h, f: f.__setitem__(3, b"x" * 63), "hold \\[64, 63, 32\\] bytes"),
        (lambda h, f: h["values"].update(frame=4), "frame 4 is named twice"),
        (lambda h, f: f.pop(), "out of range"),
    ],
    ids=["too few", "one", "negative", "a short frame", "overlapping", "missing"],
)
def test_a_tensor_with_wrong_frames_is_refused_by_name(small_frames, change, message):
    msg = kv_transfer(
        random_bits((1, 2, 4, 2, 5), torch.bfloat16), values=torch.zeros(1, 1, 1, 1, 1)
    )
    frames = [bytes(f) for f in wire.encode(msg)]
    header = msgpack.unpackb(frames[1])
    change(header, frames)
    frames[1] = msgpack.packb(header)
    with pytest.raises(WireError, match=message):
        wire.decode(frames)


@pytest.mark.parametrize(
    "address", ["", "zz", "tcp://*:5", "tcp://host:port", "ipc://" + "x" * 200]
)
def test_an_address_zeromq_refuses_is_named_and_its_socket_closed(context, address):
    socket = context.socket(zmq.PUSH)
    refusal = wire.connect_refusal(socket, address)
    assert refusal is not None and refusal.startswith(f"address {address!r} cannot be connected")
    assert socket.closed  # a socket left open per refused address would leak its descriptors


def test_a_sound_address_is_connected(context):
    socket = context.socket(zmq.PUSH)
    socket.setsockopt(zmq.LINGER, 0)
    assert wire.connect_refusal(socket, "tcp://decode-1.cluster.local:7000") is None
    assert not socket.closed
    socket.close()


def test_router_helpers_name_the_peer(context):
    router = context.socket(zmq.ROUTER)
    router.bind("inproc://router")
    dealer = context.socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"decode-0")
    dealer.connect("inproc://router")
    ack = wire.KvAck(request_id="r", ok=True, error=None)
    wire.send(dealer, ack)
    assert wire.recv_from(router) == (b"decode-0", ack)
    wire.send_to(router, b"decode-0", wire.KvAck(request_id="r", ok=False, error="late"))
    assert wire.recv(dealer).error == "late"
    dealer.send_multipart([b"\x0c", b"\xc1"])
    with pytest.raises(WireError, match="decode-0.*not valid msgpack"):
        wire.recv_from(router)


def test_async_helpers_over_inproc():
    async def exchange() -> None:
        ctx = zmq.asyncio.Context()
        try:
            pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
            pull.bind("inproc://tokens")
            push.connect("inproc://tokens")
            delta = wire.TokenDelta(request_id="r", token_ids=[5], logprobs=[-0.5],
                                    top_logprobs=[[(5, -0.5), (9, -1.25)]], index=3)  # fmt: skip
            await wire.async_send(push, wire.Tokens(deltas=[delta]))
            assert await asyncio.wait_for(wire.async_recv(pull), 2) == wire.Tokens(deltas=[delta])

            router, dealer = ctx.socket(zmq.ROUTER), ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.IDENTITY, b"prefill-1")
            router.bind("inproc://sched")
            dealer.connect("inproc://sched")
            msg = kv_transfer(torch.randn(1, 2, 4, 2, 8))
            await wire.async_send(dealer, msg)
            identity, received = await asyncio.wait_for(wire.async_recv_from(router), 2)
            assert identity == b"prefill-1"
            assert_same(received, msg)
            await wire.async_send_to(
                router, identity, wire.KvAck(request_id="r", ok=True, error=None)
            )
            assert (await asyncio.wait_for(wire.async_recv(dealer), 2)).ok
        finally:
            ctx.destroy(linger=0)

    asyncio.run(exchange())


# ----------------------------------------------------------------------------------------------
# Malformed input


def tensor_frames(
    ref: dict | None = None, frames: list[bytes] | None = None, keys: Any = None
) -> list[bytes]:
    """A KV_TRANSFER with fp32 keys [1, 1, 1, 1, 2] whose `keys` ref and frames can be spoiled."""
    msg = kv_transfer(torch.ones(1, 1, 1, 1, 2))
    encoded = [bytes(f) for f in wire.encode(msg)]
    header = msgpack.unpackb(encoded[1])
    header["keys"] = keys if keys is not None else {**header["keys"], **(ref or {})}
    return [encoded[0], msgpack.packb(header), *(encoded[2:] if frames is None else frames)]


def heartbeat(**fields: Any) -> list[bytes]:
    header = dict(peer_id="p", num_waiting=0, num_running=0, num_free_blocks=1,
                  num_total_blocks=1, steps_completed=0, sent_at=0.0)  # fmt: skip
    return [b"\x03", msgpack.packb({**header, **fields})]


def packed(token_ids: list[int]) -> bytes:
    """Token ids as the wire carries them: little-endian int32s."""
    return b"".join(token.to_bytes(4, "little", signed=True) for token in token_ids)


def submit(**fields: Any) -> list[bytes]:
    header = dict(request_id="r", prompt_token_ids=packed([1]), sampling={}, tenant="t", priority=0,
                  gateway_peer_id="g", arrival_time=0.0)  # fmt: skip
    return [b"\x04", msgpack.packb({**header, **fields})]


def hello(**fields: Any) -> list[bytes]:
    header = dict(schema_version=1, role="decode", peer_id="d", model="m", address=None,
                  num_kv_blocks=8, block_size=4, max_num_seqs=2)  # fmt: skip
    return [b"\x01", msgpack.packb({**header, **fields})]


GARBAGE = {
    "no frames": ([], "empty message"),
    "empty type frame": ([b"", b"\x80"], "one byte, got 0"),
    "long type frame": ([b"\x01\x02", b"\x80"], "one byte, got 2"),
    "unknown type": ([b"\x63", b"\x80"], "unknown message type 99"),
    "no header": ([b"\x06"], "missing header frame"),
    "bad msgpack": ([b"\x06", b"\xc1"], "not valid msgpack"),
    "truncated msgpack": ([b"\x06", b"\x82\xaarequest_id"], "not valid msgpack"),
    "trailing bytes": ([b"\x06", msgpack.packb({}) + b"\x00"], "not valid msgpack"),
    "header is a list": ([b"\x06", msgpack.packb(["r", "x"])], "header must be a map, got list"),
    "header too large": ([b"\x06", bytes(wire.MAX_HEADER_BYTES + 1)], "exceeds"),
    "int map keys": ([b"\x06", msgpack.packb({1: "r"})], "not valid msgpack"),
    "binary value": (cancel_frames(reason=b"bytes"), "Cancel.reason: expected str, got bytes"),
    "ext type": (cancel_frames(reason=msgpack.ExtType(5, b"x")), "extension type 5"),
    "unknown field": (cancel_frames(bogus=1), "Cancel: unknown field(s) ['bogus']"),
    "missing field": (
        [b"\x06", msgpack.packb({"request_id": "r"})],
        "missing required field(s) ['reason']",
    ),
    "bool for int": (heartbeat(num_waiting=True), "Heartbeat.num_waiting: expected int, got bool"),
    "float for int": (heartbeat(num_running=1.0), "Heartbeat.num_running: expected int, got float"),
    "str for float": (heartbeat(sent_at="now"), "Heartbeat.sent_at: expected float, got str"),
    "bool for float": (heartbeat(sent_at=False), "Heartbeat.sent_at: expected float, got bool"),
    "None for str": (heartbeat(peer_id=None), "Heartbeat.peer_id: expected str, got None"),
    "str for token ids": (
        submit(prompt_token_ids="1 2 3"),
        "Submit.prompt_token_ids: expected packed int32 token ids, got str",
    ),
    "list for token ids": (
        submit(prompt_token_ids=[1, 2]),
        "Submit.prompt_token_ids: expected packed int32 token ids, got list",
    ),
    "token ids cut short": (
        submit(prompt_token_ids=packed([1, 2])[:-1]),
        "Submit.prompt_token_ids: 7 bytes are not a whole number of int32s",
    ),
    "str in int list": (
        submit(sampling={"stop_token_ids": [1, "2"]}),
        "Submit.sampling.stop_token_ids[1]: expected int",
    ),
    "bool in int list": (
        submit(sampling={"stop_token_ids": [True]}),
        "Submit.sampling.stop_token_ids[0]: expected int, got bool",
    ),
    "int in str list": (
        heartbeat(request_ids=["r1", 7]),
        "Heartbeat.request_ids[1]: expected str, got int",
    ),
    "long id in a list of ids": (
        heartbeat(request_ids=["r1", "r" * 129]),
        "Heartbeat.request_ids[1]: string of 129 chars exceeds 128",
    ),
    "list for map": (submit(sampling=[]), "Submit.sampling: expected a map, got list"),
    "nested wrong type": (submit(sampling={"top_k": True}), "Submit.sampling.top_k: expected int"),
    "nested unknown field": (
        submit(sampling={"beam": 2}),
        "Submit.sampling: unknown field(s) ['beam']",
    ),
    "bad literal": (
        hello(role="router"),
        "Hello.role: expected one of ['gateway', 'prefill', 'decode']",
    ),
    "request id too long": (
        submit(request_id="r" * 129),
        "Submit.request_id: string of 129 chars exceeds 128",
    ),
    "string too long": (
        submit(tenant="é" * 4097),
        "Submit.tenant: string of 4097 chars exceeds 4096",
    ),
    "list too long": (
        submit(sampling={"stop_token_ids": [0] * 4097}),
        "list of 4097 entries exceeds 4096",
    ),
    "prompt too long": (submit(prompt_token_ids=bytes(4 * wire.MAX_TOKEN_IDS + 4)), "max_bin_len"),
    "token id past int32 in a delta": (
        [b"\x0a", msgpack.packb({"deltas": [{"request_id": "r", "token_ids": [1, 2**31]}]})],
        "Tokens.deltas[0].token_ids[1]: 2147483648 is outside [-2147483648, 2147483647]",
    ),
    "token id below int32 in a delta": (
        [b"\x0a", msgpack.packb({"deltas": [{"request_id": "r", "token_ids": [-(2**31) - 1]}]})],
        "Tokens.deltas[0].token_ids[0]: -2147483649 is outside [-2147483648, 2147483647]",
    ),
    "negative count in a short list": (
        heartbeat(recent_batch_sizes=[1, -1]),
        "Heartbeat.recent_batch_sizes[1]: -1 is outside",
    ),
    "int list too long": (heartbeat(cache_stored=[0] * (wire.MAX_TOKEN_IDS + 1)), "max_array_len"),
    "deep nested path": (
        [
            b"\x0a",
            msgpack.packb(
                {"deltas": [{"request_id": "r", "token_ids": [1], "top_logprobs": [[[1, 0.5, 2]]]}]}
            ),
        ],
        "Tokens.deltas[0].top_logprobs[0][0]: expected an array of 2",
    ),
    "deep nested pair item": (
        [
            b"\x0a",
            msgpack.packb(
                {
                    "deltas": [
                        {"request_id": "r", "token_ids": [1]},
                        {
                            "request_id": "s",
                            "token_ids": [2],
                            "top_logprobs": [[[1, 0.5], [2, "x"]]],
                        },
                    ]
                }
            ),
        ],
        "Tokens.deltas[1].top_logprobs[0][1][1]: expected float, got str",
    ),
    "frame out of range": (
        tensor_frames({"frame": 9}),
        "KvTransfer.keys: tensor frame index 9 out of range",
    ),
    "frame index of header": (tensor_frames({"frame": 1}), "tensor frame index 1 out of range"),
    "frame named twice": (tensor_frames({"frame": 3}), "tensor frame 3 is named twice"),
    "byte length mismatch": (
        tensor_frames(frames=[b"\x00" * 10, b"\x00" * 8]),
        "holds 10 bytes, but float32[1, 1, 1, 1, 2] needs 8",
    ),
    "missing tensor frame": (tensor_frames(frames=[b"\x00" * 8]), "out of range"),
    "extra frame": (
        tensor_frames(frames=[b"\x00" * 8, b"\x00" * 8, b"x"]),
        "frames [4] are not named",
    ),
    "bad dtype": (tensor_frames({"dtype": "float64"}), "keys.dtype: expected one of"),
    "wrong ndim": (tensor_frames({"shape": [2, 1]}), "tensor of 2 dims, expected 5"),
    "negative dim": (tensor_frames({"shape": [1, 1, 1, -1, -2]}), "negative size"),
    # An empty tensor's bytes match any other sizes: torch raised on these (TypeError on a size
    # past int64, RuntimeError on strides that overflow), and a worker's loop died of it.
    "empty tensor, size past int64": (
        tensor_frames({"shape": [0, 2**64 - 1, 1, 1, 1]}, frames=[b"", b"\x00" * 8]),
        "sizes [0, 18446744073709551615, 1, 1, 1] hold more elements than a message",
    ),
    "empty tensor, strides overflow": (
        tensor_frames({"shape": [0, 2**62, 4, 1, 1]}, frames=[b"", b"\x00" * 8]),
        "hold more elements than a message",
    ),
    "tensor ref unknown key": (tensor_frames({"strides": [1]}), "unknown field(s) ['strides']"),
    "tensor as list": (tensor_frames(keys=[1.0]), "KvTransfer.keys: expected a map, got list"),
}


@pytest.mark.parametrize("name", GARBAGE)
def test_malformed_messages_are_refused_by_name(name):
    frames, problem = GARBAGE[name]
    with pytest.raises(WireError) as error:
        wire.decode(frames)
    assert problem.lower() in str(error.value).lower()


def test_generator_state_must_be_uint8():
    frames = wire.encode(
        kv_transfer(torch.ones(1, 1, 1, 1, 2), generator_state=torch.zeros(3, dtype=torch.uint8))
    )
    header = msgpack.unpackb(frames[1])
    header["generator_state"]["dtype"] = "int32"
    header["generator_state"]["shape"] = [0]
    with pytest.raises(WireError, match="generator_state: dtype int32 not allowed"):
        wire.decode([frames[0], msgpack.packb(header), *frames[2:4], b""])


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 15), st.binary(max_size=64), st.lists(st.binary(max_size=16), max_size=3))
def test_random_bytes_never_escape_as_another_error(code, header, extra):
    with contextlib.suppress(WireError):
        wire.decode([bytes([code]), header, *extra])


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_spoiled_valid_headers_decode_or_raise_wire_error(data):
    frames = [bytes(f) for f in wire.encode(kv_transfer(torch.ones(1, 1, 1, 1, 2)))]
    header = bytearray(frames[1])
    for _ in range(data.draw(st.integers(1, 3))):
        header[data.draw(st.integers(0, len(header) - 1))] = data.draw(st.integers(0, 255))
    with contextlib.suppress(WireError):
        wire.decode([frames[0], bytes(header), *frames[2:]])


def test_peek_type_routes_without_reading_the_header():
    assert wire.peek_type([b"\x0b", b"not even msgpack"]) is MessageType.KV_TRANSFER
    with pytest.raises(WireError, match="unknown message type 0"):
        wire.peek_type([b"\x00"])


def test_encode_refuses_what_it_cannot_send():
    with pytest.raises(WireError, match="float64 cannot be sent"):
        wire.encode(kv_transfer(torch.zeros(1, 1, 1, 1, 1, dtype=torch.float64)))
    with pytest.raises(WireError, match="expected 5"):
        wire.encode(kv_transfer(torch.zeros(2, 2)))
    with pytest.raises(WireError, match="cannot pack header"):
        wire.encode(wire.Cancel(request_id="r", reason=object()))
    with pytest.raises(WireError, match="not a message"):
        wire.encode({"request_id": "r"})
