"""The wire's generated functions (per map, `shared/wire_codec.py`) against the walks they stand
in for (each field through its codec): the checkers, for sound messages and for headers with a
value spoiled, dropped or added, at any depth, decode the same message or refuse with the same
error, word for word; the writers encode every message to the same bytes."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import wire
from shared.wire_base import MessageType, WireError
from shared.wire_codec import _STRUCTS
from tests.unit.test_wire import assert_same, strategy_for

# Values a spoiled field may take: every MessagePack kind, at and past the bounds the codecs
# check (int32, int64, the counts' 2**40, string and list lengths), and infinities.
ODD_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.sampled_from([0, -1, 1, 2**31, 2**40, 2**40 + 1, 2**63 - 1, -(2**63), 2**64 - 1]),
    st.floats(allow_nan=False),
    st.sampled_from([math.inf, -math.inf]),
    st.text(max_size=3),
    st.sampled_from(["x" * 300, "x" * 5000, "prefill", "decode", "fair", "float32"]),
    st.lists(st.integers(-3, 3), max_size=3),
    st.lists(st.text(max_size=2), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(0, 3), max_size=2),
)

# Messages without tensors (a KV transfer's maps are walked: see `_fast_checker`).
CLASSES = [cls for code, cls in wire.MESSAGE_CLASSES.items() if code != MessageType.KV_TRANSFER]


@contextlib.contextmanager
def walked() -> Iterator[None]:
    """Every map decoded by the walk alone, as before the fast checkers."""
    saved = {codec: (codec.checker, codec.checker_made) for codec in _STRUCTS.values()}
    for codec in _STRUCTS.values():
        codec.checker, codec.checker_made = None, True
    try:
        yield
    finally:
        for codec, (checker, made) in saved.items():
            codec.checker, codec.checker_made = checker, made


def outcome(frames: list[bytes]) -> tuple[str, Any]:
    try:
        return "decoded", wire.decode(frames)
    except WireError as error:
        return "refused", str(error)


def assert_same_outcome(frames: list[bytes]) -> tuple[str, Any]:
    fast = outcome(frames)
    with walked():
        walk = outcome(frames)
    assert fast[0] == walk[0], (fast, walk)
    if fast[0] == "decoded":
        assert_same(fast[1], walk[1])
    else:
        assert fast[1] == walk[1]
    return fast


def containers(value: Any) -> list[Any]:
    """The maps and lists in a header, itself included: where a spoil may land."""
    found = [value]
    children = value.values() if isinstance(value, dict) else value
    for child in children if isinstance(value, (dict, list)) else ():
        if isinstance(child, (dict, list)):
            found += containers(child)
    return found


def spoil(header: dict, data: st.DataObject) -> None:
    """One value replaced (a float often by the int it rounds to), one key dropped or one key
    added, somewhere in `header`."""
    target = data.draw(st.sampled_from(containers(header)))
    how = data.draw(st.sampled_from(["replace", "drop", "add"]))
    if isinstance(target, list):
        if target:
            target[data.draw(st.integers(0, len(target) - 1))] = data.draw(ODD_VALUES)
        else:
            target.append(data.draw(ODD_VALUES))
    elif how == "add" or not target:
        target[data.draw(st.sampled_from(["unknown", "peer_id", "index", "max_tokens"]))] = (
            data.draw(ODD_VALUES)
        )
    else:
        key = data.draw(st.sampled_from(sorted(target)))
        if how == "drop":
            del target[key]
        elif (
            isinstance(target[key], float) and abs(target[key]) < 2**53 and data.draw(st.booleans())
        ):
            target[key] = int(target[key])  # an int where a float goes: read as a float
        else:
            target[key] = data.draw(ODD_VALUES)


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_a_fast_checker_decodes_and_refuses_as_the_walk_does(cls):
    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls), st.data())
    def same(msg, data):
        type_frame, header_frame = wire.encode(msg)
        decoded = assert_same_outcome([bytes(type_frame), bytes(header_frame)])
        assert decoded[0] == "decoded"
        assert_same(decoded[1], msg)
        header = msgpack.unpackb(bytes(header_frame))
        for _ in range(data.draw(st.integers(1, 2))):
            spoil(header, data)
        assert_same_outcome([bytes(type_frame), msgpack.packb(header)])

    same()


@contextlib.contextmanager
def written_by_walk() -> Iterator[None]:
    """Every map encoded by the walk alone, as before the writers."""
    saved = {codec: codec.writer for codec in _STRUCTS.values()}
    for codec in _STRUCTS.values():
        codec.writer = codec.walk_to_wire
    try:
        yield
    finally:
        for codec, writer in saved.items():
            codec.writer = writer


@pytest.mark.parametrize("cls", wire.MESSAGE_CLASSES.values(), ids=lambda c: c.__name__)
def test_a_writer_encodes_the_bytes_the_walk_does(cls):
    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(strategy_for(cls))
    def same(msg):
        written = [bytes(frame) for frame in wire.encode(msg)]
        with written_by_walk():
            walked_frames = [bytes(frame) for frame in wire.encode(msg)]
        assert written == walked_frames

    same()


def test_the_fast_checkers_are_in_use():
    """Each message class without tensors has one once it has been decoded; the transfer's
    maps reach tensors and are walked."""
    for cls in CLASSES:
        with contextlib.suppress(WireError):
            wire.decode([bytes([cls.TYPE]), msgpack.packb({})])
    codecs = {codec.cls: codec for codec in _STRUCTS.values()}
    assert all(codecs[cls].checker is not None for cls in CLASSES)
    with contextlib.suppress(WireError):
        wire.decode([bytes([MessageType.KV_TRANSFER]), msgpack.packb({})])
    assert codecs[wire.KvTransfer].checker_made and codecs[wire.KvTransfer].checker is None


def test_a_checked_message_is_a_frozen_dataclass_equal_to_one_built():
    frames = wire.encode(wire.Cancel(request_id="r", reason="x"))
    message = wire.decode(frames)
    assert message == wire.Cancel(request_id="r", reason="x")
    assert hash(message) == hash(wire.Cancel(request_id="r", reason="x"))
    with pytest.raises(AttributeError):
        message.reason = "y"  # type: ignore[misc]
