"""Hostile or broken frames: each is refused with a `WireError` naming the problem (receivers log
and drop it), never another exception, a hang or an allocation its declared sizes drive."""

from __future__ import annotations

import re
import resource
import struct
import time

import msgpack
import pytest
import zmq

from shared import wire, wire_batch
from shared.wire import WireError


def tokens_frames(**delta_fields) -> list[bytes]:
    delta = {"request_id": "r", "token_ids": [1], "logprobs": [-0.5], **delta_fields}
    return [bytes([wire.MessageType.TOKENS]), msgpack.packb({"deltas": [delta]})]


# A gateway decodes each alternative's id to text: an id no tokenizer takes (past int32, as
# the delta's own token ids are bounded) raised OverflowError there, not a WireError here.
@pytest.mark.parametrize("token_id", [2**31, -(2**31) - 1, 2**40, 2**64 - 1, -(2**63)])
@pytest.mark.parametrize("field", ["top_logprobs", "prompt_top_logprobs"])
def test_an_alternatives_token_id_past_int32_is_refused(field, token_id):
    extra = {"prompt_logprobs": [-0.5]} if field == "prompt_top_logprobs" else {}
    frames = tokens_frames(**{field: [[[token_id, -1.0]]]}, **extra)
    with pytest.raises(WireError, match=rf"Tokens\.deltas\[0\]\.{field}\[0\]\[0\]\[0\]: "):
        wire.decode(frames)


@pytest.mark.parametrize("field", ["top_logprobs", "prompt_top_logprobs"])
def test_an_alternatives_token_id_within_int32_passes(field):
    extra = {"prompt_logprobs": [-0.5]} if field == "prompt_top_logprobs" else {}
    pairs = [[2**31 - 1, -1.0], [0, float("-inf")]]
    delta = wire.decode(tokens_frames(**{field: [pairs]}, **extra)).deltas[0]
    assert getattr(delta, field) == [[(2**31 - 1, -1.0), (0, float("-inf"))]]


# The batch link's encode, as the wire's: what cannot be packed (a lone surrogate, an int past
# uint64) is a WireError its sender turns into an answer, not an exception of another type.
@pytest.mark.parametrize(
    "message",
    [
        wire_batch.BatchCall(call_id="c", op="file_list", tenant="\ud800", params="{}"),
        wire_batch.BatchReply(call_id="c", status=2**64, body="{}"),
    ],
    ids=["lone surrogate", "int past uint64"],
)
def test_a_batch_message_that_cannot_be_packed_is_a_wire_error(message):
    with pytest.raises(WireError, match="cannot pack header"):
        wire_batch.encode(message)


def heartbeat_frames(**fields) -> list[bytes]:
    header = dict(peer_id="p", num_waiting=0, num_running=0, num_free_blocks=1,
                  num_total_blocks=1, steps_completed=0, sent_at=0.0)  # fmt: skip
    return [bytes([wire.MessageType.HEARTBEAT]), msgpack.packb({**header, **fields})]


def test_deep_nesting_is_refused_by_the_unpacker():
    deep = b"\x81\xa7peer_id" + b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(WireError, match="not valid msgpack"):
        wire.decode([bytes([wire.MessageType.GOODBYE]), deep])


def test_declared_array_lengths_allocate_nothing_the_bytes_do_not_hold():
    # Each level declares the most entries an array may have, nested as deep as the unpacker
    # goes, in a few kilobytes: refused at once, nothing touched for the declared sizes.
    declared = b"\xdd" + struct.pack(">I", wire.MAX_TOKEN_IDS)
    header = b"\x81\xa7peer_id" + declared * 2000
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    started = time.monotonic()
    with pytest.raises(WireError, match="not valid msgpack"):
        wire.decode([bytes([wire.MessageType.GOODBYE]), header])
    assert time.monotonic() - started < 5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 512 << 10  # KiB


@pytest.mark.parametrize(
    ("value", "problem"),
    [
        (float("nan"), "expected int, got float"),
        (float("inf"), "expected int, got float"),
        (True, "expected int, got bool"),
        (2**64 - 1, "is outside"),
        (-(2**63), "is outside"),
    ],
)
def test_a_count_refuses_floats_bools_and_ints_past_its_bounds(value, problem):
    with pytest.raises(WireError, match=f"Heartbeat.num_waiting: .*{problem}"):
        wire.decode(heartbeat_frames(num_waiting=value))


@pytest.mark.parametrize(
    "string", [b"\xa2\xff\xfe", b"\xa3\xed\xa0\x80"], ids=["invalid utf-8", "lone surrogate"]
)
def test_strings_that_are_not_utf8_are_refused(string):
    with pytest.raises(WireError, match="not valid msgpack"):
        wire.decode([bytes([wire.MessageType.GOODBYE]), b"\x81\xa7peer_id" + string])


@pytest.mark.parametrize(
    "kind", [bytes, bytearray, memoryview, zmq.Frame], ids=lambda kind: kind.__name__
)
def test_every_kind_of_frame_decodes_alike(kind):
    frames = heartbeat_frames(request_ids=["a", "b"])
    assert wire.decode([kind(frame) for frame in frames]) == wire.decode(frames)


def hello_frames(**fields) -> list[bytes]:
    header = dict(schema_version=wire.SCHEMA_VERSION, role="decode", peer_id="d", model="m",
                  address=None, num_kv_blocks=8, block_size=4, max_num_seqs=2)  # fmt: skip
    return [bytes([wire.MessageType.HELLO]), msgpack.packb({**header, **fields})]


# A peer of another version whose HELLO has fields this one lacks (or lacks one this one needs)
# fails to decode before the scheduler reads its version: the error says why, not only which
# field, for the operator of a mixed-version cluster (the peer itself hears nothing).
@pytest.mark.parametrize(
    "frames",
    [
        hello_frames(schema_version=wire.SCHEMA_VERSION + 1, new_field=1),
        hello_frames(schema_version=wire.SCHEMA_VERSION - 1, role="router"),
        [
            bytes([wire.MessageType.HELLO_ACK]),
            msgpack.packb({"schema_version": wire.SCHEMA_VERSION + 1, "accepted": True}),
        ],
    ],
    ids=["unknown field", "bad value", "missing fields"],
)
def test_a_message_of_another_schema_version_says_so(frames):
    version = msgpack.unpackb(frames[1])["schema_version"]
    with pytest.raises(WireError) as error:
        wire.decode(frames)
    assert f"schema version {version}, this one's {wire.SCHEMA_VERSION}" in str(error.value)


def test_a_message_of_this_schema_version_names_only_its_problem():
    with pytest.raises(WireError) as error:
        wire.decode(hello_frames(new_field=1))
    assert str(error.value) == "Hello: unknown field(s) ['new_field']"


# Pairs are checked a column at a time when every one passes as it is; any other list of
# pairs goes item by item, and comes out the same (tuples, floats) or names the bad item.
@pytest.mark.parametrize(
    ("pairs", "expected"),
    [
        ([], []),
        ([[1, -0.5], [2, float("-inf")]], [(1, -0.5), (2, float("-inf"))]),
        ([[1, -0.5], [2, -1]], [(1, -0.5), (2, -1.0)]),  # an int for a float: a float
    ],
)
def test_pairs_decode_to_tuples_whichever_way_they_are_checked(pairs, expected):
    top = wire.decode(tokens_frames(top_logprobs=[pairs])).deltas[0].top_logprobs
    assert top == [expected]
    assert all(type(pair) is tuple and type(pair[1]) is float for pair in top[0])


@pytest.mark.parametrize(
    ("pairs", "problem"),
    [
        ([[1, -0.5], [2, "x"]], r"top_logprobs\[0\]\[1\]\[1\]: expected float, got str"),
        ([[1, -0.5], [True, -1.0]], r"top_logprobs\[0\]\[1\]\[0\]: expected int, got bool"),
        ([[1, -0.5], [2, -1.0, 3]], r"top_logprobs\[0\]\[1\]: expected an array of 2"),
        ([[1, -0.5], (2, -1.0), 7], r"top_logprobs\[0\]\[2\]: expected an array of 2"),
        ([[1, -0.5], [2**31, -1.0]], r"top_logprobs\[0\]\[1\]\[0\]: 2147483648 is outside"),
    ],
)
def test_a_bad_pair_is_named(pairs, problem):
    with pytest.raises(WireError, match=problem):
        wire.decode(tokens_frames(top_logprobs=[pairs]))


@pytest.mark.parametrize(
    ("frames", "field"),
    [
        (hello_frames(role="NESTED"), "Hello.role"),
        (tokens_frames(top_logprobs=[["NESTED"]]), "Tokens.deltas[0].top_logprobs[0][0]"),
    ],
    ids=["choice", "pair"],
)
def test_a_value_nested_as_deep_as_the_unpacker_goes_is_named_without_recursing(frames, field):
    # 1,015 lists deep, within the unpacker's stack: naming the value printed every level of
    # it (repr), and raised RecursionError.
    nested = b"\x91" * 1015 + b"\xc0"
    header = frames[1].replace(msgpack.packb("NESTED"), nested)
    with pytest.raises(WireError, match=re.escape(field) + r": expected .*got \[\[\["):
        wire.decode([frames[0], header])
