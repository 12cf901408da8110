"""How decode attention's grouping bound (`decode_min_waste` of `kernels.attention_plan`) prices
a decode step over long-tailed contexts, the shape a serving decode worker sees.

Each `--contexts` list is one batch (one sequence per entry, that many tokens of context), its
blocks scattered over a cache of `--pool-blocks` blocks as a busy worker's are. For every bound
in `--min-wastes`, one engine decode step (`LlamaModel.step`) is timed on the torch reference's
groups, and for a bfloat16 model the same step with the C decode kernel
(`kernels.cpu_decode_attention`, which groups nothing), in alternation, medians; the groups each
bound makes are printed beside.

    .venv/bin/python -m loadtest.decode_groups_bench --dtype bfloat16 \
        --contexts 30,45,60,80,100,130,150,180,220,300,450,800 --contexts 60,70,90,120,200,380,700
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable, Sequence

import torch

import shared.engine.model as model_module
from kernels.attention_plan import plan_attention
from shared.engine.kv_cache import KVCache
from shared.engine.loader import DTYPE_CHOICES, load_model, parse_dtype
from shared.engine.model import LlamaModel
from shared.engine.step_batch import SequenceChunk, build_step_batch

BLOCK_SIZE = 16


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected lengths like 30,45,800; got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"lengths must be positive; got {text!r}")
    return values


def decode_step(model: LlamaModel, contexts: Sequence[int], pool_blocks: int) -> Callable[[], None]:
    """One decode step over `contexts`, blocks drawn at random from a pool of `pool_blocks`."""
    needed = [-(-(context + 1) // BLOCK_SIZE) for context in contexts]
    if sum(needed) > pool_blocks:
        raise ValueError(f"the contexts need {sum(needed)} blocks; --pool-blocks {pool_blocks}")
    cache = KVCache(model.config, pool_blocks, BLOCK_SIZE, model.dtype, model.device)
    generator = torch.Generator(device=model.device).manual_seed(0)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.normal_(generator=generator)
    free = random.Random(0).sample(range(pool_blocks), sum(needed))
    chunks = []
    for context, count in zip(contexts, needed, strict=True):
        table, free = free[:count], free[count:]
        chunks.append(SequenceChunk([7], context, table))
    batch = build_step_batch(chunks, BLOCK_SIZE, model.device)
    return lambda: model.step(batch, cache)


def groups_of(contexts: Sequence[int], min_waste: int) -> list[int]:
    tables = torch.zeros(len(contexts), 1, dtype=torch.int32)
    lens = torch.tensor(contexts, dtype=torch.int32)
    starts = torch.arange(len(contexts) + 1, dtype=torch.int32)
    plan = plan_attention(
        tables, lens, starts, block_size=BLOCK_SIZE, max_query_len=1,
        max_context_len=max(contexts), decode_min_waste=min_waste,
    )  # fmt: skip
    return [group.num_seqs for group in plan.decode]


def time_bounds(
    model: LlamaModel, step: Callable[[], None], min_wastes: Sequence[int], repeats: int
) -> list[float]:
    """Median seconds of `step` under each bound of the reference's groups, then (where the
    model has it) with the C decode kernel, run in alternation after a warm-up."""
    original, kernel = model_module.plan_attention, model.decode_kernel
    settings = [(functools.partial(original, decode_min_waste=w), None) for w in min_wastes]
    if kernel is not None:
        settings.append((original, kernel))
    times: list[list[float]] = [[] for _ in settings]
    try:
        for round_index in range(repeats + 1):
            for samples, (plan, decode_kernel) in zip(times, settings, strict=True):
                model_module.plan_attention, model.decode_kernel = plan, decode_kernel
                start = time.perf_counter()
                step()
                if round_index:  # the first round warms up
                    samples.append(time.perf_counter() - start)
    finally:
        model_module.plan_attention, model.decode_kernel = original, kernel
    return [statistics.median(t) for t in times]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--contexts", type=_lengths, action="append", required=True)
    parser.add_argument("--min-wastes", type=_lengths, default=[4096, 1024, 512, 256, 64])
    parser.add_argument("--pool-blocks", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = load_model(args.model, dtype=parse_dtype(args.dtype, torch.device("cpu"))).model
    for contexts in args.contexts:
        step = decode_step(model, contexts, args.pool_blocks)
        seconds = time_bounds(model, step, args.min_wastes, args.repeats)
        print(f"{len(contexts)} sequences, contexts {min(contexts)}-{max(contexts)}:")
        for min_waste, s in zip(args.min_wastes, seconds, strict=False):
            print(f"  decode_min_waste {min_waste:>5}: {s * 1e3:7.1f} ms, groups "
                  f"{groups_of(contexts, min_waste)}")  # fmt: skip
        if len(seconds) > len(args.min_wastes):
            print(f"  C decode kernel:        {seconds[-1] * 1e3:7.1f} ms, no groups")


if __name__ == "__main__":
    main()
