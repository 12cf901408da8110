"""What structured outputs cost: decode step time with every row of the batch constrained by a JSON
schema against none constrained, at each batch size, and grammar compile time (cold and cached).

    python -m loadtest.grammar_bench --batch-sizes 1 8 32 --steps 12

Both runs use the same engine, prompts and greedy sampling, side by side in one process. A step
counts when its batch is full (constrained rows may finish early by closing their JSON); the
figure is the median over those steps. The schema admits long outputs (a list of sentences), so
rows rarely finish within the measured steps.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

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
    for request_id in ids:
        engine.abort(request_id)
    return statistics.median(times) if times else float("nan"), len(times)


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
    args = parser.parse_args(argv)
    if min(args.batch_sizes) < 1 or args.steps < 1 or args.num_schemas < 1:
        parser.error("--batch-sizes, --steps and --num-schemas must be >= 1")
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
        free_s, free_n = median_step_s(engine, prompt_ids, batch, free, args.steps)
        cons_s, cons_n = median_step_s(engine, prompt_ids, batch, constrained, args.steps)
        results.append(
            {
                "batch": batch,
                "free_step_ms": round(1e3 * free_s, 2),
                "constrained_step_ms": round(1e3 * cons_s, 2),
                "ratio": round(cons_s / free_s, 3),
                "steps_counted": [free_n, cons_n],
            }
        )
        print(json.dumps(results[-1]), flush=True)
    eos = sorted(engine.eos_token_ids)
    summary = compile_times(tokenizer, loaded.model.config.vocab_size, eos, args.num_schemas)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
