"""How the wire's values are checked and framed: one codec per field annotation (int, float, bool,
bounded str or list, literal choice, optional, nested map, tensor, packed int32s), built once at
import, that checks a decoded value and names the offending field in its `WireError`; per map,
generated functions that check it inline (the codecs walked only to name a value that fails) and
write it as one dict display; tensors as zero-copy frames; the header's MessagePack, unpacked with
explicit limits and ext types refused. Any conversation's messages (`shared.wire`,
`shared.wire_batch`) are encoded with these.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import itertools
import reprlib
import struct
import sys
import types
from collections.abc import Callable, Iterable, Sequence
from typing import (
    TYPE_CHECKING,
    Annotated,
    Any,
    Literal,
    Union,
    get_args,
    get_origin,
    get_type_hints,
)

import msgpack

from shared.gc_policy import untrack_atoms
from shared.wire_base import (
    DTYPE_NAMES,
    MAX_HEADER_BYTES,
    MAX_LIST_LEN,
    MAX_MESSAGE_BYTES,
    MAX_STR_LEN,
    MAX_TENSOR_BYTES,
    MAX_TENSOR_DIMS,
    MAX_TOKEN_IDS,
    FrameLike,
    MaxLen,
    PackedInt32,
    Range,
    Tensor,
    TensorOf,
    TensorRef,
    TokenArray,
    WireError,
)

if TYPE_CHECKING:
    import torch

# A list of atoms at least this long is untracked as it is decoded. Shorter ones cost a
# collection less than the call (about 0.2 us, some 20 items' visits in the collections a
# held list lives through).
UNTRACK_MIN_LEN = 64
# A list of bounded ints at most this long is checked by the map's generated checker, item by
# item; a longer one by its codec's passes in C.
SHORT_LIST_LEN = 8

# ----------------------------------------------------------------------------------------------
# Codecs: one per annotation, built once at import


def _type_name(value: object) -> str:
    return "None" if value is None else type(value).__name__


# A value named in an error, a few levels and items of it: a value from the wire may be lists
# a thousand deep (repr raised RecursionError) or a million long.
_PREVIEW = reprlib.Repr()
_PREVIEW.maxlevel, _PREVIEW.maxstring, _PREVIEW.maxother = 4, 80, 80


def _preview(value: object) -> str:
    return _PREVIEW.repr(value)


class _Decoding:
    """State of one decode: the frames, and which tensor frames the header has claimed."""

    def __init__(self, frames: Sequence[memoryview]):
        self.frames = frames
        self.claimed: set[int] = set()

    def claim(self, index: int, path: str) -> memoryview:
        if not 2 <= index < len(self.frames):
            raise WireError(
                f"{path}: tensor frame index {index} out of range [2, {len(self.frames)})"
            )
        if index in self.claimed:
            raise WireError(f"{path}: tensor frame {index} is named twice")
        self.claimed.add(index)
        return self.frames[index]


class _Codec(abc.ABC):
    """Turns a field value into its header form (collecting tensors) and checks it back.
    `leaf`: the header form is the value itself, so lists of leaves pass through unwalked.

    A `WireError` from `from_wire` begins with the `path` it was given. A map hands each field
    only its own step (`.name`, precomputed), a list hands its items nothing, and each puts its
    path (and the index) in front of an error on the way out: a valid message builds no path
    strings at all (they were about a tenth of decoding a small heartbeat)."""

    leaf = True

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return value

    @abc.abstractmethod
    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        """The checked value; raises WireError naming `path`."""


class _Exact(_Codec):
    """int, bool or str: msgpack yields exactly these types, and a bool is not an int here."""

    def __init__(self, kind: type, max_len: int | None = None):
        self.kind, self.max_len = kind, max_len

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        if type(value) is not self.kind:
            raise WireError(f"{path}: expected {self.kind.__name__}, got {_type_name(value)}")
        if self.max_len is not None and len(value) > self.max_len:
            raise WireError(f"{path}: string of {len(value)} chars exceeds {self.max_len}")
        return value

    def all_pass(self, values: list) -> bool:
        """Whether every one of `values` passes: one pass over the types, one over lengths.
        The types are counted in C (`map`, `list.count`): a generator's step per item took
        twice as long as unpacking the item (1,500 token ids: 34 against 17 us)."""
        kind, max_len = self.kind, self.max_len
        if list(map(type, values)).count(kind) != len(values):
            return False
        return max_len is None or max(map(len, values), default=0) <= max_len


class _BoundedInt(_Exact):
    """An int within [low, high]: a count a worker reports."""

    def __init__(self, low: int, high: int):
        super().__init__(int)
        self.low, self.high = low, high

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        super().from_wire(value, path, ctx)
        if not self.low <= value <= self.high:
            raise WireError(f"{path}: {value} is outside [{self.low}, {self.high}]")
        return value

    def all_pass(self, values: list) -> bool:
        if not super().all_pass(values):
            return False
        return not values or (min(values) >= self.low and max(values) <= self.high)


class _Float(_Codec):
    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> float:
        if type(value) is not float and type(value) is not int:
            raise WireError(f"{path}: expected float, got {_type_name(value)}")
        # An int (e.g. "lease_s: 5") means the same number. Non-finite values pass: a logprob
        # may be -inf; ranges are the receiver's business.
        return float(value)

    def all_pass(self, values: list) -> bool:
        """Whether every one of `values` is a float already (as a sender packs one): an int
        among them is turned into one by `from_wire`, one by one."""
        return list(map(type, values)).count(float) == len(values)


class _Choice(_Codec):
    def __init__(self, choices: tuple[str, ...]):
        self.choices = choices

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> str:
        if type(value) is not str or value not in self.choices:
            raise WireError(f"{path}: expected one of {list(self.choices)}, got {_preview(value)}")
        return value


class _Optional(_Codec):
    def __init__(self, inner: _Codec):
        self.inner, self.leaf = inner, inner.leaf

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return None if value is None else self.inner.to_wire(value, tensors)

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        return None if value is None else self.inner.from_wire(value, path, ctx)


class _List(_Codec):
    def __init__(self, item: _Codec, max_len: int):
        self.item, self.max_len, self.leaf = item, max_len, item.leaf

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> Any:
        return value if self.leaf else [self.item.to_wire(x, tensors) for x in value]

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> list:
        if type(value) is not list:
            raise WireError(f"{path}: expected list, got {_type_name(value)}")
        if len(value) > self.max_len:
            raise WireError(f"{path}: list of {len(value)} entries exceeds {self.max_len}")
        # Fast path for lists of ints or strings (token ids, up to a million; request ids); the
        # item by item walk names the first bad one. A long list of them is held (a prompt,
        # queued in the scheduler, kept by a worker) and holds no container: off the
        # collector's books (`untrack_atoms`).
        if isinstance(self.item, _Exact) and self.item.all_pass(value):
            if len(value) >= UNTRACK_MIN_LEN:
                untrack_atoms(value)
            return value
        if isinstance(self.item, _Tuple) and self.item.all_pass(value):
            return list(map(tuple, value))
        return _each(itertools.repeat(self.item, len(value)), value, path, ctx)


class _PackedIds(_Codec):
    """A sequence of ints as one bin of little-endian int32s (`PackedInt32`), decoded to a
    `TokenArray`: a prompt is packed and unpacked in C, and held in 4 bytes a token."""

    leaf = False
    swap = sys.byteorder != "little"  # the wire is little-endian, as every host we run on

    def __init__(self, max_len: int):
        self.max_len = max_len

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> bytes:
        if type(value) is TokenArray and not self.swap:
            return value.tobytes()
        try:  # a list (a gateway's tokenizer's): `struct` packs one faster than `array` builds
            return struct.pack(f"<{len(value)}i", *value)
        except struct.error as error:
            raise WireError(f"token ids must be ints within int32: {error}") from None

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> TokenArray:
        if type(value) is not bytes:
            raise WireError(f"{path}: expected packed int32 token ids, got {_type_name(value)}")
        if len(value) % 4:
            raise WireError(f"{path}: {len(value)} bytes are not a whole number of int32s")
        if len(value) // 4 > self.max_len:
            raise WireError(f"{path}: {len(value) // 4} token ids exceed {self.max_len}")
        ids = TokenArray()
        ids.frombytes(value)
        if self.swap:
            ids.byteswap()
        return ids


class _Tuple(_Codec):
    """A fixed-length pair such as (token id, logprob); an array on the wire."""

    def __init__(self, items: tuple[_Codec, ...]):
        self.items = items

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> tuple:
        if type(value) is not list or len(value) != len(self.items):
            raise WireError(
                f"{path}: expected an array of {len(self.items)}, got {_preview(value)}"
            )
        return tuple(_each(self.items, value, path, ctx))

    def all_pass(self, values: list) -> bool:
        """Whether every one of `values` passes as it is, each column of items in passes in C:
        a long prompt's top logprobs (a million (id, logprob) pairs) took 2 s item by item, the
        gateway's loop stalled for all its streams meanwhile."""
        if list(map(type, values)).count(list) != len(values):
            return False
        if list(map(len, values)).count(len(self.items)) != len(values):
            return False
        if not values:
            return True
        columns = zip(*values, strict=True)  # (each value has one item per codec, checked above)
        for codec, column in zip(self.items, columns, strict=True):
            # An atom's column only: a nested pair's items would stay lists.
            if not (isinstance(codec, (_Exact, _Float)) and codec.all_pass(column)):
                return False
        return True


def _each(codecs: Iterable[_Codec], values: list, path: str, ctx: _Decoding) -> list:
    """Each of `values` checked by its codec; an error names its index after `path`."""
    checked = []
    index = 0
    try:
        for codec, value in zip(codecs, values, strict=True):
            checked.append(codec.from_wire(value, "", ctx))
            index += 1
    except WireError as error:
        raise WireError(f"{path}[{index}]{error}") from None
    return checked


class _Struct(_Codec):
    """A dataclass as a map of its fields. `_struct_codec` fills `fields` in after registering
    the codec, so that nested (and recursive) types share one codec."""

    leaf = False

    def __init__(self, cls: type):
        self.cls = cls
        self.fields: dict[str, _Codec] = {}
        self.steps = {f.name: f".{f.name}" for f in dataclasses.fields(cls)}  # in an error's path
        self.required: frozenset[str] = frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
        self.checker: Callable[[Any, _Decoding], Any] | None = None  # see `_fast_checker`
        self.checker_made = False
        self.writer: Callable[[Any, list[torch.Tensor]], dict] | None = None  # `_fast_writer`

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> dict:
        if self.writer is None:  # on first use: every nested codec exists by then
            self.writer = _fast_writer(self)
        return self.writer(value, tensors)

    def walk_to_wire(self, value: Any, tensors: list[torch.Tensor]) -> dict:
        """`to_wire` field by field, through each field's codec: what the writer must equal."""
        return {name: c.to_wire(getattr(value, name), tensors) for name, c in self.fields.items()}

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> Any:
        if not self.checker_made:  # on first use: every nested codec exists by then
            self.checker, self.checker_made = _fast_checker(self), True
        if self.checker is not None:
            try:
                return self.checker(value, ctx)
            except WireError:
                pass  # the walk finds the value again, and names its field
        return self.walk(value, path, ctx)

    def walk(self, value: Any, path: str, ctx: _Decoding) -> Any:
        """`from_wire` field by field, through each field's codec: the reference the fast
        checker must agree with, and what names the offending field when it does not pass."""
        if type(value) is not dict:
            raise WireError(f"{path}: expected a map, got {_type_name(value)}")
        unknown = value.keys() - self.fields.keys()
        if unknown:
            raise WireError(f"{path}: unknown field(s) {sorted(map(str, unknown))}")
        missing = self.required - value.keys()
        if missing:
            raise WireError(f"{path}: missing required field(s) {sorted(missing)}")
        steps = self.steps
        try:
            checked = {name: c.from_wire(value[name], steps[name], ctx)
                       for name, c in self.fields.items() if name in value}  # fmt: skip
        except WireError as error:
            raise WireError(f"{path}{error}") from None
        return self.cls(**checked)


class _Tensor(_Codec):
    leaf = False

    def __init__(self, spec: TensorOf):
        self.spec = spec

    def to_wire(self, value: Any, tensors: list[torch.Tensor]) -> dict:
        tensor = _sendable(value, self.spec)
        frame = 2 + sum(num_tensor_frames(t) for t in tensors)
        tensors.append(tensor)
        header = {"dtype": _dtype_name(tensor.dtype), "shape": list(tensor.shape), "frame": frame}
        num_frames = num_tensor_frames(tensor)
        if num_frames > 1:
            header["num_frames"] = num_frames
        return header

    def from_wire(self, value: Any, path: str, ctx: _Decoding) -> torch.Tensor:
        ref: TensorRef = _TENSOR_REF.from_wire(value, path, ctx)
        _check_tensor_spec(ref.dtype, ref.shape, self.spec, path)
        dtype = _torch_dtype(ref.dtype)
        num_bytes = _numel(ref.shape) * dtype.itemsize
        expected = _frames_for(num_bytes)
        if ref.num_frames != expected:
            raise WireError(
                f"{path}: {ref.dtype}{ref.shape} travels in {expected} frame(s) of at most "
                f"{MAX_MESSAGE_BYTES:,} bytes, not {ref.num_frames}"
            )
        bufs = [ctx.claim(ref.frame + i, path) for i in range(ref.num_frames)]
        sizes = [buf.nbytes for buf in bufs]
        if sizes != _frame_sizes(num_bytes):
            raise WireError(
                f"{path}: frame {ref.frame} holds {sizes[0]} bytes, but {ref.dtype}{ref.shape} "
                f"needs {num_bytes}"
                if len(bufs) == 1
                else f"{path}: frames {ref.frame}.. hold {sizes} bytes, but "
                f"{ref.dtype}{ref.shape} needs {_frame_sizes(num_bytes)}"
            )
        if len(bufs) == 1:
            return _tensor_from_buffer(bufs[0], dtype, ref.shape)
        return _tensor_from_buffers(bufs, dtype, ref.shape)


def _codec_for(
    tp: Any,
    max_len: int | None = None,
    spec: TensorOf | None = None,
    bounds: Range | None = None,
) -> _Codec:
    origin, args = get_origin(tp), get_args(tp)
    if origin is Annotated:
        meta = tp.__metadata__
        max_len = next((m.value for m in meta if isinstance(m, MaxLen)), max_len)
        spec = next((m for m in meta if isinstance(m, TensorOf)), spec)
        bounds = next((m for m in meta if isinstance(m, Range)), bounds)
        if any(isinstance(m, PackedInt32) for m in meta):
            return _PackedIds(max_len or MAX_LIST_LEN)
        return _codec_for(args[0], max_len, spec, bounds)
    if origin in (Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]  # only `X | None` is supported
        return _Optional(_codec_for(inner, max_len, spec, bounds))
    if origin is Literal:
        return _Choice(args)
    if origin is list:
        return _List(_codec_for(args[0]), max_len or MAX_LIST_LEN)
    if origin is tuple:
        return _Tuple(tuple(_codec_for(a) for a in args))
    if tp is float:
        return _Float()
    if tp is int and bounds is not None:
        return _BoundedInt(bounds.low, bounds.high)
    if tp in (int, bool):
        return _Exact(tp)
    if tp is str:
        return _Exact(str, max_len or MAX_STR_LEN)
    if tp is Tensor:
        return _Tensor(spec or TensorOf())
    if dataclasses.is_dataclass(tp):
        return _struct_codec(tp)
    raise TypeError(f"no wire codec for {tp!r}")


# ----------------------------------------------------------------------------------------------
# Generated per map: a checker (its checks inline) and a writer (its header map)


def _fast_checker(struct: _Struct) -> Callable[[Any, _Decoding], Any] | None:
    """One function that checks a map's fields inline (type, length, bounds, choice) and builds
    the dataclass, raising a bare `WireError` at the first value that does not pass; lists and
    nested maps are handed to their codecs. It passes what the walk passes and builds the same
    object (`tests/unit/test_wire_fast_checker.py`), without a call per field: a heartbeat's
    checks took 13 us of its 15 us decode. None for a map that reaches a tensor: a frame
    claimed before a later value fails would be claimed again by the walk."""
    if _reaches_tensor(struct, set()):
        return None
    cls = struct.cls
    names: dict[str, Any] = {
        "_WireError": WireError,
        "_new": object.__new__,
        "_cls": cls,
        "_names": frozenset(struct.fields),
        "_required": struct.required,
    }
    lines = [
        "def check(value, ctx):",
        "    if type(value) is not dict or not value.keys() <= _names"
        " or not _required <= value.keys():",
        "        raise _WireError",
        "    message = _new(_cls)",
    ]
    # The dataclass is filled in through its slots' descriptors, as its __init__ would (it has
    # no __post_init__): a frozen dataclass's __init__ sets each field through
    # object.__setattr__, and took a third of a heartbeat's checks.
    assert not hasattr(cls, "__post_init__"), cls
    defaults = {f.name: f for f in dataclasses.fields(cls)}
    for index, (name, codec) in enumerate(struct.fields.items()):
        const = f"_c{index}"
        names[f"_set{index}"] = cls.__dict__[name].__set__
        indent = "    " if name in struct.required else "        "
        if name not in struct.required:
            lines.append(f"    if {name!r} in value:")
        lines.append(f"{indent}v = value[{name!r}]")
        lines += [indent + line for line in _inline_check(codec, const, names)]
        if name not in struct.required:
            default = defaults[name]
            lines.append("    else:")
            if default.default_factory is not dataclasses.MISSING:
                names[f"_factory{index}"] = default.default_factory
                lines.append(f"        v = _factory{index}()")
            else:
                names[f"_default{index}"] = default.default
                lines.append(f"        v = _default{index}")
        lines.append(f"    _set{index}(message, v)")
    lines.append("    return message")
    exec("\n".join(lines), names)  # noqa: S102 - the source is built from the codecs above
    return names["check"]


def _inline_check(codec: _Codec, const: str, names: dict[str, Any]) -> list[str]:
    """Lines that check `v` as `codec.from_wire` would, leaving its checked value in `v`."""
    fail = "    raise _WireError"
    if isinstance(codec, _BoundedInt):
        names[const] = (codec.low, codec.high)
        return [f"if type(v) is not int or not {const}[0] <= v <= {const}[1]:", fail]
    if isinstance(codec, _Exact) and codec.kind is str and codec.max_len is not None:
        return [f"if type(v) is not str or len(v) > {codec.max_len}:", fail]
    if isinstance(codec, _Exact):
        names[const] = codec.kind
        return [f"if type(v) is not {const}:", fail]
    if isinstance(codec, _Float):
        return ["if type(v) is not float:", "    if type(v) is not int:", "    " + fail,
                "    v = float(v)"]  # fmt: skip
    if isinstance(codec, _Choice):
        names[const] = frozenset(codec.choices)
        return [f"if type(v) is not str or v not in {const}:", fail]
    if isinstance(codec, _Optional):
        inner = _inline_check(codec.inner, const, names)
        return ["if v is not None:", *("    " + line for line in inner)]
    names[const] = codec.from_wire  # a list's items, tuples, nested maps: their own checks
    if isinstance(codec, _List) and isinstance(codec.item, _BoundedInt):
        # A short list of bounded ints (a delta's one new token, most often) is checked here:
        # the list codec's passes in C cost more calls than a token has items (a TOKENS of 64
        # deltas decoded 27% slower through them).
        names[f"{const}_bounds"] = (codec.item.low, codec.item.high)
        return [f"if type(v) is not list or len(v) > {codec.max_len}:", fail,
                f"if len(v) > {SHORT_LIST_LEN}:", f'    v = {const}(v, "", ctx)',
                "else:", "    for x in v:",
                f"        if type(x) is not int or not {const}_bounds[0] <= x <= "
                f"{const}_bounds[1]:", "        " + fail]  # fmt: skip
    if isinstance(codec, _List):  # most lists on the wire are empty: nothing more to check
        return [f"if type(v) is not list or len(v) > {codec.max_len}:", fail,
                "if v:", f'    v = {const}(v, "", ctx)']  # fmt: skip
    return [f'v = {const}(v, "", ctx)']


def _fast_writer(struct: _Struct) -> Callable[[Any, list[torch.Tensor]], dict]:
    """One function that writes a dataclass as its header map: a field whose header form is
    the value itself is read straight into a dict display, the others (tensors, maps, lists of
    maps) go through their codecs. The same map, key for key, as the walk's (a step's token
    deltas: about 1 us each through the walk)."""
    names: dict[str, Any] = {}
    items = []
    for index, (name, codec) in enumerate(struct.fields.items()):
        if codec.leaf:  # (a leaf's `to_wire` returns the value, None included)
            items.append(f"{name!r}: value.{name}")
        else:
            names[f"_w{index}"] = codec.to_wire
            items.append(f"{name!r}: _w{index}(value.{name}, tensors)")
    source = "def write(value, tensors):\n    return {" + ", ".join(items) + "}"
    exec(source, names)  # noqa: S102 - the source is built from the field names above
    return names["write"]


def _reaches_tensor(codec: _Codec, seen: set[int]) -> bool:
    if id(codec) in seen:
        return False
    seen.add(id(codec))
    if isinstance(codec, _Tensor):
        return True
    if isinstance(codec, _Struct):
        return any(_reaches_tensor(c, seen) for c in codec.fields.values())
    inner = [getattr(codec, name) for name in ("inner", "item") if hasattr(codec, name)]
    inner += list(getattr(codec, "items", ()))
    return any(_reaches_tensor(c, seen) for c in inner)


_STRUCTS: dict[type, _Struct] = {}


def _struct_codec(cls: type) -> _Struct:
    if cls not in _STRUCTS:
        codec = _STRUCTS[cls] = _Struct(cls)
        hints = get_type_hints(cls, include_extras=True)
        codec.fields = {f.name: _codec_for(hints[f.name]) for f in dataclasses.fields(cls)}
    return _STRUCTS[cls]


_TENSOR_REF = _struct_codec(TensorRef)
assert _TENSOR_REF.fields["dtype"].choices == DTYPE_NAMES, "TensorRef.dtype lists DTYPE_NAMES"


# ----------------------------------------------------------------------------------------------
# Tensors: torch is imported by the first one sent or received, not by the wire's import


@functools.cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    import torch

    return {name: getattr(torch, name) for name in DTYPE_NAMES}


def _torch_dtype(name: str) -> torch.dtype:
    return _torch_dtypes()[name]


@functools.cache
def _dtype_names() -> dict[torch.dtype, str]:
    return {dtype: name for name, dtype in _torch_dtypes().items()}


def _dtype_name(dtype: torch.dtype) -> str | None:
    """The header name of a torch dtype; None for one the wire does not carry."""
    return _dtype_names().get(dtype)


def _numel(shape: Sequence[int]) -> int:
    numel = 1
    for size in shape:
        numel *= size
    return numel


_ITEM_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1}
assert _ITEM_SIZES.keys() == set(DTYPE_NAMES), "an item size per dtype the wire carries"


def _check_tensor_spec(dtype: str, shape: Sequence[int], spec: TensorOf, path: str) -> None:
    if dtype not in spec.dtypes:
        raise WireError(f"{path}: dtype {dtype} not allowed here, expected one of {spec.dtypes}")
    ndim = len(shape)
    if (spec.ndim is not None and ndim != spec.ndim) or ndim > MAX_TENSOR_DIMS:
        raise WireError(f"{path}: tensor of {ndim} dims, expected {spec.ndim or 'at most 8'}")
    if any(size < 0 for size in shape):
        raise WireError(f"{path}: negative size in shape {list(shape)}")
    # An empty tensor's zero bytes match any other sizes: bound them as if none were 0 (torch
    # raises on a size past int64 or on strides that overflow, not with a WireError).
    if _numel([max(size, 1) for size in shape]) * _ITEM_SIZES[dtype] > MAX_TENSOR_BYTES:
        raise WireError(
            f"{path}: sizes {list(shape)} hold more elements than a message can carry "
            f"({MAX_TENSOR_BYTES:,} bytes of {dtype})"
        )


def _sendable(value: Any, spec: TensorOf) -> torch.Tensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise WireError(f"expected a torch.Tensor, got {_type_name(value)}")
    if value.device.type != "cpu":
        raise WireError(f"tensors are sent from CPU memory, got one on {value.device}")
    dtype_name = _dtype_name(value.dtype)
    if dtype_name is None:
        raise WireError(f"dtype {value.dtype} cannot be sent")
    _check_tensor_spec(dtype_name, value.shape, spec, "tensor")
    return value.detach().contiguous()  # no copy when already contiguous


def _frames_for(num_bytes: int) -> int:
    return max(1, -(-num_bytes // MAX_MESSAGE_BYTES))


def _frame_sizes(num_bytes: int) -> list[int]:
    """The bytes of each frame a tensor of `num_bytes` travels in."""
    num_frames = _frames_for(num_bytes)
    return [MAX_MESSAGE_BYTES] * (num_frames - 1) + [
        num_bytes - MAX_MESSAGE_BYTES * (num_frames - 1)
    ]


def num_tensor_frames(tensor: torch.Tensor) -> int:
    """The frames a (contiguous) tensor travels in."""
    return _frames_for(tensor.numel() * tensor.element_size())


def tensor_frames(tensor: torch.Tensor) -> list[memoryview]:
    """Zero-copy views of a contiguous CPU tensor's bytes, a frame's worth each."""
    view = _tensor_bytes(tensor)
    if view.nbytes <= MAX_MESSAGE_BYTES:
        return [view]
    return [view[i : i + MAX_MESSAGE_BYTES] for i in range(0, view.nbytes, MAX_MESSAGE_BYTES)]


def _tensor_from_buffers(
    bufs: list[memoryview], dtype: torch.dtype, shape: list[int]
) -> torch.Tensor:
    """A tensor over several frames: one copy, into memory of its own."""
    import numpy
    import torch

    tensor = torch.empty(shape, dtype=dtype)
    flat = tensor.reshape(-1).view(torch.uint8).numpy()
    offset = 0
    for buf in bufs:
        flat[offset : offset + buf.nbytes] = numpy.frombuffer(buf, dtype=numpy.uint8)
        offset += buf.nbytes
    return tensor


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    """A zero-copy view of a contiguous CPU tensor's bytes. Viewed as uint8 first, because numpy
    has no bfloat16; the view owns a reference to the storage (memoryview -> ndarray -> tensor)."""
    import torch

    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def _tensor_from_buffer(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> torch.Tensor:
    import torch

    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    if buf.readonly:
        buf = memoryview(bytearray(buf))  # one copy: a tensor must not alias immutable bytes
    tensor = torch.frombuffer(buf, dtype=dtype)  # holds a reference to buf (and its frame)
    if tensor.data_ptr() % tensor.element_size():
        tensor = tensor.clone()  # tiny zmq messages live unaligned inside zmq_msg_t
    return tensor.view(shape)


# ----------------------------------------------------------------------------------------------
# Frames and headers


def _as_view(frame: FrameLike) -> memoryview:
    view = memoryview(frame)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _refuse_ext(code: int, data: bytes) -> None:
    raise WireError(f"msgpack extension type {code} is not allowed")


def _unpack_header(view: memoryview) -> Any:
    if view.nbytes > MAX_HEADER_BYTES:
        raise WireError(f"header of {view.nbytes} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        return msgpack.unpackb(
            view,
            raw=False,
            strict_map_key=True,
            ext_hook=_refuse_ext,  # called for every ext, so none gets through
            # Any string fits in the header's bytes; each field's codec then checks its own
            # limit in characters (UTF-8 is up to 4 bytes per character).
            max_str_len=MAX_HEADER_BYTES,
            # Only packed token ids are binary; tensors travel in their own frames.
            max_bin_len=4 * MAX_TOKEN_IDS,
            max_array_len=MAX_TOKEN_IDS,
            max_map_len=64,  # more than any message's field count
        )
    except WireError:
        raise
    except Exception as e:  # untrusted bytes: any failure of the unpacker is the sender's fault
        raise WireError(f"header is not valid msgpack: {type(e).__name__}: {e}") from None
