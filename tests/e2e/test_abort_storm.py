"""An abort storm on the shared cluster: a hundred streams whose clients vanish at random
moments (before the first byte, after a few tokens, mid-prefill). Afterwards nothing is left
anywhere: every KV block free, no sequence running or waiting on any worker, nothing in flight,
and the cluster serves the next request as before."""

from __future__ import annotations

import asyncio
import random

import httpx
import pytest

pytestmark = pytest.mark.slow
NUM_STREAMS = 100


async def abandoned_stream(client: httpx.AsyncClient, rng: random.Random, index: int) -> None:
    body = {"model": "smollm2", "prompt": [100 + index % 50] * rng.randint(4, 300),
            "max_tokens": 64, "ignore_eos": True, "stream": True}  # fmt: skip
    chunks_wanted = rng.choice([0, 0, 1, 2, 5])
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if chunks_wanted == 0:
            return  # gone as soon as the headers came
        seen = 0
        async for line in response.aiter_lines():
            seen += line.startswith("data: ")
            if seen >= chunks_wanted:
                return  # leaving the block closes the connection mid-stream


async def storm(url: str) -> None:
    rng = random.Random(7)
    limits = httpx.Limits(max_connections=NUM_STREAMS)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as client:
        tasks = [asyncio.create_task(abandoned_stream(client, rng, i)) for i in range(NUM_STREAMS)]
        await asyncio.sleep(1.0)
        for task in rng.sample(tasks, NUM_STREAMS // 4):  # a quarter before any answer at all
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def test_abort_storm_leaks_nothing(cluster):
    asyncio.run(storm(cluster.url))
    info = cluster.wait_blocks_free(timeout_s=60)
    assert info["in_flight"] == 0 and info["queued"] == 0
    assert info["decode_free_blocks"] == info["decode_total_blocks"]
    for worker in info["workers"]:
        assert (worker["running"], worker["waiting"], worker["swapped"]) == (0, 0, 0), worker
        assert worker["free_blocks"] == worker["total_blocks"], worker
    response = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "smollm2", "prompt": "After the storm", "max_tokens": 8, "ignore_eos": True},
        timeout=120,
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8
