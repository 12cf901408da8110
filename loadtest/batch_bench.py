"""The bulk scenario: N short prompts as one batch job, with a trickle of interactive chats beside.

    python -m loadtest.batch_bench [--num-prompts 10000] [--max-tokens 16] [--url URL]

Against a running cluster (`--url`) or one started here (`tandem up`, on a free port). In one
run, on the same prompts:

1. `alone`: the interactive trickle on an idle cluster: its TTFT p50/p99.
2. `batch`: the prompts as one batch (Files + Batches API) while the trickle runs: drain time,
   output tokens/s, the trickle's TTFT p50/p99, and lines lost or duplicated in the output.
3. `naive`: the same prompts fired at once at /v1/completions, as a new user would: how many
   were refused (429) and, with a second pass that retries each refusal after its Retry-After,
   the drain time and output tokens/s (the burst throughput the batch is compared with).

Prints one JSON object per phase and a summary table. Timing figures on a shared machine are
noisy: compare phases of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import io
import json
import sys
import time
from typing import Any

import httpx

from loadtest.served import tandem_up

TRICKLE_PROMPTS = ["Hi! How are you?", "Name a colour.", "What is 2 + 2?", "Say hello."]


def prompts(num: int) -> list[str]:
    """Short distinct prompts of a few dozen tokens."""
    topics = ["rivers", "stars", "bread", "music", "trains", "forests", "numbers", "cities"]
    return [
        f"Write one short sentence about {topics[i % len(topics)]}, "
        f"the way a teacher would explain it to pupil number {i}."
        for i in range(num)
    ]


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def ttft(http: httpx.AsyncClient, model: str, prompt: str) -> float:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 8, "temperature": 0, "stream": True}  # fmt: skip
    started = time.monotonic()
    first = None
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():  # read to the end: the request completes
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.monotonic() - started
    if first is None:
        raise RuntimeError("the stream ended without content")
    return first


async def trickle(http: httpx.AsyncClient, model: str, stop: asyncio.Event, every_s: float):
    """One interactive chat every `every_s` until `stop`; their TTFTs."""
    ttfts: list[float] = []
    tasks = []
    i = 0
    while not stop.is_set():
        prompt = TRICKLE_PROMPTS[i % len(TRICKLE_PROMPTS)]
        tasks.append(asyncio.create_task(ttft(http, model, prompt)))
        i += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)
    for result in await asyncio.gather(*tasks, return_exceptions=True):
        if isinstance(result, float):
            ttfts.append(result)
        else:
            print(f"interactive request failed: {result!r}", file=sys.stderr)
    return ttfts


def summary(ttfts: list[float]) -> dict[str, Any]:
    p50, p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    return {"num_interactive": len(ttfts), "ttft_p50_s": p50 and round(p50, 3),
            "ttft_p99_s": p99 and round(p99, 3)}  # fmt: skip


async def phase_alone(http: httpx.AsyncClient, model: str, args) -> dict[str, Any]:
    stop = asyncio.Event()
    task = asyncio.create_task(trickle(http, model, stop, args.trickle_every_s))
    await asyncio.sleep(args.alone_s)
    stop.set()
    return {"phase": "alone", **summary(await task)}


async def phase_batch(http: httpx.AsyncClient, model: str, args) -> dict[str, Any]:
    lines = [
        json.dumps(
            {
                "custom_id": f"p{i}",
                "method": "POST",
                "url": "/v1/completions",
                "body": {
                    "model": model,
                    "prompt": p,
                    "max_tokens": args.max_tokens,
                    "temperature": 0,
                    "ignore_eos": True,
                },
            }
        )  # fmt: skip
        for i, p in enumerate(prompts(args.num_prompts))
    ]
    data = ("\n".join(lines) + "\n").encode()
    files = {"file": ("bench.jsonl", io.BytesIO(data))}
    uploaded = (await http.post("/v1/files", files=files, data={"purpose": "batch"})).json()
    started = time.monotonic()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/completions",
            "completion_window": "24h"}  # fmt: skip
    batch = (await http.post("/v1/batches", json=body)).json()
    stop = asyncio.Event()
    task = asyncio.create_task(trickle(http, model, stop, args.trickle_every_s))
    while batch["status"] not in ("completed", "failed", "cancelled", "expired"):
        await asyncio.sleep(0.5)
        batch = (await http.get(f"/v1/batches/{batch['id']}")).json()
    drain_s = time.monotonic() - started
    stop.set()
    ttfts = await task
    output = (await http.get(f"/v1/files/{batch['output_file_id']}/content")).text.splitlines()
    custom_ids = [json.loads(x)["custom_id"] for x in output]
    expected = {f"p{i}" for i in range(args.num_prompts)}
    output_tokens = batch["usage"]["output_tokens"]
    return {
        "phase": "batch", "status": batch["status"], "drain_s": round(drain_s, 1),
        "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / drain_s, 1),
        "lines_lost": len(expected - set(custom_ids)),
        "lines_duplicated": len(custom_ids) - len(set(custom_ids)),
        **summary(ttfts),
    }  # fmt: skip


async def phase_naive(http: httpx.AsyncClient, model: str, args, retry: bool) -> dict[str, Any]:
    refused = 0
    output_tokens = 0
    failed = 0

    async def one(prompt: str) -> None:
        nonlocal refused, output_tokens, failed
        body = {"model": model, "prompt": prompt, "max_tokens": args.max_tokens,
                "temperature": 0, "ignore_eos": True}  # fmt: skip
        while True:
            try:
                response = await http.post("/v1/completions", json=body)
            except httpx.HTTPError:
                failed += 1
                return
            if response.status_code == 429:
                refused += 1
                if not retry:
                    return
                await asyncio.sleep(float(response.headers.get("retry-after", "1")))
                continue
            if response.status_code != 200:
                failed += 1
                return
            output_tokens += response.json()["usage"]["completion_tokens"]
            return

    started = time.monotonic()
    await asyncio.gather(*(one(p) for p in prompts(args.num_prompts)))
    elapsed = time.monotonic() - started
    return {
        "phase": "naive+retry" if retry else "naive", "drain_s": round(elapsed, 1),
        "refused_429": refused, "failed": failed, "output_tokens": output_tokens,
        "output_tokens_per_s": round(output_tokens / elapsed, 1),
    }  # fmt: skip


async def run_phases(url: str, args) -> list[dict[str, Any]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=100)
    async with httpx.AsyncClient(base_url=url, timeout=3600, limits=limits) as http:
        model = (await http.get("/v1/models")).json()["data"][0]["id"]
        phases = [phase_alone, phase_batch]
        if not args.skip_naive:
            phases += [
                functools.partial(phase_naive, retry=False),
                functools.partial(phase_naive, retry=True),
            ]
        results = []
        for phase in phases:  # one after another: each phase has the cluster to itself
            results.append(await phase(http, model, args))
            print(json.dumps(results[-1]), flush=True)
        return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default=None, help="a running cluster (default: start one)")
    parser.add_argument("--num-prompts", type=int, default=10_000)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--trickle-every-s", type=float, default=2.0)
    parser.add_argument("--alone-s", type=float, default=20.0)
    parser.add_argument("--skip-naive", action="store_true")
    args = parser.parse_args(argv)
    if args.num_prompts < 1 or args.max_tokens < 1 or args.trickle_every_s <= 0:
        parser.error("--num-prompts, --max-tokens and --trickle-every-s must be positive")
    if args.url is not None:
        asyncio.run(run_phases(args.url, args))
        return 0
    with tandem_up() as cluster:
        asyncio.run(run_phases(cluster.url, args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
