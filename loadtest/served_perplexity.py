"""Perplexity of a served model, measured through its HTTP API: what a cluster serves (its
precision, its workers, its batching) judged by the number the engine gives in-process.

The text (`loadtest/corpus.txt` by default) is tokenized by the server (`/tokenize`) and cut
into the windows `loadtest.perplexity` scores; each window goes out as a completion that only
echoes its prompt (`echo: true, logprobs: 0, max_tokens: 0`, token ids as the prompt), whose
answer holds every token's logprob but the first's: the negative log-likelihood summed over the
windows gives the perplexity. `--concurrency` windows are in flight at once, so the cluster
batches them as it would any traffic. Works against any server with vLLM's `/tokenize` and
OpenAI's `echo`.

    .venv/bin/python -m loadtest.served_perplexity --url http://127.0.0.1:8000 [--model smollm2]
        [--window 256] [--max-windows 16] [--concurrency 4] [--json OUT]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import time
from pathlib import Path

import httpx

from loadtest.perplexity import CORPUS, windows


async def window_nll(client: httpx.AsyncClient, model: str, piece: list[int]) -> float:
    """The negative log-likelihood of a window's tokens after its first, as the server scores
    them."""
    body = {"model": model, "prompt": piece, "echo": True, "logprobs": 0, "max_tokens": 0}
    response = await client.post("/v1/completions", json=body)
    response.raise_for_status()
    logprobs = response.json()["choices"][0]["logprobs"]["token_logprobs"]
    if len(logprobs) != len(piece) or None in logprobs[1:]:
        raise ValueError(f"the server scored {len(logprobs)} tokens of a {len(piece)}-token window")
    return -sum(logprobs[1:])


async def served_perplexity(
    url: str, model: str, text: str, window: int, max_windows: int, concurrency: int
) -> dict:
    limit = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        tokenized = await client.post("/tokenize", json={"model": model, "prompt": text})
        tokenized.raise_for_status()
        token_ids = tokenized.json()["tokens"]
        if max_windows:
            token_ids = token_ids[: max_windows * window]
        pieces = windows(token_ids, window)

        async def scored(piece: list[int]) -> float:
            async with limit:
                return await window_nll(client, model, piece)

        started = time.perf_counter()
        nlls = await asyncio.gather(*(scored(piece) for piece in pieces))
        seconds = time.perf_counter() - started
    num_scored = sum(len(piece) - 1 for piece in pieces)
    return {
        "perplexity": math.exp(sum(nlls) / num_scored),
        "tokens_scored": num_scored,
        "windows": len(pieces),
        "seconds": seconds,
        "scored_tokens_per_s": num_scored / seconds,
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--text", type=Path, default=CORPUS)
    parser.add_argument("--window", type=int, default=256, help="tokens per scored window")
    parser.add_argument("--max-windows", type=int, default=16, help="0: the whole text")
    parser.add_argument("--concurrency", type=int, default=4, help="windows in flight at once")
    parser.add_argument("--json", type=Path, help="also write the result here")
    args = parser.parse_args(argv)
    if args.window < 2 or args.max_windows < 0 or args.concurrency < 1:
        parser.error("--window must be >= 2, --max-windows >= 0, --concurrency >= 1")
    if not args.text.is_file():
        parser.error(f"--text: no such file {args.text}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = asyncio.run(
        served_perplexity(
            args.url,
            args.model,
            args.text.read_text(),
            args.window,
            args.max_windows,
            args.concurrency,
        )
    )
    for name, value in result.items():
        print(f"{name:>20}: {value:,.4f}" if isinstance(value, float) else f"{name:>20}: {value}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
