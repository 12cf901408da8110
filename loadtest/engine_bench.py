"""Engine benchmark: our paged forward against transformers' own, side by side in one run.

On the real model, with a fixed number of threads, it measures:
- prefill: tokens/s for one prompt of `--prompt-len` tokens (ours: one step; transformers: one
  forward with its default cache);
- decode: the time of one step at each batch size with `--context` tokens of context per sequence
  (ours: the whole engine step, i.e. batch building, forward and greedy sampling; transformers:
  forward with its DynamicCache plus argmax), the two run in alternation. The caches are filled
  with random K/V rather than by running the prompts, which costs the same per step and keeps the
  run short.

Medians over `--repeats` runs after a warm-up. Results print as a table and optionally as JSON.
With `--device cuda` both run on the GPU and every timed run ends with a device synchronize.

    .venv/bin/python loadtest/engine_bench.py [--threads 2] [--batch-sizes 1,8,32,64] [--device cpu]
        [--profile-batch 8] [--linear-backend dense]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from shared.engine.block_manager import BlockManager
from shared.engine.decode_graphs import DecodeGraphs, cuda_capture, eager_capture
from shared.engine.kv_cache import KVCache
from shared.engine.linear import LINEAR_BACKENDS
from shared.engine.loader import (
    DECODE_ATTENTION_CHOICES,
    DECODE_ATTENTION_HELP,
    DEVICE_HELP,
    DTYPE_CHOICES,
    device_argument,
    load_model,
    parse_device,
    parse_dtype,
)
from shared.engine.sampling import Sampler, SamplingRow
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_batch import SequenceChunk, build_step_batch


def median_seconds(fn, repeats: int, device: torch.device | str = "cpu") -> float:
    return paired_medians([fn], repeats, device)[0]


def paired_medians(fns, repeats: int, device: torch.device | str = "cpu") -> list[float]:
    """Median time of each function, run in alternation after a warm-up, so that a noisy,
    shared machine slows each of them alike (the ratios are what we report). On CUDA each run
    ends with a synchronize, so queued kernels count where they were launched."""
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    for fn in fns:
        fn()
    sync()
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, samples in zip(fns, times, strict=True):
            start = time.perf_counter()
            fn()
            sync()
            samples.append(time.perf_counter() - start)
    return [statistics.median(samples) for samples in times]


def ours_prefill(model, prompt_len: int, context: int = 0):
    """One prefill step of `prompt_len` tokens after `context` tokens already in the KV cache
    (a cached prefix, or a long prompt's earlier chunks), which its attention reads."""
    block_size = 16
    num_blocks = -(-(context + prompt_len) // block_size)
    cache = KVCache(model.config, num_blocks, block_size, model.dtype, model.device)
    tokens = torch.randint(0, model.config.vocab_size, (prompt_len,)).tolist()
    chunk = SequenceChunk(tokens, context, list(range(num_blocks)))
    batch = build_step_batch([chunk], block_size, model.device)
    return lambda: model.step(batch, cache)


def hf_prefill(hf_model, prompt_len: int):
    ids = torch.randint(0, hf_model.config.vocab_size, (1, prompt_len)).to(hf_model.device)
    return lambda: hf_model(ids, use_cache=True)


def ours_decode(model, batch_size: int, context: int, repeats: int, graphs: bool = False):
    """One engine decode step (batch build, forward, greedy sampling) at `context` tokens each;
    with `graphs`, replayed from a CUDA graph (`DecodeGraphs`; on the CPU, its buffers and
    padding without a graph). The caches' random K/V are drawn from a fixed seed, so an eager
    and a graphed step sample the same tokens (`step.tokens_seen`, every step's)."""
    block_size = 16
    steps = repeats + 2
    blocks_per_seq = -(-(context + steps) // block_size)
    manager = BlockManager(batch_size * blocks_per_seq, block_size)
    cache = KVCache(model.config, manager.num_blocks, block_size, model.dtype, model.device)
    generator = torch.Generator(device=model.device).manual_seed(batch_size)
    for tensor in cache.key_caches + cache.value_caches:
        tensor.normal_(generator=generator)
    tables = [manager.allocate(blocks_per_seq) for _ in range(batch_size)]
    sampler = Sampler()
    params = SamplingParams(temperature=0.0)
    rows = [SamplingRow(params, None, [], []) for _ in range(batch_size)]
    state = {"position": context, "tokens": [7] * batch_size}
    run = model.step
    if graphs:
        capture = cuda_capture if model.device.type == "cuda" else eager_capture
        replayer = DecodeGraphs(model, cache, batch_size, blocks_per_seq * block_size, capture)
        run = lambda batch, _cache: replayer.run(batch)  # noqa: E731

    def step() -> None:
        position = state["position"]
        chunks = [
            SequenceChunk([t], position, table)
            for t, table in zip(state["tokens"], tables, strict=True)
        ]
        batch = build_step_batch(chunks, block_size, model.device)
        logits = run(batch, cache)
        state["tokens"] = sampler(logits, rows).token_ids
        state["position"] = position + 1
        step.tokens_seen.append(list(state["tokens"]))

    step.tokens_seen = []
    return step


def hf_decode(hf_model, batch_size: int, context: int):
    from transformers import DynamicCache

    c = hf_model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    cache = DynamicCache()
    for layer in range(c.num_hidden_layers):
        shape = (batch_size, c.num_key_value_heads, context, head_dim)
        placement = {"dtype": hf_model.dtype, "device": hf_model.device}
        cache.update(torch.randn(shape, **placement), torch.randn(shape, **placement), layer)
    state = {"tokens": torch.full((batch_size, 1), 7, device=hf_model.device)}

    def step() -> None:
        out = hf_model(state["tokens"], past_key_values=cache, use_cache=True)
        state["tokens"] = out.logits[:, -1].argmax(-1, keepdim=True)

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--device", default="cpu", type=device_argument, help=DEVICE_HELP)
    parser.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES)
    parser.add_argument(
        "--linear-backend",
        default="auto",
        choices=LINEAR_BACKENDS,
        help="our engine's matmuls: oneDNN-packed weights where the CPU can (auto), or F.linear",
    )
    parser.add_argument(
        "--decode-attention",
        default="auto",
        choices=DECODE_ATTENTION_CHOICES,
        help=DECODE_ATTENTION_HELP,
    )
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", help="also write the results to this file")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also time our decode step replayed from CUDA graphs (on the CPU: their buffers "
        "and padding, no graph), and check it samples the eager step's tokens",
    )
    parser.add_argument(
        "--profile-batch",
        type=int,
        help="also profile 5 decode steps of each engine at this batch size (top operators)",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from transformers import AutoModelForCausalLM

    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    loaded = load_model(
        args.model,
        dtype=dtype,
        device=device,
        linear_backend=args.linear_backend,
        decode_attention=args.decode_attention,
    )
    hf_model = AutoModelForCausalLM.from_pretrained(loaded.path, dtype=dtype).eval().to(device)
    results: dict = {
        "threads": args.threads,
        "device": _device_name(device),
        "dtype": args.dtype,
        "linear_backend": args.linear_backend,
        "context": args.context,
        "decode": [],
    }
    print(f"{results['device']}, {args.dtype}")
    with torch.inference_mode():
        ours_s, hf_s = paired_medians(
            [ours_prefill(loaded.model, args.prompt_len), hf_prefill(hf_model, args.prompt_len)],
            max(3, args.repeats // 2),
            device,
        )
        results["prefill"] = {
            "prompt_len": args.prompt_len,
            "ours_tokens_per_s": args.prompt_len / ours_s,
            "hf_tokens_per_s": args.prompt_len / hf_s,
        }
        print(
            f"prefill {args.prompt_len} tokens: ours {args.prompt_len / ours_s:7.1f} tok/s   "
            f"transformers {args.prompt_len / hf_s:7.1f} tok/s"
        )
        graphs_header = f" {'graphs ms':>10} {'eager/graphs':>13} {'same tokens':>12}"
        print(
            f"{'batch':>5} {'ours ms':>9} {'hf ms':>9} {'hf/ours':>8} {'ours tok/s':>11}"
            + (graphs_header if args.cuda_graphs else "")
        )
        for batch_size in [int(b) for b in args.batch_sizes.split(",")]:
            eager = ours_decode(loaded.model, batch_size, args.context, args.repeats)
            fns = [eager, hf_decode(hf_model, batch_size, args.context)]
            if args.cuda_graphs:
                graphed = ours_decode(
                    loaded.model, batch_size, args.context, args.repeats, graphs=True
                )
                fns.append(graphed)
            ours, hf, *graphs_s = paired_medians(fns, args.repeats, device)
            row = {
                "batch_size": batch_size,
                "ours_ms": ours * 1e3,
                "hf_ms": hf * 1e3,
                "ours_tokens_per_s": batch_size / ours,
                "hf_tokens_per_s": batch_size / hf,
            }
            line = (
                f"{batch_size:>5} {ours * 1e3:9.1f} {hf * 1e3:9.1f} {hf / ours:8.2f} "
                f"{batch_size / ours:11.1f}"
            )
            if graphs_s:
                same = graphed.tokens_seen == eager.tokens_seen
                row.update(graphs_ms=graphs_s[0] * 1e3, graphs_same_tokens=same)
                line += f" {graphs_s[0] * 1e3:10.2f} {ours / graphs_s[0]:13.2f} {str(same):>12}"
            results["decode"].append(row)
            print(line)
        if args.profile_batch:
            steps = [
                ("ours", ours_decode(loaded.model, args.profile_batch, args.context, 10)),
                ("transformers", hf_decode(hf_model, args.profile_batch, args.context)),
            ]
            for name, step in steps:
                print(f"\n{name}, 5 decode steps at batch {args.profile_batch}:")
                print(profile_steps(step, 5))
    by_batch = {r["batch_size"]: r for r in results["decode"]}
    if 1 in by_batch and 32 in by_batch:
        ratio = by_batch[32]["ours_tokens_per_s"] / by_batch[1]["ours_tokens_per_s"]
        results["batch32_over_batch1_throughput"] = ratio
        print(f"batch-32 decode throughput / batch-1: {ratio:.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


def profile_steps(step, num_steps: int, top: int = 12) -> str:
    """The top operators by self CPU time over `num_steps` calls of `step`, after a warm-up."""
    step()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(num_steps):
            step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)


def _device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({torch.get_num_threads()} threads)"


if __name__ == "__main__":
    main()
