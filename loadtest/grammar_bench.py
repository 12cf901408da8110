"""What structured outputs cost: decode step time with every row of the batch constrained by a JSON
schema against none constrained, at each batch size, and grammar compile time (cold and cached).

    python -m loadtest.grammar_bench --batch-sizes 1 8 32 --steps 12 [--threads 1]

The runs use the same engine, prompts and greedy sampling, side by side in one process: free,
constrained (the masks of built matchers filled on their own thread during the forward, the
engine's way), and constrained with every mask filled at sampling time (`serial_step_ms`, the
overlap switched off for comparison), and one batch mask fill of the constrained rows timed
alone (`mask_fill_ms`: what the overlap can save per step). `--threads` sets torch's threads (a
`tandem up` worker runs one; the mask thread then has the other core). A step counts when its
batch is full (constrained rows may finish early by closing their JSON); the figure is the
median over those steps. The schema admits long outputs (a list of sentences), so
rows rarely finish within the measured steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import xgrammar as xgr

from shared.engine.constraint import schema_constraint
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.grammar import GrammarCache
from shared.engine.loader import load_model
from shared.engine.sampling_params import SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string"},
        "sentences": {"type": "array", "items": {"type": "string"}},
        "rating": {"type": "integer"},
    },
    "required": ["title", "sentences", "rating"],
}
PROMPT = "Write a long story about a lighthouse keeper, as JSON."


def median_step_s(engine: LLMEngine, prompt_ids: list[int], batch: int, params, steps: int):
    ids = [engine.add_request(prompt_ids, params) for _ in range(batch)]
    while any(engine._sequences[i].num_output_tokens == 0 for i in ids):  # prefill them all
        engine.step()
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.step()
        if engine.last_step_num_seqs == batch:
            times.append(time.perf_counter() - started)
    fill_s = median_fill_s(engine, ids)
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times) if times else float("nan"), len(times), fill_s


def median_fill_s(engine: LLMEngine, ids: list[str], repeats: int = 20) -> float | None:
    """One batch mask fill of the run's constrained rows where they stand, timed alone (the
    median of `repeats`): what the overlap can take off a step. None for a free run."""
    matchers = [
        seq.grammar.matcher
        for seq in (engine._sequences.get(i) for i in ids)
        if seq is not None and seq.grammar is not None and seq.grammar.matcher is not None
    ]
    if not matchers:
        return None
    bitmask = xgr.allocate_token_bitmask(len(matchers), engine.model.config.vocab_size)
    batch = xgr.BatchGrammarMatcher(max_threads=1)
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        batch.batch_fill_next_token_bitmask(matchers, bitmask)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


@contextmanager
def masks_filled_at_sampling(engine: LLMEngine) -> Iterator[None]:
    """The engine without its mask fill ahead of the forward: every mask is filled when the
    step samples, as before the overlap (for comparison only)."""
    engine.sampler.fill_masks_ahead = lambda matchers, vocab_size: None
    try:
        yield
    finally:
        del engine.sampler.fill_masks_ahead  # the class's method again


def compile_times(tokenizer, vocab_size: int, eos: list[int], num_schemas: int) -> dict:
    cache = GrammarCache(tokenizer, vocab_size, eos)
    schemas = [dict(SCHEMA, title=f"s{i}") for i in range(num_schemas)]  # distinct specs
    cold, cached = [], []
    for schema in schemas:
        constraint = schema_constraint(schema, "bench")
        started = time.perf_counter()
        cache.get(constraint)
        cold.append(time.perf_counter() - started)
        started = time.perf_counter()
        cache.get(constraint)
        cached.append(time.perf_counter() - started)
    return {
        "compile_cold_ms_median": 1e3 * statistics.median(cold),
        "compile_cached_ms_median": 1e3 * statistics.median(cached),
        "cache_bytes": cache.num_bytes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None)
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--steps", type=int, default=12, help="decode steps timed per run")
    parser.add_argument("--num-schemas", type=int, default=8, help="schemas compiled")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's choice)")
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.num_schemas < 1:
        parser.error("--batch-sizes, --steps and --num-schemas must be >= 1")
    if args.threads is not None:
        if args.threads < 1:
            parser.error("--threads must be >= 1")
        torch.set_num_threads(args.threads)
    loaded = load_model(args.model, dtype=torch.float32)
    tokenizer = loaded.tokenizer
    engine = LLMEngine(
        loaded.model, EngineConfig(kv_cache_bytes=512 << 20, max_num_seqs=64), tokenizer=tokenizer
    )
    prompt_ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=True
    )
    prompt_ids = list(getattr(prompt_ids, "input_ids", prompt_ids))
    max_tokens = args.steps + 8
    free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=max_tokens, temperature=0, constraint=schema_constraint(SCHEMA, "bench")
    )
    engine.grammar.cache.get(constrained.constraint)  # compile once: the step figure excludes it
    results = []
    for batch in args.batch_sizes:
        free_s, free_n, _ = median_step_s(engine, prompt_ids, batch, free, args.steps)
        cons_s, cons_n, fill_s = median_step_s(engine, prompt_ids, batch, constrained, args.steps)
        with masks_filled_at_sampling(engine):
            serial_s, serial_n, _ = median_step_s(
                engine, prompt_ids, batch, constrained, args.steps
            )
        results.append(
            {
                "batch": batch,
                "free_step_ms": round(1e3 * free_s, 2),
                "constrained_step_ms": round(1e3 * cons_s, 2),
                "serial_step_ms": round(1e3 * serial_s, 2),
                "mask_fill_ms": None if fill_s is None else round(1e3 * fill_s, 3),
                "ratio": round(cons_s / free_s, 3),
                "serial_ratio": round(serial_s / free_s, 3),
                "steps_counted": [free_n, cons_n, serial_n],
            }
        )
        print(json.dumps(results[-1]), flush=True)
    eos = sorted(engine.eos_token_ids)
    summary = compile_times(tokenizer, loaded.model.config.vocab_size, eos, args.num_schemas)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
