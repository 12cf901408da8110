"""The C decode attention for bfloat16 CPU caches: against the float64 oracle on the awkward
batches of the reference's tests (NaN in every slot no sequence owns, shuffled blocks, padding
entries pointing at live blocks), beside the reference's prefill groups in mixed batches, its
input checks, its build (compiler missing or failing, the cached library reused) and the
loader's choice of it."""

import logging
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kernels import cpu_decode_attention
from kernels.attention_plan import DecodeRows, plan_attention
from kernels.attention_reference import paged_attention_reference
from kernels.cpu_decode_attention import CpuDecodeAttention, KernelUnavailable, NewTokens
from kernels.kv_write import write_kv
from kernels.paged_attention import paged_attention
from shared.engine.loader import decode_kernel_for
from shared.engine.rope import RotaryEmbedding, apply_rotary
from tests.helpers import TINY_KV_CONFIG
from tests.kernels.test_paged_attention import DECODE, MIXED, Batch, make_batch, naive_attention

# bfloat16 inputs, float32 arithmetic, a bfloat16 output: one rounding of values of size ~1.
TOLERANCE = 2e-2


@pytest.fixture(scope="module")
def kernel(tmp_path_factory) -> CpuDecodeAttention:
    return cpu_decode_attention.build(tmp_path_factory.mktemp("kernels"))


def run(kernel: CpuDecodeAttention, batch: Batch) -> torch.Tensor:
    plan = plan_attention(
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        block_size=batch.key_cache.shape[1],
        max_query_len=batch.max_query_len,
        max_context_len=batch.max_context_len,
        paged_decode=True,
    )
    return paged_attention(*batch.args(), **batch.kwargs(), plan=plan, decode_kernel=kernel)


def bf16_batch(seqs, **shape) -> Batch:
    return make_batch(seqs, dtype=torch.bfloat16, **shape)


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("num_heads, num_kv_heads, head_dim", [(2, 2, 24), (6, 2, 64), (9, 3, 64)])
@pytest.mark.parametrize("seqs", [DECODE, MIXED], ids=["decode", "mixed"])
def test_matches_the_oracle(kernel, seqs, num_heads, num_kv_heads, head_dim, block_size):
    batch = bf16_batch(
        seqs,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
    )
    out = run(kernel, batch)
    assert out.shape == batch.query.shape and out.dtype == torch.bfloat16
    assert not out.isnan().any()
    assert (out.double() - naive_attention(batch).double()).abs().max() < TOLERANCE


@settings(max_examples=20, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 70).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
        min_size=1,
        max_size=6,
    ),
    block_size=st.sampled_from([1, 4, 16]),
    kv_heads_and_group=st.sampled_from([(1, 1), (2, 3), (3, 4)]),
)
def test_matches_the_oracle_on_random_batches(kernel, seqs, block_size, kv_heads_and_group):
    num_kv_heads, group = kv_heads_and_group
    batch = bf16_batch(
        seqs,
        num_heads=num_kv_heads * group,
        num_kv_heads=num_kv_heads,
        head_dim=16,
        block_size=block_size,
    )
    assert (run(kernel, batch).double() - naive_attention(batch).double()).abs().max() < TOLERANCE


def test_long_contexts_are_closer_to_the_oracle_than_the_reference(kernel):
    """The reference rounds its probabilities to bfloat16 before weighting the values; the
    kernel keeps them in float32."""
    seqs = [(900, 1), (517, 1), (64, 1), (1, 1), (300, 1)]
    batch = bf16_batch(seqs, num_heads=9, num_kv_heads=3, head_dim=64, block_size=16)
    truth = naive_attention(batch).double()
    ours = (run(kernel, batch).double() - truth).abs().mean()
    reference = paged_attention_reference(*batch.args(), **batch.kwargs())
    assert ours < (reference.double() - truth).abs().mean()


def test_threads_do_not_change_the_result(kernel):
    batch = bf16_batch(
        [(300, 1), (5, 1), (77, 1), (160, 1)],
        num_heads=6,
        num_kv_heads=2,
        head_dim=32,
        block_size=16,
    )
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = run(kernel, batch)
        torch.set_num_threads(2)
        two = run(kernel, batch)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


def test_accepts_a_strided_query(kernel):
    batch = bf16_batch(MIXED, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    # The model hands over a view of the fused QKV projection: rows are not contiguous.
    fused = torch.cat([batch.query.flatten(1), torch.randn(batch.query.shape[0], 5).bfloat16()], 1)
    strided = replace(batch, query=fused[:, : batch.query[0].numel()].view(batch.query.shape))
    assert not strided.query.is_contiguous()
    assert torch.equal(run(kernel, strided), run(kernel, batch))


def decode_call(kernel: CpuDecodeAttention, batch: Batch, **changes) -> None:
    n = batch.context_lens.shape[0]
    ids = torch.arange(n, dtype=torch.int32)
    rows = DecodeRows(ids, ids.clone(), batch.max_context_len)
    args = {
        "query": batch.query,
        "key_cache": batch.key_cache,
        "value_cache": batch.value_cache,
        "block_tables": batch.block_tables,
        "context_lens": batch.context_lens,
        "rows": rows,
        "out": torch.empty_like(batch.query),
    }
    args.update(changes)
    kernel(**args, scale=batch.scale)


BAD_INPUTS = {
    "float32 query": (lambda b: {"query": b.query.float()}, "bfloat16"),
    "sparse cache": (lambda b: {"key_cache": b.key_cache[:, ::2]}, "dense KV caches"),
    "int64 tables": (lambda b: {"block_tables": b.block_tables.long()}, "int32"),
    "out too small": (lambda b: {"out": b.query[:1].clone()}, "query's shape"),
    "head_dim 512": (
        lambda b: {
            "query": torch.zeros(5, 6, 512).bfloat16(),
            "out": torch.zeros(5, 6, 512).bfloat16(),
        },
        "does not serve",
    ),
    "cache head_dim": (
        lambda b: {"query": b.query[..., :8], "out": torch.empty_like(b.query[..., :8])},
        "caches' head_dim",
    ),
    # (The kernel bounds a sequence by the context lengths: it read rows past the table.)
    "fewer table rows than sequences": (
        lambda b: {"block_tables": b.block_tables[:1]},
        "a row per context length",
    ),
    "a vector for tables": (lambda b: {"block_tables": b.block_tables[0]}, "a matrix"),
    "meta tables": (lambda b: {"block_tables": b.block_tables.to("meta")}, "CPU tensors"),
}


@pytest.mark.parametrize("name", sorted(BAD_INPUTS))
def test_bad_inputs_raise_value_error(kernel, name):
    change, message = BAD_INPUTS[name]
    batch = bf16_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match=message):
        decode_call(kernel, batch, **change(batch))


def _with_table_entry(batch: Batch, value: int) -> dict:
    tables = batch.block_tables.clone()
    tables[2, 0] = value
    return {"block_tables": tables}


def _rows(seq_ids: list[int], query_rows: list[int], max_context_len: int = 33) -> dict:
    ids = torch.tensor(seq_ids, dtype=torch.int32)
    return {"rows": DecodeRows(ids, torch.tensor(query_rows, dtype=torch.int32), max_context_len)}


# Each would read or write past its tensor: the kernel refuses instead (no task touches memory).
OUT_OF_RANGE = {
    "block id past the cache": lambda b: _with_table_entry(b, b.key_cache.shape[0]),
    "negative block id": lambda b: _with_table_entry(b, -1),
    "context longer than its table": lambda b: {
        "context_lens": torch.tensor([17, 1, 10_000, 16, 5], dtype=torch.int32)
    },
    "context longer than the scratch": lambda b: _rows([0, 1, 2], [0, 1, 2], max_context_len=20),
    "sequence id": lambda b: _rows([0, 5], [0, 1]),
    "query row": lambda b: _rows([0, 1], [0, 5]),
    "rows of unequal length": lambda b: _rows([0, 1], [0]),
}


@pytest.mark.parametrize("name", sorted(OUT_OF_RANGE))
def test_indices_out_of_range_raise_value_error(kernel, name):
    batch = bf16_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    with pytest.raises(ValueError, match="out of range|one query row per sequence"):
        decode_call(kernel, batch, **OUT_OF_RANGE[name](batch))


def test_a_plan_with_decode_rows_needs_the_kernel():
    batch = bf16_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    plan = plan_attention(
        batch.block_tables,
        batch.context_lens,
        batch.query_start_loc,
        block_size=16,
        max_query_len=1,
        max_context_len=batch.max_context_len,
        paged_decode=True,
    )
    with pytest.raises(ValueError, match="decode kernel"):
        paged_attention(*batch.args(), **batch.kwargs(), plan=plan)


def test_build_reuses_the_compiled_library(tmp_path):
    first = cpu_decode_attention.build(tmp_path)
    stamp = first.library.stat().st_mtime_ns
    second = cpu_decode_attention.build(tmp_path)
    assert second.library == first.library and second.library.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.library.name]  # no temporary left


def test_loading_it_leaves_the_process_floating_point_alone(tmp_path):
    """A library linked with -ffast-math would turn on flush-to-zero for the whole process at
    load time (subnormal results become 0 everywhere, the scheduler's and sampler's included)."""
    script = (
        "import sys; from pathlib import Path; from kernels import cpu_decode_attention as k; "
        f"k.build(Path({str(tmp_path)!r})); tiny = sys.float_info.min; "
        "sys.exit(0 if tiny / 2 > 0 else 'flush-to-zero is on')"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_build_without_a_compiler_says_so(tmp_path, monkeypatch):
    monkeypatch.setenv("CC", "no-such-compiler-here")
    with pytest.raises(KernelUnavailable, match="no C compiler"):
        cpu_decode_attention.build(tmp_path)


def test_a_failing_compiler_leaves_nothing_behind(tmp_path, monkeypatch):
    compiler = tmp_path / "bin" / "cc"
    compiler.parent.mkdir()
    compiler.write_text("#!/bin/sh\necho 'cc: fatal error: out of luck' >&2\nexit 1\n")
    compiler.chmod(0o755)
    monkeypatch.setenv("CC", str(compiler))
    build_dir = tmp_path / "kernels"
    with pytest.raises(KernelUnavailable, match="out of luck"):
        cpu_decode_attention.build(build_dir)
    assert not any(build_dir.iterdir())


# SmolLM2's attention shape: what the loader checks before building the kernel.
SMOLLM2_SHAPE = replace(TINY_KV_CONFIG, num_heads=9, num_kv_heads=3, head_dim=64)


def test_the_loader_builds_it_for_bfloat16_on_the_cpu(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    kernel = decode_kernel_for("auto", SMOLLM2_SHAPE, torch.bfloat16, cpu)
    assert isinstance(kernel, CpuDecodeAttention)
    assert kernel.library.parent == Path(tmp_path) / "kernels"
    assert decode_kernel_for("native", SMOLLM2_SHAPE, torch.bfloat16, cpu) is not None
    assert decode_kernel_for("reference", SMOLLM2_SHAPE, torch.bfloat16, cpu) is None
    # float32 keeps the reference: its greedy tokens are transformers'.
    assert decode_kernel_for("auto", SMOLLM2_SHAPE, torch.float32, cpu) is None
    with pytest.raises(ValueError, match="bfloat16 models on the CPU"):
        decode_kernel_for("native", SMOLLM2_SHAPE, torch.float32, cpu)
    with pytest.raises(ValueError, match="must be one of auto, native, reference"):
        decode_kernel_for("fast", SMOLLM2_SHAPE, torch.bfloat16, cpu)


def test_the_loader_names_the_shape_the_kernel_cannot_serve(tmp_path, monkeypatch):
    """A bfloat16 CPU model with a wider query group than the kernel's buffers: `native` said
    "serves bfloat16 models on the CPU, got bfloat16 on cpu", which names no reason."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    wide = replace(SMOLLM2_SHAPE, num_heads=32, num_kv_heads=1)
    assert decode_kernel_for("auto", wide, torch.bfloat16, cpu) is None
    with pytest.raises(ValueError, match="head_dim 64, 32 query heads per KV head"):
        decode_kernel_for("native", wide, torch.bfloat16, cpu)
    big = replace(SMOLLM2_SHAPE, head_dim=512)
    with pytest.raises(ValueError, match="on cpu, head_dim 512,"):
        decode_kernel_for("native", big, torch.bfloat16, cpu)


def test_the_loader_falls_back_without_a_compiler(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "no-such-compiler-here")
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        assert decode_kernel_for("auto", SMOLLM2_SHAPE, torch.bfloat16, cpu) is None
    assert "falls back to the torch reference: no C compiler" in caplog.text
    with pytest.raises(ValueError, match="unavailable: no C compiler"):
        decode_kernel_for("native", SMOLLM2_SHAPE, torch.bfloat16, cpu)


def fused_case(num_rows: int = 5, seed: int = 3):
    """A decode batch whose new tokens are not yet in the cache: their unrotated q/k/v, the
    rotary tables of their positions and their slots (each sequence's last position), and the
    rows (every sequence decodes)."""
    batch = bf16_batch(DECODE, num_heads=6, num_kv_heads=2, head_dim=16, block_size=16)
    gen = torch.Generator().manual_seed(seed)
    rotary = RotaryEmbedding({"rope_theta": 10000.0}, 16, 64, dtype=torch.bfloat16)
    positions = (batch.context_lens - 1).long()
    cos, sin = rotary.lookup(positions)
    tables = batch.block_tables.long()
    slots = tables[torch.arange(num_rows), positions // 16] * 16 + positions % 16
    q, k, v = (torch.randn(num_rows, h, 16, generator=gen).bfloat16() for h in (6, 2, 2))
    ids = torch.arange(num_rows, dtype=torch.int32)
    rows = DecodeRows(ids, ids.clone(), batch.max_context_len)
    return batch, replace(batch, query=q), NewTokens(k, v, cos, sin, slots), rows


def test_fused_rotary_and_kv_write_match_the_separate_steps(kernel):
    batch, unrotated, new, rows = fused_case()
    # Separately: torch's rotary and KV write, then the kernel on the written cache.
    q, k = apply_rotary(unrotated.query, new.key, new.cos, new.sin)
    separate_keys, separate_values = batch.key_cache.clone(), batch.value_cache.clone()
    write_kv(k, new.value, separate_keys, separate_values, new.slot_mapping)
    expected = torch.empty_like(q)
    kernel(q, separate_keys, separate_values, batch.block_tables, batch.context_lens, rows,
           expected, scale=batch.scale)  # fmt: skip
    fused = torch.empty_like(q)
    kernel(unrotated.query, batch.key_cache, batch.value_cache, batch.block_tables,
           batch.context_lens, rows, fused, scale=batch.scale, new_tokens=new)  # fmt: skip
    # The kernel rotates in float32 and rounds once; torch rounds each product to bfloat16.
    slots = new.slot_mapping
    key_rows = batch.key_cache.view(-1, 2, 16)[slots].float()
    assert (key_rows - separate_keys.view(-1, 2, 16)[slots].float()).abs().max() < TOLERANCE
    assert torch.equal(batch.value_cache.view(-1, 2, 16)[slots], new.value)
    assert (fused.float() - expected.float()).abs().max() < TOLERANCE


def test_fused_write_skips_negative_slots_and_refuses_slots_past_the_cache(kernel):
    batch, unrotated, new, rows = fused_case()
    before = batch.value_cache.clone()
    skipped = replace(new, slot_mapping=torch.full((5,), -1, dtype=torch.int64))
    kernel(unrotated.query, batch.key_cache, batch.value_cache, batch.block_tables,
           batch.context_lens, rows, torch.empty_like(unrotated.query), scale=batch.scale,
           new_tokens=skipped)  # fmt: skip
    assert torch.equal(batch.value_cache.nan_to_num(), before.nan_to_num())
    past = replace(new, slot_mapping=torch.full((5,), batch.key_cache.shape[0] * 16))
    with pytest.raises(ValueError, match="out of range"):
        kernel(unrotated.query, batch.key_cache, batch.value_cache, batch.block_tables,
               batch.context_lens, rows, torch.empty_like(unrotated.query), scale=batch.scale,
               new_tokens=past)  # fmt: skip


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda n: {"key": n.key[:3]}, "new keys and values"),
        (lambda n: {"cos": n.cos.float()}, "bfloat16"),
        (lambda n: {"sin": n.sin[:, :, :8]}, "cos and sin"),
        (lambda n: {"slot_mapping": n.slot_mapping.int()}, "slot_mapping"),
    ],
)
def test_fused_inputs_are_checked(kernel, change, message):
    batch, unrotated, new, rows = fused_case()
    with pytest.raises(ValueError, match=message):
        kernel(unrotated.query, batch.key_cache, batch.value_cache, batch.block_tables,
               batch.context_lens, rows, torch.empty_like(unrotated.query), scale=batch.scale,
               new_tokens=replace(new, **change(new)))  # fmt: skip


def test_the_loader_falls_back_where_it_cannot_write_the_build(tmp_path, monkeypatch, caplog):
    occupied = tmp_path / "not-a-directory"
    occupied.write_text("")
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(occupied))
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING):
        assert decode_kernel_for("auto", SMOLLM2_SHAPE, torch.bfloat16, cpu) is None
    assert "falls back to the torch reference: cannot write" in caplog.text
    with pytest.raises(ValueError, match="unavailable: cannot write"):
        decode_kernel_for("native", SMOLLM2_SHAPE, torch.bfloat16, cpu)
