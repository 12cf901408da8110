"""Paged decode attention on the CPU for bfloat16 KV caches, in C (`cpu_decode_attention.c`).

The pure-torch reference attends a decode group by gathering every sequence's blocks into a
padded copy, zeroing the padding, and running two `bmm` over it. In a served decode step that is
a third of the step (py-spy on the decode worker of `loadtest.race`: attention 35%, of which the
gather ~40%), because every layer copies every sequence's whole context before reading it.
This kernel reads each sequence's keys and values straight from its cache blocks, up to its
context length, one task per (sequence, kv head) serving that kv head's query heads together:
no gather, no padding, no mask, and scores, softmax and the weighted sum in float32 (the
reference rounds the probabilities to bfloat16 before the second product, so this is the more
accurate of the two). float32 models keep the reference: it is the path whose greedy tokens equal
transformers'. In a step of decode rows only, the same call also rotates the query and the new
key and writes the new key and value into the cache (`NewTokens`), so that a decode layer's
attention is one call instead of a dozen.

The C source is compiled on first use (`kernels/native_build.py`) for the CPU at hand
(`-march=native`; `-ffast-math` when compiling, not when linking, see `_COMPILE_FLAGS`), cached
under a name that hashes the source, the flags and the CPU's feature flags (a cache shared
between machines never hands one CPU another's instructions). Without a compiler, `build`
raises `KernelUnavailable` with the reason, and the model keeps the reference. The C function
parallelizes over its tasks with OpenMP, which resolves to torch's own libgomp once torch is
loaded (one runtime, one thread count: `torch.get_num_threads()`).
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from kernels import native_build
from kernels.attention_plan import DecodeRows

SOURCE = Path(__file__).with_suffix(".c")
# Compiled with -ffast-math (reassociated sums vectorize; expf through glibc's libmvec), but
# linked without it: a library linked with -ffast-math carries crtfastmath.o, which at load time
# sets flush-to-zero for the whole process, changing every other float computation in it.
_COMPILE_FLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp", "-fPIC")
_LINK_FLAGS = ("-shared", "-fopenmp")
_LIBRARIES = ("-lmvec", "-lm")
# The per-task buffers of the C code (`MAX_HEAD_DIM`, `MAX_GROUP`).
MAX_HEAD_DIM = 256
MAX_GROUP = 16


class KernelUnavailable(native_build.NativeUnavailable):
    """The kernel cannot be built or loaded here (no compiler, a failed compile, ...)."""


def supports(
    dtype: torch.dtype, device: torch.device | str, num_heads: int, num_kv_heads: int, head_dim: int
) -> bool:
    """Whether the kernel serves a model of this shape, dtype and device."""
    return (
        torch.device(device).type == "cpu"
        and dtype == torch.bfloat16
        and head_dim <= MAX_HEAD_DIM
        and num_heads % num_kv_heads == 0
        and num_heads // num_kv_heads <= MAX_GROUP
    )


_I64, _POINTER = ctypes.c_int64, ctypes.c_void_p


class _Problem(ctypes.Structure):
    """The C `Problem`, field by field (names and order must match `cpu_decode_attention.c`)."""

    _fields_ = [
        *(("query", _POINTER), ("query_row_stride", _I64), ("query_head_stride", _I64)),
        ("num_rows", _I64),
        *(("key_cache", _POINTER), ("value_cache", _POINTER)),
        *(("num_blocks", _I64), ("block_size", _I64)),
        *(("block_tables", _POINTER), ("block_table_stride", _I64), ("table_width", _I64)),
        *(("context_lens", _POINTER), ("num_seqs", _I64)),
        *(("seq_ids", _POINTER), ("query_rows", _POINTER)),
        *(("num_decode", _I64), ("max_context_len", _I64)),
        *(("out", _POINTER), ("out_row_stride", _I64), ("out_head_stride", _I64)),
        *(("num_heads", _I64), ("num_kv_heads", _I64), ("head_dim", _I64)),
        ("scale", ctypes.c_float),
        *(("key_new", _POINTER), ("value_new", _POINTER)),
        *(("key_new_row_stride", _I64), ("key_new_head_stride", _I64)),
        *(("value_new_row_stride", _I64), ("value_new_head_stride", _I64)),
        *(("cos", _POINTER), ("sin", _POINTER), ("slot_mapping", _POINTER)),
    ]


@dataclass(frozen=True)
class NewTokens:
    """A pure decode step's new tokens, for the kernel to rotate and write itself: their
    unrotated keys and values `[rows, kv_heads, head_dim]` (views of the fused projection are
    fine), rotary `cos` and `sin` `[rows, 1, head_dim]` (`RotaryEmbedding.lookup`), and their
    cache slots `[rows]` int64 (negative: not written). The query handed beside them is then
    unrotated too."""

    key: torch.Tensor
    value: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slot_mapping: torch.Tensor


_STATUS = {
    -1: "a head_dim or query group past the kernel's buffers",
    -2: "out of memory",
    -3: "a sequence, row, context length or block id of the batch out of range",
}


class CpuDecodeAttention:
    """The loaded kernel: `__call__` writes the decode rows' attention into `out`."""

    def __init__(self, library: Path):
        self.library = library
        self._function = ctypes.CDLL(str(library)).tandem_paged_decode_bf16
        self._function.argtypes = [ctypes.POINTER(_Problem), ctypes.c_int]
        self._function.restype = ctypes.c_int

    def __call__(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        rows: DecodeRows,
        out: torch.Tensor,
        *,
        scale: float,
        new_tokens: NewTokens | None = None,
    ) -> None:
        """query and out `[tokens, heads, head_dim]` bfloat16 (any row and head strides), the
        caches `[blocks, block_size, kv_heads, head_dim]` bfloat16 and dense, block tables
        `[seqs, max_blocks]` and context lengths `[seqs]` int32: `out[rows.query_rows[i]]` gets
        the attention of query row `rows.query_rows[i]` over sequence `rows.seq_ids[i]`'s
        context. Indices out of range (a block id past the cache, a context longer than its
        table or than `rows.max_context_len`) raise ValueError instead of reading past memory;
        the rows the call wrote are then unspecified. With `new_tokens`, the query is unrotated
        and the kernel first rotates it and writes the new keys and values into the caches
        (see `NewTokens`)."""
        _check(query, key_cache, value_cache, block_tables, context_lens, rows, out)
        if query.stride(-1) != 1:
            query = query.contiguous()
        problem = _Problem(
            query.data_ptr(), query.stride(0), query.stride(1), query.shape[0],
            key_cache.data_ptr(), value_cache.data_ptr(), key_cache.shape[0], key_cache.shape[1],
            block_tables.data_ptr(), block_tables.stride(0), block_tables.shape[1],
            context_lens.data_ptr(), context_lens.shape[0],
            rows.seq_ids.data_ptr(), rows.query_rows.data_ptr(),
            rows.seq_ids.shape[0], rows.max_context_len,
            out.data_ptr(), out.stride(0), out.stride(1),
            query.shape[1], key_cache.shape[2], query.shape[2],
            scale,
        )  # fmt: skip
        if new_tokens is not None:
            _add_new_tokens(problem, new_tokens, query)
        status = self._function(ctypes.byref(problem), torch.get_num_threads())
        if status == -3:
            raise ValueError(f"cpu decode attention: {_STATUS[status]}")
        if status != 0:
            raise RuntimeError(f"cpu decode attention failed: {_STATUS.get(status, status)}")


def _add_new_tokens(problem: _Problem, new: NewTokens, query: torch.Tensor) -> None:
    rows, heads, dim = query.shape
    kv_shape = (rows, problem.num_kv_heads, dim)
    if new.key.shape != kv_shape or new.value.shape != kv_shape:
        raise ValueError(f"new keys and values must be {list(kv_shape)}")
    if new.key.stride(-1) != 1 or new.value.stride(-1) != 1:
        raise ValueError("new keys and values need a dense last dimension")
    tables = (new.cos, new.sin)
    if any(t.shape != (rows, 1, dim) or not t.is_contiguous() for t in tables):
        raise ValueError(f"cos and sin must be dense [{rows}, 1, {dim}]")
    if {new.key.dtype, new.value.dtype, new.cos.dtype, new.sin.dtype} != {torch.bfloat16}:
        raise ValueError("new keys, values, cos and sin must be bfloat16")
    slots = new.slot_mapping
    if slots.shape != (rows,) or slots.dtype != torch.int64 or not slots.is_contiguous():
        raise ValueError(f"slot_mapping must be dense int64 [{rows}]")
    problem.key_new, problem.value_new = new.key.data_ptr(), new.value.data_ptr()
    problem.key_new_row_stride, problem.key_new_head_stride = new.key.stride()[:2]
    problem.value_new_row_stride, problem.value_new_head_stride = new.value.stride()[:2]
    problem.cos, problem.sin = new.cos.data_ptr(), new.sin.data_ptr()
    problem.slot_mapping = slots.data_ptr()


def _check(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    rows: DecodeRows,
    out: torch.Tensor,
) -> None:
    tensors = (query, key_cache, value_cache, out)
    if any(t.dtype != torch.bfloat16 or t.device.type != "cpu" for t in tensors):
        raise ValueError("cpu decode attention takes bfloat16 CPU tensors")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("cpu decode attention needs dense KV caches")
    if out.stride(-1) != 1 or out.shape != query.shape:
        raise ValueError("out must have the query's shape and a dense last dimension")
    if not supports(query.dtype, query.device, query.shape[1], key_cache.shape[2], query.shape[2]):
        raise ValueError(f"cpu decode attention does not serve a query shaped {query.shape}")
    if key_cache.shape[-1] != query.shape[-1] or value_cache.shape != key_cache.shape:
        raise ValueError("the caches' head_dim must be the query's")
    indices = (block_tables, context_lens, rows.seq_ids, rows.query_rows)
    if any(t.dtype != torch.int32 or t.device.type != "cpu" for t in indices):
        raise ValueError("block tables, context lengths and rows must be int32 CPU tensors")
    if block_tables.dim() != 2 or block_tables.stride(-1) != 1:
        raise ValueError("block tables must be a matrix with a dense last dimension")
    if context_lens.dim() != 1 or block_tables.shape[0] < context_lens.shape[0]:
        raise ValueError("block tables need a row per context length")
    if not all(t.is_contiguous() for t in indices[1:]):
        raise ValueError("context lengths and rows must be dense")
    if rows.seq_ids.shape != rows.query_rows.shape:
        raise ValueError("rows need one query row per sequence id")


def build(build_dir: Path) -> CpuDecodeAttention:
    """The kernel compiled for this CPU into `build_dir` (once: later calls load it), or
    `KernelUnavailable` saying why not."""
    try:
        library = native_build.compile_cached(
            SOURCE,
            build_dir,
            _COMPILE_FLAGS,
            _LINK_FLAGS,
            _LIBRARIES,
            key_extra=native_build.cpu_flags(),
        )
    except native_build.NativeUnavailable as error:
        raise KernelUnavailable(str(error)) from None
    try:
        return CpuDecodeAttention(library)
    except OSError as error:
        raise KernelUnavailable(f"cannot load {library}: {error}") from None
