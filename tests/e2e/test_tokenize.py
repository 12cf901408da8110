"""`/tokenize`, `/detokenize` and `GET /v1/models/{model}` against the shared `tandem up` cluster
on the real model: the counts are the ones generation's usage reports."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.unit.test_tools import WEATHER

pytestmark = pytest.mark.slow
MODEL = "smollm2"

USER_X = {"role": "user", "content": "x"}


def post(cluster, path: str, body) -> httpx.Response:
    return httpx.post(cluster.url + path, json=body, timeout=60)


def test_tokenize_counts_the_prompt_tokens_a_completion_reports(cluster, openai_client, smollm2):
    prompt = "The capital of France is"
    answer = post(cluster, "/tokenize", {"model": MODEL, "prompt": prompt}).json()
    expected = smollm2.tokenizer(prompt).input_ids
    assert answer == {
        "count": len(expected),
        "max_model_len": answer["max_model_len"],
        "tokens": expected,
    }
    usage = openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=1).usage
    assert usage.prompt_tokens == answer["count"]
    text = post(cluster, "/detokenize", {"tokens": answer["tokens"]}).json()
    assert text == {"prompt": prompt}


@pytest.mark.parametrize("tools", [None, [WEATHER]], ids=["plain", "tools"])
def test_tokenize_counts_the_prompt_tokens_a_chat_reports(cluster, openai_client, tools):
    """The chat template and the tools' rendering are generation's own: the same count."""
    messages = [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "What is the weather in Paris, and why?"},
    ]
    body = {"messages": messages, "max_tokens": 1, **({"tools": tools} if tools else {})}
    answer = post(cluster, "/tokenize", body).json()  # (`model` may be left out)
    response = openai_client.chat.completions.create(model=MODEL, **body)
    assert response.usage.prompt_tokens == answer["count"] == len(answer["tokens"])
    if tools:
        bare = post(cluster, "/tokenize", {"messages": messages}).json()
        assert answer["count"] > bare["count"] + 20  # the tool's schema is in the prompt


def test_tokenize_counts_a_prompt_longer_than_the_context(cluster):
    answer = post(cluster, "/tokenize", {"prompt": "many words " * 5000}).json()
    assert answer["count"] > answer["max_model_len"]
    refused = post(cluster, "/v1/completions", {"model": MODEL, "prompt": "many words " * 5000})
    assert refused.status_code == 400


def test_vllms_tokenize_flags_are_taken(cluster, smollm2):
    """vLLM's `add_special_tokens` and `add_generation_prompt` were "unknown field" 400s,
    though the endpoint has vLLM's shape (frameworks send them to count a history)."""
    plain = post(cluster, "/tokenize", {"prompt": "Hi there", "add_special_tokens": False})
    assert (
        plain.json()["tokens"] == smollm2.tokenizer("Hi there", add_special_tokens=False).input_ids
    )
    chat = post(cluster, "/tokenize", {"messages": [USER_X]}).json()["tokens"]
    body = {"messages": [USER_X], "add_generation_prompt": False, "add_special_tokens": False}
    history = post(cluster, "/tokenize", body).json()["tokens"]
    opening = smollm2.tokenizer("<|im_start|>assistant\n", add_special_tokens=False).input_ids
    assert chat == history + opening  # the assistant turn's opening alone left out


def test_token_strs_are_the_vocabularys_pieces(cluster, smollm2):
    body = {"prompt": "Hello world, héllo", "return_token_strs": True}
    answer = post(cluster, "/tokenize", body).json()
    assert answer["token_strs"] == smollm2.tokenizer.convert_ids_to_tokens(answer["tokens"])
    assert len(answer["token_strs"]) == answer["count"]


def test_detokenize_keeps_special_tokens(cluster, smollm2):
    ids = smollm2.tokenizer("<|im_start|>user\nHi<|im_end|>").input_ids
    assert post(cluster, "/detokenize", {"tokens": ids}).json() == {
        "prompt": "<|im_start|>user\nHi<|im_end|>"
    }
    assert post(cluster, "/detokenize", {"model": MODEL, "tokens": []}).json() == {"prompt": ""}


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/tokenize", [{"prompt": "x"}], 400, None),
        ("/tokenize", {}, 400, None),
        (
            "/tokenize",
            {"prompt": "x", "messages": [{"role": "user", "content": "x"}]},
            400,
            "prompt",
        ),
        ("/tokenize", {"prompt": ""}, 400, "prompt"),
        ("/tokenize", {"prompt": "x", "model": "gpt-4o"}, 404, "model"),
        ("/tokenize", {"prompt": "x", "model": 7}, 400, "model"),
        ("/tokenize", {"prompt": "x", "return_token_strs": "yes"}, 400, "return_token_strs"),
        ("/tokenize", {"prompt": "x", "add_special_tokens": "no"}, 400, "add_special_tokens"),
        (
            "/tokenize",
            {"messages": [USER_X], "add_special_tokens": True},
            400,
            "add_special_tokens",
        ),  # fmt: skip
        (
            "/tokenize",
            {"prompt": "x", "add_generation_prompt": False},
            400,
            "add_generation_prompt",
        ),  # fmt: skip
        ("/tokenize", {"messages": [{"role": "user"}]}, 400, "messages[0].content"),
        ("/tokenize", {"messages": [USER_X], "tools": 3}, 400, "tools"),
        ("/tokenize", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/detokenize", {"tokens": [1, -1]}, 400, "tokens"),
        ("/detokenize", {"tokens": [49152]}, 400, "tokens"),
        ("/detokenize", {"tokens": [1.0]}, 400, "tokens"),
        ("/detokenize", {"tokens": [True]}, 400, "tokens"),
        ("/detokenize", {"tokens": "1 2"}, 400, "tokens"),
        ("/detokenize", {}, 400, "tokens"),
        ("/detokenize", {"tokens": [1], "skip_special_tokens": True}, 400, "skip_special_tokens"),
        ("/detokenize", {"tokens": [1], "model": "gpt-4o"}, 404, "model"),
        ("/detokenize", "tokens", 400, None),
    ],
)
def test_wrong_input_is_refused_in_openais_shape(cluster, path, body, status, param):
    response = post(cluster, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["message"]


def test_a_body_that_is_not_json_is_refused(cluster):
    for path in ("/tokenize", "/detokenize"):
        response = httpx.post(cluster.url + path, content=b'{"prompt": ', timeout=30)
        assert response.status_code == 400
        assert response.json()["error"]["message"].startswith("the body is not valid JSON")


def test_models_retrieve_answers_the_served_model_and_404_for_others(cluster, openai_client):
    (listed,) = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    assert httpx.get(cluster.url + f"/v1/models/{MODEL}", timeout=10).json() == listed
    assert openai_client.models.retrieve(MODEL).id == MODEL
    for other in ("gpt-4o", "HuggingFaceTB/SmolLM2-135M-Instruct"):
        with pytest.raises(openai.NotFoundError) as raised:
            openai_client.models.retrieve(other)
        message = raised.value.body["message"]
        assert message == f"The model `{other}` does not exist; this server serves `{MODEL}`."
