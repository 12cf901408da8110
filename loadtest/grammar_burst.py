"""A burst of distinct slow grammars whose requests give up, then fresh ones: how long the fresh
ones wait for their compiles. A worker's compile pool (two threads) takes compiles in order;
one still queued when every request that asked for it has given up is skipped
(`GrammarCache`), so the fresh requests do not wait behind grammars nobody waits for.

Each spec is a JSON string with a `maxLength` (a few seconds to compile here, each distinct).

    .venv/bin/python -m loadtest.grammar_burst [--burst 8] [--fresh 2] [--limit-s 8]
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import Future

from shared.engine.constraint import Constraint, schema_constraint
from shared.engine.grammar import GrammarCache

SLOW_LENGTH = 500  # the first spec's maxLength; each spec adds one (distinct grammars)


def slow_spec(number: int) -> Constraint:
    return schema_constraint({"type": "string", "maxLength": SLOW_LENGTH + number}, "burst")


def asked_without_limit(cache: GrammarCache, spec: Constraint) -> Future:
    """The compile of a request that waits as long as it takes (the fresh ones: their wait is
    what is measured). A cache from before the skip (2026-12-07) takes no deadline."""
    try:
        return cache.submit(spec, time.monotonic() + 3600)
    except TypeError:
        return cache.submit(spec)


def run(args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    directory, _ = resolve_model_dir(None)
    tokenizer = AutoTokenizer.from_pretrained(directory)
    vocab_size = len(tokenizer)
    eos = [tokenizer.eos_token_id]
    # Every request waits `--limit-s` (the fresh ones' futures are waited on whole, below).
    cache = GrammarCache(tokenizer, vocab_size, eos, compile_timeout_s=args.limit_s)
    if cache.compiler_error() is not None:
        raise SystemExit(f"xgrammar's tables: {cache.compiler_error()}")
    started = time.perf_counter()
    cache.submit(slow_spec(0)).result()  # (begins at once: never skipped)
    one_s = time.perf_counter() - started
    for number in range(1, args.burst + 1):  # their requests give up after the limit
        cache.submit(slow_spec(number))
    time.sleep(args.limit_s + 0.2)
    asked = time.perf_counter()
    fresh = [asked_without_limit(cache, slow_spec(1000 + number)) for number in range(args.fresh)]
    for future in fresh:
        future.result()
    waited_s = time.perf_counter() - asked
    cache.close()
    skipped = getattr(cache, "num_skipped", -1)  # (-1: a cache that skips none, before)
    return {"one_compile_s": one_s, "fresh_waited_s": waited_s, "skipped": skipped}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--burst", type=int, default=8, help="slow specs given up on")
    parser.add_argument("--fresh", type=int, default=2, help="specs asked afterwards")
    parser.add_argument("--limit-s", type=float, default=8.0, help="the burst's wait")
    args = parser.parse_args(argv)
    if args.burst < 1 or args.fresh < 1 or not 0 < args.limit_s < 3600:
        parser.error("--burst and --fresh must be at least 1, --limit-s in (0, 3600)")
    for key, value in run(args).items():
        print(f"{key:>15}: {value:.2f}" if isinstance(value, float) else f"{key:>15}: {value}")


if __name__ == "__main__":
    main()
