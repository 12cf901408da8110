"""Bounded admission end to end: past the queue bound the gateway answers 429 with Retry-After
before any work is done, and the requests admitted before it still complete."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.e2e.conftest import start_cluster, stop_cluster

pytestmark = pytest.mark.slow
MAX_TOKENS = 16


@pytest.fixture(scope="module")
def small_queue_cluster(tmp_path_factory):
    cluster = start_cluster(
        tmp_path_factory.mktemp("admission"),
        "--kv-cache-bytes",
        str(64 << 20),
        # Two queued requests at most; a prefill worker takes one 40-token prompt at a time.
        env={"TANDEM_MAX_QUEUED_REQUESTS": "2", "TANDEM_PREFILL_WINDOW_TOKENS": "64"},
    )
    yield cluster
    stop_cluster(cluster)


def body(i: int) -> dict:
    return {"model": "smollm2", "prompt": [100 + i] * 40, "max_tokens": MAX_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip


async def flood(url: str, count: int) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        tasks = []
        for i in range(count):  # in order, so the first ones are admitted first
            tasks.append(asyncio.create_task(client.post("/v1/completions", json=body(i))))
            await asyncio.sleep(0.05)
        return await asyncio.gather(*tasks)


def test_a_full_queue_answers_429_and_the_admitted_still_complete(small_queue_cluster):
    responses = asyncio.run(flood(small_queue_cluster.url, 8))
    refused = [r for r in responses if r.status_code == 429]
    served = [r for r in responses if r.status_code == 200]
    assert refused and served and len(refused) + len(served) == len(responses)
    for response in refused:
        assert float(response.headers["retry-after"]) > 0
        error = response.json()["error"]
        assert error["code"] is not None or error["type"], error
    for response in served:
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS
    info = small_queue_cluster.wait_blocks_free()
    assert info["queued"] == 0 and info["in_flight"] == 0
