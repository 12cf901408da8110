"""`tandem profile`: measures a worker profile for the capacity planner on the machine at hand.

It times the engine the way `loadtest/engine_bench.py` does (its prefill and decode step
builders, medians of runs in alternation after a warm-up) over a grid of sizes, and a KV
handoff's cost over a real ZeroMQ socket pair, and writes the curves the simulator reads
(`services/planner/profile.py`):

* prefill: one step's time by prompt tokens (`--prefill-tokens`), and what context before a
  chunk adds: the grid's middle prompt size timed after each of `--prefill-contexts` tokens
  already in the KV cache, beside the same size alone, fitted to a cost per (token computed,
  token of context) pair (least squares through the origin);
* decode: one step's time by batch size (`--batch-sizes`) and context per sequence
  (`--contexts`);
* transfer: messages of KV-sized byte frames sent without copying over an ipc socket pair, fitted
  to a latency plus bytes over a bandwidth (least squares);
* the model's KV bytes per token (2 x layers x KV heads x head dim x the dtype's size).

Timings on a shared machine are slower than on a quiet one: `--note` records the conditions in
the file's metadata, beside the machine, the threads and the date.

    tandem profile --out loadtest/profiles/cpu-2threads.json --threads 2 --note "shared machine"
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import zmq

from loadtest.engine_bench import median_seconds, ours_decode, ours_prefill, paired_medians
from services.planner.profile import ProfileError, WorkerProfile, WorkerSettings
from shared.engine.loader import (
    DEVICE_HELP,
    DTYPE_CHOICES,
    device_argument,
    load_model,
    parse_device,
    parse_dtype,
)

TRANSFER_SIZES = (1 << 16, 1 << 20, 1 << 23, 1 << 25)  # bytes of one KV handoff's frame


class ProfileArgumentError(ValueError):
    pass


def _sizes(name: str, text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ProfileArgumentError(f"{name} takes integers like 1,8,32; got {text!r}") from None
    if not values or any(v < 1 for v in values) or values != sorted(set(values)):
        raise ProfileArgumentError(f"{name} must be increasing positive integers; got {text!r}")
    return values


def _check_out(text: str) -> None:
    """Refuses, before minutes of measuring, an `--out` the profile could not be written to: a
    folder, or a path under a file."""
    out = Path(text)
    if out.is_dir():
        raise ProfileArgumentError(f"--out {text} is a folder; it names the profile JSON file")
    existing = next(folder for folder in out.parents if folder.exists())
    if not existing.is_dir():
        raise ProfileArgumentError(f"--out {text} is under {existing}, which is a file")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="a HF directory, a .gguf, or smollm2")
    parser.add_argument("--threads", type=int, default=2, help="CPU threads")
    parser.add_argument("--device", default="cpu", type=device_argument, help=DEVICE_HELP)
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=DTYPE_CHOICES,
        help="the workers' dtype: auto (the default) resolves as theirs does on this device",
    )
    parser.add_argument("--prefill-tokens", default="16,64,128,256,512")
    parser.add_argument(
        "--prefill-contexts",
        default="512,1024",
        help="tokens of context (a cached prefix, earlier chunks) a prefill chunk is timed after",
    )
    parser.add_argument("--batch-sizes", default="1,8,32,64")
    parser.add_argument("--contexts", default="128,1024", help="tokens of context per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per point (median)")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20)
    parser.add_argument("--note", default="", help="conditions of the run, kept in the metadata")
    parser.add_argument("--out", required=True, help="the profile JSON file to write")


def run(args: argparse.Namespace) -> int:
    try:
        _check_out(args.out)
        grid = {
            "prefill_tokens": _sizes("--prefill-tokens", args.prefill_tokens),
            "prefill_contexts": _sizes("--prefill-contexts", args.prefill_contexts),
            "batch_sizes": _sizes("--batch-sizes", args.batch_sizes),
            "contexts": _sizes("--contexts", args.contexts),
        }
        for name in ("threads", "repeats"):
            if getattr(args, name) < 1:
                raise ProfileArgumentError(f"--{name.replace('_', '-')} must be >= 1")
        # Checked as `tandem plan` will read them (a budget under 16 made a profile it refused).
        settings = WorkerSettings(
            block_size=args.block_size,
            max_num_batched_tokens=args.max_num_batched_tokens,
            kv_cache_bytes=args.kv_cache_bytes,
        )
    except (ProfileArgumentError, ProfileError) as error:
        print(f"tandem profile: {error}", file=sys.stderr)
        return 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = parse_device(args.device)
    dtype = parse_dtype(args.dtype, device)
    model = load_model(args.model, dtype=dtype, device=device).model
    metadata = {
        "model": args.model,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "machine": f"{platform.node()} {platform.machine()} {platform.processor()}".strip(),
        "threads": args.threads,
        "dtype": str(dtype).removeprefix("torch."),  # auto resolved
        "measured_at": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "note": args.note,
        "load_average_1m_before": os.getloadavg()[0],  # a busy machine measures slow steps
    }
    try:
        profile = measure_profile(model, grid, args.repeats, settings, metadata, device)
    except ProfileArgumentError as error:
        print(f"tandem profile: {error}", file=sys.stderr)
        return 2
    profile.metadata["load_average_1m_after"] = os.getloadavg()[0]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    profile.save(args.out)
    print(describe(profile))
    if profile.prefill_s_per_context_pair == 0:
        print(NO_CONTEXT_COST, file=sys.stderr)
    print(f"wrote {args.out}")
    return 0


def measure_profile(
    model,
    grid: dict[str, list[int]],
    repeats: int,
    settings: WorkerSettings,
    metadata: dict,
    device: torch.device | str = "cpu",
) -> WorkerProfile:
    """Times `model` (our engine's LlamaModel) over the grid; see the module doc. On `device`
    cuda each timed run ends with a synchronize (a step only queues its kernels there)."""
    check_positions(grid, repeats, model.max_positions)
    with torch.inference_mode():
        prefill = [
            median_seconds(ours_prefill(model, n), repeats, device) for n in grid["prefill_tokens"]
        ]
        context_cost = measure_context_cost(model, grid, repeats, device)
        decode = [
            [
                median_seconds(ours_decode(model, batch, context, repeats), repeats, device)
                for context in grid["contexts"]
            ]
            for batch in grid["batch_sizes"]
        ]
    latency_s, bytes_per_s = measure_transfer(repeats)
    return WorkerProfile(
        prefill_tokens=grid["prefill_tokens"],
        prefill_seconds=prefill,
        decode_batch_sizes=grid["batch_sizes"],
        decode_contexts=grid["contexts"],
        decode_seconds=decode,
        kv_bytes_per_token=kv_bytes_per_token(model),
        transfer_latency_s=latency_s,
        transfer_bytes_per_s=bytes_per_s,
        prefill_s_per_context_pair=context_cost,
        settings=settings,
        metadata=metadata,
    )


def check_positions(grid: dict[str, list[int]], repeats: int, max_positions: int) -> None:
    """Refuses, before any timing, a prompt or a decode context (and the steps timed after
    it, each a position further) past the model's positions: they failed when reached."""
    largest_prompt = grid["prefill_tokens"][-1]
    if largest_prompt > max_positions:
        raise ProfileArgumentError(
            f"--prefill-tokens {largest_prompt} is past the model's {max_positions} positions"
        )
    decode_steps = repeats + 2  # `ours_decode`'s: a warm-up, the timed ones, one more
    largest_context = grid["contexts"][-1]
    if largest_context + decode_steps > max_positions:
        raise ProfileArgumentError(
            f"--contexts {largest_context} (and {decode_steps} steps after it) is past the "
            f"model's {max_positions} positions"
        )


def measure_context_cost(
    model, grid: dict[str, list[int]], repeats: int, device: torch.device | str = "cpu"
) -> float:
    """Seconds per (token computed, token of context before it): the grid's middle prompt size
    timed after each context the model's positions hold, in alternation with it alone (0: no
    context fits)."""
    sizes = grid["prefill_tokens"]
    num_tokens = sizes[len(sizes) // 2]
    contexts = [c for c in grid["prefill_contexts"] if c + num_tokens <= model.max_positions]
    if not contexts:
        return 0.0
    steps = [ours_prefill(model, num_tokens)] + [
        ours_prefill(model, num_tokens, context) for context in contexts
    ]
    alone, *after = paired_medians(steps, repeats, device)
    return context_cost([num_tokens * c for c in contexts], [t - alone for t in after])


NO_CONTEXT_COST = (
    "tandem profile: warning: the prefill context cost came out 0 (the machine timed prompts "
    "after a context no slower than alone: busy, or no context fits the model's positions); "
    "plans will time chunks after context as if alone: measure again on a quieter machine"
)


def context_cost(pairs: list[int], extra_seconds: list[float]) -> float:
    """The least-squares slope through the origin of extra seconds by pairs, never below 0 (a
    noisy machine can time a longer step shorter)."""
    covariance = sum(p * s for p, s in zip(pairs, extra_seconds, strict=True))
    return max(covariance / sum(p * p for p in pairs), 0.0)


def kv_bytes_per_token(model) -> int:
    c = model.config
    element_size = torch.empty((), dtype=model.dtype).element_size()
    return 2 * c.num_layers * c.num_kv_heads * c.head_dim * element_size


def measure_transfer(repeats: int, sizes: tuple[int, ...] = TRANSFER_SIZES) -> tuple[float, float]:
    """(latency s, bytes/s) of a KV-sized frame over an ipc socket pair, sent without copying
    and acknowledged, as a KV handoff is; a least-squares line through the medians."""
    context = zmq.Context()
    with tempfile.TemporaryDirectory() as folder:
        address = f"ipc://{folder}/kv.sock"
        sender, receiver = context.socket(zmq.PAIR), context.socket(zmq.PAIR)
        try:
            receiver.bind(address)
            sender.connect(address)
            medians = [_round_trips(sender, receiver, size, repeats) for size in sizes]
        finally:
            sender.close(linger=0)
            receiver.close(linger=0)
            context.term()
    slope, intercept = _fit_line([float(s) for s in sizes], medians)
    return max(intercept, 0.0), 1.0 / max(slope, 1e-15)


def _round_trips(sender: zmq.Socket, receiver: zmq.Socket, size: int, repeats: int) -> float:
    payload = bytearray(size)
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        sender.send_multipart([b"kv", payload], copy=False)
        receiver.recv_multipart(copy=False)
        receiver.send(b"ack")
        sender.recv()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def _fit_line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
    return slope, mean_y - slope * mean_x


def describe(profile: WorkerProfile) -> str:
    lines = [
        "prefill step: "
        + ", ".join(
            f"{n} tok {s * 1e3:.0f} ms"
            for n, s in zip(profile.prefill_tokens, profile.prefill_seconds, strict=True)
        )
        + f"; context: {profile.prefill_s_per_context_pair * 1e9:.0f} ns per (token, context "
        "token) pair"
    ]
    for batch, row in zip(profile.decode_batch_sizes, profile.decode_seconds, strict=True):
        cells = ", ".join(
            f"ctx {c} {s * 1e3:.0f} ms" for c, s in zip(profile.decode_contexts, row, strict=True)
        )
        lines.append(f"decode step, batch {batch}: {cells}")
    lines.append(
        f"KV transfer: {profile.transfer_latency_s * 1e3:.2f} ms + "
        f"{profile.transfer_bytes_per_s / 1e9:.2f} GB/s; "
        f"{profile.kv_bytes_per_token} KV bytes/token"
    )
    return "\n".join(lines)
