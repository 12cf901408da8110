"""End to end through the `openai` package against a `tandem up` cluster on the real model."""

from __future__ import annotations

import asyncio
import gzip
import json
import math
import random
import subprocess
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
MODEL = "smollm2"


def engine_greedy(smollm2, prompt_ids: list[int], max_tokens: int) -> list[int]:
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return engine.generate([prompt_ids], params)[0].token_ids


@pytest.mark.parametrize(
    "prompt", ["The capital of France is", "def add(a, b):\n", "Once upon a time"]
)
def test_greedy_completion_equals_the_engine(openai_client, smollm2, prompt):
    response = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=24, temperature=0
    )
    expected_ids = engine_greedy(smollm2, smollm2.tokenizer(prompt).input_ids, 24)
    expected = smollm2.tokenizer.decode(expected_ids, skip_special_tokens=True)
    assert response.choices[0].text == expected
    assert response.usage.completion_tokens == len(expected_ids)
    assert response.usage.prompt_tokens == len(smollm2.tokenizer(prompt).input_ids)


def test_greedy_chat_equals_tandem_generate(openai_client, smollm2):
    question = "What is the capital of France?"
    response = openai_client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": question}], max_tokens=32, temperature=0
    )
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "services.commands.cli",
            "generate",
            "--chat",
            "--prompt",
            question,
            "--max-tokens",
            "32",
            "--temperature",
            "0",
            "--dtype",
            "float32",
            "--json",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    expected = json.loads(generated.stdout)
    assert response.choices[0].message.content == expected["text"]
    assert response.usage.completion_tokens == len(expected["token_ids"])
    assert response.choices[0].message.role == "assistant"


def test_concurrent_streams_of_mixed_lengths_complete_exactly(cluster):
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0, timeout=600)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa"]

    async def one(i: int) -> tuple[int, int, int]:
        prompt = " ".join(words[: 1 + i % 10]) * (1 + i % 7)
        max_tokens = 1 + (i * 7) % 24
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            max_tokens=max_tokens,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage, finish = None, None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].finish_reason:
                finish = chunk.choices[0].finish_reason
        assert finish == "length"
        return i, max_tokens, usage.completion_tokens

    async def run_all():
        return await asyncio.gather(*(one(i) for i in range(64)))

    results = asyncio.run(run_all())
    assert len(results) == 64
    for _, max_tokens, completion_tokens in results:
        assert completion_tokens == max_tokens
    info = cluster.wait_blocks_free()
    assert info["decode_free_blocks"] == info["decode_total_blocks"]


def test_requests_spread_over_both_decode_workers(cluster, openai_client):
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> str:
        return (
            openai_client.completions.create(
                model=MODEL, prompt=f"Count to {i}:", max_tokens=8, temperature=0
            )
            .choices[0]
            .finish_reason
        )

    with ThreadPoolExecutor(8) as pool:
        assert all(pool.map(one, range(8)))
    log = cluster.log()
    assert "[ decode-0]" in log and "[ decode-1]" in log
    kv_received = {
        name: sum(
            1
            for line in log.splitlines()
            if line.startswith(f"[{name:>9}]") and "kv received" in line
        )
        for name in ("decode-0", "decode-1")
    }
    assert all(count > 0 for count in kv_received.values()), kv_received


def test_stop_string_is_applied_and_not_returned(openai_client):
    free = (
        openai_client.completions.create(
            model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0
        )
        .choices[0]
        .text
    )
    stop = free.split()[1]  # a word from the middle of the greedy output
    response = openai_client.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=16, temperature=0, stop=[stop]
    )
    assert response.choices[0].text == free[: free.index(stop)]
    assert response.choices[0].finish_reason == "stop"


def test_non_ascii_prompt_and_output(openai_client):
    response = openai_client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "Écris une phrase en français avec des accents: é, è, à. 日本",
            }
        ],
        max_tokens=24,
        temperature=0,
    )
    text = response.choices[0].message.content
    assert text and "\ufffd" not in text


def test_an_output_cut_mid_character_ends_before_it(openai_client):
    """`max_tokens` ending the output inside a character (here a CJK one, split over byte
    tokens) left a final "�" that no token's text held; now the text stops before it, and the
    tokens' texts add up to the text."""

    def complete(max_tokens: int):
        return openai_client.completions.create(
            model=MODEL, prompt="日本の首都は", max_tokens=max_tokens, temperature=0, logprobs=1
        ).choices[0]

    whole = complete(24)
    # Greedy: a shorter answer is a prefix of the longer one. A token whose text is "" begins
    # a character a later token completes: cut right after it.
    cut = next(i + 1 for i, token in enumerate(whole.logprobs.tokens[:-1]) if token == "")
    choice = complete(cut)
    assert choice.finish_reason == "length" and "\ufffd" not in choice.text
    assert "".join(choice.logprobs.tokens) == choice.text
    assert whole.text.startswith(choice.text)


def test_each_position_keeps_n_alternatives_and_its_own_logprob_inside_characters(openai_client):
    """Tokens holding part of a CJK character read "" (they complete none yet): several met
    under one key of `top_logprobs`, so a position had fewer than n alternatives and
    `top_logprobs[i][tokens[i]]` could be another token's logprob. Those sharing a text are
    now keyed by their bytes (OpenAI's `bytes:\\x..`)."""
    choice = openai_client.completions.create(
        model=MODEL, prompt="中文翻译：你好世界，今天", max_tokens=12, temperature=0, logprobs=5
    ).choices[0]
    logprobs = choice.logprobs
    assert "" in logprobs.tokens  # the case in question: a token inside a character
    for token, logprob, top in zip(
        logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs, strict=True
    ):
        assert len(top) >= 5 and top[token] == logprob
        assert logprob == max(top.values())  # greedy


def test_n_equals_two(openai_client):
    response = openai_client.completions.create(
        model=MODEL,
        prompt="Hello",
        max_tokens=5,
        temperature=0.8,
        seed=3,
        n=2,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in response.choices) == [0, 1]
    assert response.usage.completion_tokens == 10


def test_logprobs_present_and_finite(openai_client):
    response = openai_client.completions.create(
        model=MODEL, prompt="One, two, three,", max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = response.choices[0].logprobs
    assert len(logprobs.token_logprobs) == response.usage.completion_tokens
    assert all(math.isfinite(lp) and lp <= 0 for lp in logprobs.token_logprobs)
    assert all(1 <= len(top) <= 2 for top in logprobs.top_logprobs)
    chat = openai_client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=3,
        temperature=0,
        logprobs=True,
        top_logprobs=1,
    )
    content = chat.choices[0].logprobs.content
    assert content and all(math.isfinite(t.logprob) for t in content)


@pytest.mark.parametrize(
    "body,status,param",
    [
        ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -3}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 9000}, 400, "max_tokens"),
        ({"model": MODEL, "prompt": ""}, 400, "prompt"),
        ({"model": "gpt-5", "prompt": "x"}, 404, "model"),
        ({"model": MODEL, "prompt": "x", "bogus": 1}, 400, "bogus"),
        # Each of these reached a worker and ended it in the middle of a step, batch and all.
        (
            {"model": MODEL, "prompt": "x", "stop_token_ids": [10**9], "min_tokens": 1},
            400,
            "stop_token_ids",
        ),
        ({"model": MODEL, "prompt": "x", "top_k": 2**63}, 400, "top_k"),
        ({"model": MODEL, "prompt": "x", "logit_bias": {"1000000000": 1}}, 400, "logit_bias"),
    ],
)
def test_errors_have_openai_shape(cluster, body, status, param):
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=30)
    assert response.status_code == status
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["message"]


def test_body_that_is_not_json(cluster):
    response = httpx.post(
        cluster.url + "/v1/completions",
        content=b"{nope",
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert response.status_code == 400 and "JSON" in response.json()["error"]["message"]


def test_a_compressed_body_is_served_as_the_plain_one(cluster):
    """A gzip or deflate body was read as JSON bytes: a 400 saying the JSON was wrong. Now it
    is decoded (the same greedy answer as the plain body's); an encoding nobody decodes is a
    415 naming it, a corrupt stream a 400 naming the encoding."""
    body = json.dumps(
        {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}
    )

    def post(content: bytes, encoding: str | None) -> httpx.Response:
        headers = {"content-type": "application/json"}
        if encoding is not None:
            headers["content-encoding"] = encoding
        return httpx.post(cluster.url + "/v1/completions", content=content, headers=headers,
                          timeout=60)  # fmt: skip

    plain = post(body.encode(), None)
    assert plain.status_code == 200, plain.text
    text = plain.json()["choices"][0]["text"]
    for content, encoding in ((gzip.compress(body.encode()), "gzip"),
                              (zlib.compress(body.encode()), "deflate")):  # fmt: skip
        answer = post(content, encoding)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["text"] == text
    refused = post(body.encode(), "br")
    assert refused.status_code == 415 and "'br'" in refused.json()["error"]["message"]
    corrupt = post(gzip.compress(body.encode())[:-12], "gzip")
    assert corrupt.status_code == 400, corrupt.text
    assert "not valid gzip" in corrupt.json()["error"]["message"]


def test_paths_and_methods_no_route_serves_answer_in_openais_shape(cluster):
    unknown = httpx.post(cluster.url + "/v1/embeddings", json={"input": "x"}, timeout=30)
    assert unknown.status_code == 404
    assert unknown.json()["error"] == {
        "message": "Invalid URL (POST /v1/embeddings)",
        "type": "invalid_request_error",
        "param": None,
        "code": None,
    }
    wrong_method = httpx.get(cluster.url + "/v1/chat/completions", timeout=30)
    assert wrong_method.status_code == 405 and wrong_method.headers["allow"] == "POST"
    error = wrong_method.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"] == (
        "GET /v1/chat/completions is not allowed here; this path takes POST"
    )


def test_models_lists_the_served_model(openai_client):
    assert [m.id for m in openai_client.models.list().data] == [MODEL]


def test_disconnect_mid_stream_frees_blocks(cluster):
    body = {
        "model": MODEL,
        "prompt": "Tell me a long story",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
        "temperature": 0,
    }
    with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as response:
        lines = 0
        for line in response.iter_lines():
            lines += bool(line.startswith("data:"))
            if lines >= 3:
                break  # leaving the block closes the connection mid-stream
    info = cluster.wait_blocks_free()
    assert info["in_flight"] == 0
    assert info["decode_free_blocks"] == info["decode_total_blocks"]


def test_a_stop_string_stops_the_workers_too(cluster):
    """A stop string ends the choice at the gateway and its request in the cluster: the decode
    worker does not go on to `max_tokens` for nobody (until 2026-12-06 it did)."""
    cluster.wait_blocks_free()
    body = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 3_000,
            "ignore_eos": True, "temperature": 0, "stop": [" "]}  # fmt: skip
    response = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120).json()
    assert response["choices"][0]["finish_reason"] == "stop", response
    deadline = time.monotonic() + 5
    while cluster.ready_info()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.1)
    assert cluster.ready_info()["in_flight"] == 0, "still decoding after its stop string"


def test_clients_gone_before_their_answers_leave_the_queue_unprefilled(cluster):
    """Clients that give up while their requests wait behind others (a stream before its first
    token, a whole answer, a stream of two prompts) cancel them where they wait: their prompts
    are never prefilled, and the requests ahead of them are answered."""
    rng = random.Random(11)

    def body(prompt_tokens: int, **fields) -> dict:
        prompt = [rng.randrange(1_000, 40_000) for _ in range(prompt_tokens)]  # no cache hits
        return {"model": MODEL, "prompt": prompt, "max_tokens": 1, **fields}

    def post(body: dict) -> httpx.Response:
        return httpx.post(cluster.url + "/v1/completions", json=body, timeout=300)

    prefilled_before = prefilled_tokens(cluster)
    with ThreadPoolExecutor(2) as pool:  # ahead: the prefill worker's window, full
        ahead = [pool.submit(post, body(1_500)) for _ in range(2)]
        deadline = time.monotonic() + 30
        while cluster.ready_info()["in_flight"] < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        gone = [body(400, stream=True), body(400), body(200, stream=True)]
        gone[2]["prompt"] = [gone[2]["prompt"], body(200)["prompt"]]
        asyncio.run(give_up_after(cluster.url, gone, seconds=1.0))
        assert [answer.result().status_code for answer in ahead] == [200, 200]
    info = cluster.wait_blocks_free()
    assert info["in_flight"] == 0 and info["queued"] == 0
    assert prefilled_tokens(cluster) - prefilled_before == 2 * 1_500


async def give_up_after(url: str, bodies: list[dict], seconds: float) -> None:
    """Each body posted; each client closes its connection after `seconds` with no answer."""
    async with httpx.AsyncClient(base_url=url, timeout=seconds) as client:

        async def one(body: dict) -> None:
            with pytest.raises(httpx.ReadTimeout):
                async with client.stream("POST", "/v1/completions", json=body) as response:
                    await response.aread()
                    pytest.fail(f"answered {response.status_code} while queued behind others")

        await asyncio.gather(*(one(body) for body in bodies))


def prefilled_tokens(cluster) -> float:
    """Prompt tokens the prefill workers ran (the gateway's federation of their metrics)."""
    text = httpx.get(cluster.url + "/metrics", timeout=10).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem:prefill_tokens_total"
    )


def test_logit_bias_steers_every_token_as_the_engine_does(openai_client, smollm2):
    """Banned and favoured tokens, at the prefill worker's first token and the decode
    worker's steps after it: the cluster's output is the engine's with the same bias."""
    prompt = "The capital of France is"
    prompt_ids = smollm2.tokenizer(prompt).input_ids
    greedy = engine_greedy(smollm2, prompt_ids, 12)
    bias = {greedy[0]: -100.0, greedy[1]: -100.0, greedy[4]: 3.5}
    response = openai_client.completions.create(
        model=MODEL,
        prompt=prompt,
        max_tokens=12,
        temperature=0,
        logit_bias={str(token_id): value for token_id, value in bias.items()},
    )
    params = SamplingParams(max_tokens=12, temperature=0.0, logit_bias=bias)
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64))
    expected = engine.generate([prompt_ids], params)[0].token_ids
    assert expected[0] != greedy[0] and greedy[0] not in expected
    assert response.choices[0].text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)


def test_min_tokens_holds_eos_back_with_or_without_ignore_eos(openai_client):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    free = openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, temperature=0
    )
    assert free.choices[0].finish_reason == "stop" and free.usage.completion_tokens < 20
    for ignore_eos in (False, True):
        held = openai_client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=24,
            temperature=0,
            logprobs=True,
            extra_body={"min_tokens": 24, "ignore_eos": ignore_eos},
        )
        assert held.usage.completion_tokens == 24 and held.choices[0].finish_reason == "length"
        assert "<|im_end|>" not in [t.token for t in held.choices[0].logprobs.content]


def test_unset_sampling_fields_take_the_models_defaults(openai_client, smollm2, cluster):
    from shared.engine.sampling_defaults import DEFAULT_MODEL_SAMPLING

    (entry,) = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert entry["sampling_defaults"] == dict(DEFAULT_MODEL_SAMPLING)
    assert entry["dtypes"] == ["float32"]  # TANDEM_DTYPE, set for every test (tests/conftest.py)
    prompt = "Once upon a time"
    response = openai_client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, seed=11, extra_body={"ignore_eos": True}
    )
    params = SamplingParams(max_tokens=16, seed=11, ignore_eos=True, **DEFAULT_MODEL_SAMPLING)
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64))
    expected = engine.generate([smollm2.tokenizer(prompt).input_ids], params)[0].token_ids
    assert response.choices[0].text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
