"""Completions' `echo` against the shared `tandem up` cluster on the real model: the prompt's
text and logprobs ahead of the output's, the prompt's logprobs equal to transformers' (scoring a
text through the server, as lm-evaluation-harness does), streamed as whole."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
import torch

pytestmark = pytest.mark.slow
MODEL = "smollm2"
PROMPT = "The river town woke slowly in winter, and the baker lit the ovens before dawn."


def complete(cluster, **body) -> httpx.Response:
    return httpx.post(cluster.url + "/v1/completions", json={"model": MODEL, **body}, timeout=120)


def test_echo_alone_scores_the_prompt_as_transformers_does(
    cluster, openai_client, smollm2, smollm2_hf
):
    ids = smollm2.tokenizer(PROMPT).input_ids
    response = openai_client.completions.create(
        model=MODEL, prompt=PROMPT, echo=True, logprobs=2, max_tokens=0, temperature=0
    )
    (choice,) = response.choices
    assert choice.text == PROMPT and choice.finish_reason == "length"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (len(ids), 0)
    logprobs = choice.logprobs
    assert logprobs.tokens == [smollm2.tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    with torch.no_grad():
        logits = smollm2_hf(torch.tensor([ids])).logits[0, :-1].float()
    expected = torch.log_softmax(logits, dim=-1)
    chosen = expected.gather(1, torch.tensor(ids[1:]).unsqueeze(1)).squeeze(1)
    torch.testing.assert_close(
        torch.tensor(logprobs.token_logprobs[1:]), chosen, atol=2e-4, rtol=1e-4
    )
    best = expected.argmax(dim=-1).tolist()
    for position, top in enumerate(logprobs.top_logprobs[1:]):
        assert 2 <= len(top) <= 3  # the top two and the prompt's own token (OpenAI's n+1)
        assert logprobs.tokens[position + 1] in top
        assert max(top, key=top.get) == smollm2.tokenizer.decode([best[position]])


def test_echo_puts_the_prompt_before_the_same_output(cluster):
    plain = complete(cluster, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1).json()
    echoed = complete(cluster, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=1, echo=True)
    (choice,) = echoed.json()["choices"]
    (plain_choice,) = plain["choices"]
    assert choice["text"] == PROMPT + plain_choice["text"]
    num_prompt = plain["usage"]["prompt_tokens"]
    assert echoed.json()["usage"] == plain["usage"]
    assert choice["logprobs"]["tokens"][num_prompt:] == plain_choice["logprobs"]["tokens"]
    output_logprobs = choice["logprobs"]["token_logprobs"][num_prompt:]
    assert output_logprobs == pytest.approx(plain_choice["logprobs"]["token_logprobs"], abs=1e-4)
    without_logprobs = complete(cluster, prompt=PROMPT, max_tokens=6, temperature=0, echo=True)
    (choice,) = without_logprobs.json()["choices"]
    assert choice["text"] == PROMPT + plain_choice["text"] and choice["logprobs"] is None


def test_echo_of_token_ids_in_a_batch_of_one_and_of_every_choice(cluster, smollm2):
    ids = smollm2.tokenizer("<|im_start|>user\nHi").input_ids
    answer = complete(cluster, prompt=[ids], max_tokens=2, n=2, echo=True, seed=3, logprobs=0)
    for choice in answer.json()["choices"]:
        assert choice["text"].startswith("<|im_start|>user\nHi")
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 2


def test_a_cached_prompt_is_scored_whole_every_time(cluster):
    prompt = PROMPT * 4  # several blocks, cached by the first request (prefill and decode)
    first = complete(cluster, prompt=prompt, max_tokens=4, temperature=0).json()
    scored = [
        complete(cluster, prompt=prompt, max_tokens=0, echo=True, logprobs=0).json()
        for _ in range(2)
    ]
    assert first["usage"]["prompt_tokens"] == scored[0]["usage"]["prompt_tokens"]
    logprobs = [s["choices"][0]["logprobs"]["token_logprobs"] for s in scored]
    assert len(logprobs[0]) == first["usage"]["prompt_tokens"]
    assert None not in logprobs[0][1:] and logprobs[0][1:] == pytest.approx(
        logprobs[1][1:], abs=1e-4
    )


def test_a_streamed_echo_equals_the_whole_answer(cluster):
    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 1}
    whole = complete(cluster, **body).json()["choices"][0]
    chunks = []
    with httpx.stream(
        "POST",
        cluster.url + "/v1/completions",
        json={"model": MODEL, **body, "stream": True},
        timeout=120,
    ) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0])
    assert chunks[0]["text"].startswith(PROMPT)
    assert "".join(c["text"] for c in chunks) == whole["text"]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    assert tokens == whole["logprobs"]["tokens"]
    # Offsets run on from chunk to chunk, as the whole answer's (each chunk began at 0).
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
        ({"prompt": PROMPT, "echo": "true"}, "echo"),
        ({"prompt": [[1, 2], []], "echo": True}, "prompt"),
        ({"prompt": [[]], "echo": True}, "prompt"),
        ({"prompt": PROMPT, "echo": True, "logprobs": 21}, "logprobs"),
    ],
)
def test_wrong_echo_input_is_refused(cluster, body, param):
    response = complete(cluster, **body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_chat_refuses_echo(openai_client):
    with pytest.raises(openai.BadRequestError) as raised:
        openai_client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], extra_body={"echo": True}
        )
    assert raised.value.body["param"] == "echo"


def test_served_perplexity_equals_the_engines_in_process(cluster, smollm2):
    """`loadtest.served_perplexity` scores windows through the cluster, side by side; the
    in-process figure of `loadtest.perplexity` on the same windows is the truth."""
    import asyncio

    from loadtest.perplexity import CORPUS, perplexity
    from loadtest.served_perplexity import served_perplexity

    text = CORPUS.read_text()[:2000]
    served = asyncio.run(served_perplexity(cluster.url, MODEL, text, 64, 3, concurrency=3))
    token_ids = smollm2.tokenizer(text).input_ids[: 3 * 64]
    expected, num_scored = perplexity(smollm2, token_ids, 64)
    assert (served["windows"], served["tokens_scored"]) == (3, num_scored)
    assert served["perplexity"] == pytest.approx(expected, rel=1e-4)


@pytest.mark.parametrize(
    "argv", [["--window", "1"], ["--concurrency", "0"], ["--max-windows", "-1"], ["--text", "/no"]]
)
def test_served_perplexity_refuses_wrong_arguments(argv, capsys):
    from loadtest.served_perplexity import parse_args

    with pytest.raises(SystemExit) as raised:
        parse_args(argv)
    assert raised.value.code == 2 and "error:" in capsys.readouterr().err
