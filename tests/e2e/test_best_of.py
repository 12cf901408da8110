"""Completions' `best_of` against the shared `tandem up` cluster: the answer is the candidate
of highest mean logprob per token among those the same seeds draw."""

from __future__ import annotations

import pytest

from tests.e2e.test_batched_prompts import complete

pytestmark = pytest.mark.slow


def test_best_of_answers_the_candidate_of_highest_mean_logprob(cluster):
    """n=3 with a seed draws the candidates best_of=3 draws (seeds seed, seed + 1, ...): the
    answer is the one of them whose tokens have the highest mean logprob."""
    body = {"prompt": "My favourite food is", "max_tokens": 8, "temperature": 1.0, "seed": 11}
    candidates = complete(cluster, **body, n=3, logprobs=0).json()

    def mean(choice: dict) -> float:
        logprobs = choice["logprobs"]["token_logprobs"]
        return sum(logprobs) / len(logprobs)

    ranked = sorted(candidates["choices"], key=mean, reverse=True)
    assert len({c["text"] for c in ranked}) > 1  # the draws differ: the choice means something
    best = complete(cluster, **body, best_of=3).json()
    assert [c["text"] for c in best["choices"]] == [ranked[0]["text"]]
    assert best["choices"][0]["logprobs"] is None and best["choices"][0]["index"] == 0
    assert best["usage"]["completion_tokens"] == candidates["usage"]["completion_tokens"]
    two = complete(cluster, **body, best_of=3, n=2, logprobs=1).json()
    assert [c["text"] for c in two["choices"]] == [c["text"] for c in ranked[:2]]
    assert [c["index"] for c in two["choices"]] == [0, 1]
    top, token = (two["choices"][0]["logprobs"][k][0] for k in ("top_logprobs", "tokens"))
    assert 1 <= len(top) <= 2 and token in top  # the top one and the drawn one (OpenAI's n+1)
    streamed = complete(cluster, **body, best_of=3, stream=True)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "best_of"
