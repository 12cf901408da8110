"""Completions with a batch of prompts against the shared `tandem up` cluster: each prompt's
choices equal that prompt sent alone, at OpenAI's indices, streamed or whole."""

from __future__ import annotations

import json
import random
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPTS = ["The capital of France is", "Once upon a time"]


def complete(cluster, **body) -> httpx.Response:
    return httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


def test_each_prompts_choices_equal_it_sent_alone(cluster, openai_client):
    response = openai_client.completions.create(
        model=MODEL, prompt=PROMPTS, n=2, max_tokens=8, temperature=0, logprobs=1
    )
    alone = [
        openai_client.completions.create(
            model=MODEL, prompt=p, n=2, max_tokens=8, temperature=0, logprobs=1
        )
        for p in PROMPTS
    ]
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    expected = [c for single in alone for c in single.choices]
    assert [c.text for c in response.choices] == [c.text for c in expected]
    assert [c.logprobs.tokens for c in response.choices] == [c.logprobs.tokens for c in expected]
    for name in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(response.usage, name) == sum(getattr(s.usage, name) for s in alone)


def test_a_batch_of_token_lists_scores_each_prompt(cluster, smollm2):
    """As lm-evaluation-harness sends its loglikelihood requests: token ids, echo, no output."""
    batch = [smollm2.tokenizer(p).input_ids for p in PROMPTS]
    body = {"echo": True, "logprobs": 0, "max_tokens": 0}
    together = complete(cluster, prompt=batch, **body).json()
    for prompt, choice in zip(batch, together["choices"], strict=True):
        alone = complete(cluster, prompt=prompt, **body).json()["choices"][0]
        assert choice["logprobs"]["tokens"] == alone["logprobs"]["tokens"]
        assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(
            alone["logprobs"]["token_logprobs"][1:], abs=1e-4
        )
        assert len(choice["logprobs"]["tokens"]) == len(prompt)
    assert together["usage"]["prompt_tokens"] == sum(len(p) for p in batch)


def test_a_streamed_batch_equals_the_whole_answer(cluster):
    body = {"prompt": PROMPTS, "n": 2, "max_tokens": 6, "temperature": 0}
    whole = complete(cluster, **body).json()
    texts, usages, ids = ["", "", "", ""], [], set()
    with httpx.stream(
        "POST",
        cluster.url + "/v1/completions",
        json={"model": MODEL, **body, "stream": True, "stream_options": {"include_usage": True}},
        timeout=120,
    ) as response:
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            ids.add(chunk["id"])
            for choice in chunk["choices"]:
                texts[choice["index"]] += choice["text"]
            if chunk.get("usage"):
                usages.append(chunk["usage"])
    assert texts == [c["text"] for c in whole["choices"]] and len(ids) == 1
    assert usages == [whole["usage"]]


def test_a_streamed_batchs_prompts_wait_side_by_side(cluster):
    """A streamed batch starts when every prompt has its first token (so that a refusal still
    answers with a status), and its prompts are all submitted at once, not each after the
    previous one's first token."""
    rng = random.Random(5)
    prompts = [[rng.randrange(1_000, 40_000) for _ in range(300)] for _ in range(4)]
    body = {"prompt": prompts, "max_tokens": 4, "ignore_eos": True, "stream": True}

    def streamed_indices() -> list[int]:
        with httpx.stream(
            "POST", cluster.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120
        ) as response:
            lines = [line for line in response.iter_lines() if line.startswith("data: {")]
        return sorted({json.loads(line[6:])["choices"][0]["index"] for line in lines})

    cluster.wait_blocks_free()
    in_flight = []
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(streamed_indices)
        while not answer.done():
            in_flight.append(cluster.ready_info()["in_flight"])
            time.sleep(0.05)
    assert answer.result() == [0, 1, 2, 3]
    assert max(in_flight) == len(prompts)


@pytest.mark.parametrize(
    "prompt",
    [["fine", "many words " * 5000], ["fine", ""], ["fine", [1, -2]], ["x"] * 65],
    ids=["no-room", "empty", "negative-id", "too-many"],
)
def test_one_bad_prompt_refuses_the_batch_before_anything_runs(cluster, prompt):
    cluster.wait_blocks_free()  # (what earlier tests left running has ended)
    response = complete(cluster, prompt=prompt, max_tokens=4)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "prompt"
    assert httpx.get(cluster.url + "/ready", timeout=10).json()["in_flight"] == 0


def test_leaving_a_streamed_batch_cancels_every_prompt(cluster):
    body = {"prompt": PROMPTS, "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.stream(
        "POST", cluster.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60
    ) as response:
        seen = set()
        for line in response.iter_lines():
            if line.startswith("data: {"):
                seen.add(json.loads(line[6:])["choices"][0]["index"])
            if len(seen) == 2:
                break  # leaving the block closes the connection mid-stream
    info = cluster.wait_blocks_free()
    assert info["in_flight"] == 0
    assert info["decode_free_blocks"] == info["decode_total_blocks"]
