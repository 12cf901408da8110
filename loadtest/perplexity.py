"""Quality of each offered precision, measured: perplexity of the real model on a fixed text, and
greedy agreement with float32 over the reference prompts.

Issue 14's rule: a faster format is judged by measured quality, never assumed; bfloat16 must stay
within 1% of float32's perplexity. For each `--dtypes` entry the model is loaded as the server
loads it (`shared.engine.loader.load_model`) and
- perplexity: the text (`loadtest/corpus.txt` by default) is cut into windows of `--window`
  tokens; each window is one prefill through the engine's own paged forward, and every token after
  a window's first is scored by the logits before it (exp of the mean negative log-likelihood);
- decode perplexity: the same windows scored through decode steps (all windows one batch, one
  token each per step), so that decode attention is measured too;
- greedy agreement: the reference prompts (chat and plain, as `tandem generate` encodes them) run
  greedily for `--new-tokens` tokens through the engine; reported are how many outputs equal
  float32's exactly, and the mean share of tokens before the first that differs.

Besides the dtypes, `fp16-weights` is float32 with `--quantization fp16`, and
`bfloat16-fp16-weights` bfloat16 with it, each measured at its worst: every product reads the
float16 weights (served, only decode steps of a few rows do).

    .venv/bin/python -m loadtest.perplexity [--dtypes float32,bfloat16,fp16-weights]
        [--window 256] [--max-windows 16] [--new-tokens 32] [--decode-attention reference]
        [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from services.commands.generate import encode_prompt
from shared.engine import linear
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.kv_cache import KVCache
from shared.engine.loader import DTYPES, LoadedModel, load_model
from shared.engine.model import rms_norm
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_batch import SequenceChunk, build_step_batch

CORPUS = Path(__file__).with_name("corpus.txt")
# `--quantization fp16` formats: the model's dtype, every product from float16 weights
HALF_WEIGHTS = {"fp16-weights": torch.float32, "bfloat16-fp16-weights": torch.bfloat16}
CHAT_PROMPTS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 100.",
)
PLAIN_PROMPTS = (
    "The quick brown fox",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the mountains,",
    "Les fleurs du printemps sont",
)
BLOCK_SIZE = 16


@torch.inference_mode()
def window_logits(loaded: LoadedModel, token_ids: list[int]) -> torch.Tensor:
    """float32 logits [len(token_ids), vocab] of every position, from one paged prefill."""
    model = loaded.model
    num_blocks = -(-len(token_ids) // BLOCK_SIZE)
    cache = KVCache(model.config, num_blocks, BLOCK_SIZE, model.dtype, model.device)
    chunk = SequenceChunk(token_ids, 0, list(range(num_blocks)))
    batch = build_step_batch([chunk], BLOCK_SIZE, model.device)
    hidden = rms_norm(model.forward(batch, cache), model.final_norm, model.config.rms_norm_eps)
    return model.lm_head(hidden).float()


def windows(token_ids: list[int], window: int) -> list[list[int]]:
    """`token_ids` cut into consecutive windows of `window` tokens, each scored on its own (a
    last one of a single token, with nothing to score, left out)."""
    pieces = [token_ids[start : start + window] for start in range(0, len(token_ids), window)]
    return [piece for piece in pieces if len(piece) >= 2]


def perplexity(loaded: LoadedModel, token_ids: list[int], window: int) -> tuple[float, int]:
    """(perplexity, tokens scored) over consecutive windows of `token_ids`."""
    total_nll, num_scored = 0.0, 0
    for piece in windows(token_ids, window):
        logits = window_logits(loaded, piece)[:-1]
        targets = torch.tensor(piece[1:], device=logits.device)
        total_nll += F.cross_entropy(logits, targets, reduction="sum").item()
        num_scored += len(piece) - 1
    return math.exp(total_nll / num_scored), num_scored


@torch.inference_mode()
def decode_perplexity(loaded: LoadedModel, token_ids: list[int], window: int) -> float:
    """Perplexity over the same windows, scored through decode steps instead of one prefill:
    the windows run side by side as a batch, one token each per step (teacher forcing), so every
    logit comes from the decode path (decode attention over the cache: the C kernel or the
    reference's groups, as the model was loaded)."""
    pieces = windows(token_ids, window)
    model = loaded.model
    blocks = -(-window // BLOCK_SIZE)
    cache = KVCache(model.config, blocks * len(pieces), BLOCK_SIZE, model.dtype, model.device)
    tables = [list(range(i * blocks, (i + 1) * blocks)) for i in range(len(pieces))]
    total_nll, num_scored = 0.0, 0
    for position in range(max(len(w) for w in pieces) - 1):
        live = [i for i, w in enumerate(pieces) if position < len(w) - 1]
        chunks = [SequenceChunk([pieces[i][position]], position, tables[i]) for i in live]
        logits = model.step(build_step_batch(chunks, BLOCK_SIZE, model.device), cache)
        targets = torch.tensor([pieces[i][position + 1] for i in live], device=logits.device)
        total_nll += F.cross_entropy(logits, targets, reduction="sum").item()
        num_scored += len(live)
    return math.exp(total_nll / num_scored)


def reference_prompts(tokenizer) -> list[list[int]]:
    chat = [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    return chat + [encode_prompt(tokenizer, p, chat=False) for p in PLAIN_PROMPTS]


def greedy_outputs(loaded: LoadedModel, prompts: list[list[int]], new_tokens: int) -> list:
    engine = LLMEngine(loaded.model, EngineConfig(num_blocks=256))
    params = SamplingParams(max_tokens=new_tokens, temperature=0.0)
    return [result.token_ids for result in engine.generate(prompts, params)]


def agreement(reference: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Exact matches, and the mean share of each reference output before the first difference."""
    shares = []
    for ref, got in zip(reference, other, strict=True):
        pairs = zip(ref, got, strict=False)  # outputs may differ in length (EOS)
        same = next((i for i, (a, b) in enumerate(pairs) if a != b), min(len(ref), len(got)))
        shares.append(same / max(len(ref), 1))
    exact = sum(ref == got for ref, got in zip(reference, other, strict=True))
    return {"exact": exact, "of": len(reference), "mean_prefix_share": sum(shares) / len(shares)}


def load_format(model: str | None, name: str, decode_attention: str = "auto") -> LoadedModel:
    if name not in HALF_WEIGHTS:
        return load_model(model, dtype=DTYPES[name], decode_attention=decode_attention)
    served_rows = linear.HALF_WEIGHT_MAX_ROWS
    # Read as the layers are made: all rows float16.
    linear.HALF_WEIGHT_MAX_ROWS = dict.fromkeys(served_rows, sys.maxsize)
    try:
        return load_model(
            model,
            dtype=HALF_WEIGHTS[name],
            linear_backend="fp16",
            decode_attention=decode_attention,
        )
    finally:
        linear.HALF_WEIGHT_MAX_ROWS = served_rows


def measure(args: argparse.Namespace) -> dict:
    results, reference = {}, None
    for name in args.dtypes:
        started = time.perf_counter()
        loaded = load_format(args.model, name, args.decode_attention)
        token_ids = loaded.tokenizer(args.text.read_text())["input_ids"]
        if args.max_windows:
            token_ids = token_ids[: args.max_windows * args.window]
        value, num_scored = perplexity(loaded, token_ids, args.window)
        decoded = decode_perplexity(loaded, token_ids, args.window)
        outputs = greedy_outputs(loaded, reference_prompts(loaded.tokenizer), args.new_tokens)
        reference = reference if reference is not None else outputs
        results[name] = {
            "perplexity": value,
            "decode_perplexity": decoded,
            "decode_attention": "reference" if loaded.model.decode_kernel is None else "native",
            "tokens_scored": num_scored,
            "greedy_vs_first": agreement(reference, outputs),
            "seconds": time.perf_counter() - started,
        }
    first = results[args.dtypes[0]]["perplexity"]
    for entry in results.values():
        entry["perplexity_vs_first"] = entry["perplexity"] / first - 1
    return results


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default=None, help="model directory or name (default: SmolLM2)")
    parser.add_argument("--dtypes", default="float32,bfloat16",
                        help="comma-separated; the first is the reference")  # fmt: skip
    parser.add_argument("--text", type=Path, default=CORPUS)
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--max-windows", type=int, default=16, help="0: the whole text")
    parser.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument(
        "--decode-attention",
        default="auto",
        choices=("auto", "reference"),
        help="auto: the C kernel where the format has one (bfloat16 on the CPU); reference: torch",
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args(argv)
    args.dtypes = args.dtypes.split(",")
    formats = [*DTYPES, *HALF_WEIGHTS]
    unknown = [d for d in args.dtypes if d not in formats]
    if unknown or not args.dtypes:
        parser.error(f"--dtypes: unknown {unknown}; choose from {', '.join(formats)}")
    if args.window < 2 or args.new_tokens < 1 or args.max_windows < 0:
        parser.error("--window must be >= 2, --new-tokens >= 1, --max-windows >= 0")
    if not args.text.is_file():
        parser.error(f"--text: no such file {args.text}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args)
    print(
        f"{'format':>12} {'perplexity':>10} {'vs first':>9} {'decode ppl':>10} {'attention':>9} "
        f"{'greedy exact':>12} {'prefix':>7}"
    )
    for name, entry in results.items():
        greedy = entry["greedy_vs_first"]
        print(
            f"{name:>12} {entry['perplexity']:>10.4f} {entry['perplexity_vs_first']:>+8.2%} "
            f"{entry['decode_perplexity']:>10.4f} {entry['decode_attention']:>9} "
            f"{greedy['exact']:>6}/{greedy['of']:<5} {greedy['mean_prefix_share']:>6.1%}"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.stdout.flush()


if __name__ == "__main__":
    main()
