"""A bug in the gateway (an exception no code path meant) still answers in OpenAI's shape: a
whole answer as a 500 with an error body (it was Starlette's plain-text 500), a stream with an
error event and `[DONE]` (it was cut off); and a logprob JSON cannot carry (NaN) is written as
the floor, not a failed encoding, and ranks its `best_of` candidate last."""

from __future__ import annotations

import asyncio
import itertools
import json
import math

from fastapi.testclient import TestClient

from services.gateway.app import _sse_of, build_app
from services.gateway.openai_shapes import (
    SSE_DONE,
    ChoiceResult,
    TokenLogprob,
    completion_logprobs,
)
from services.gateway.responses import best_of


class BrokenGenerator:
    """Reads requests as the real one does, then fails as no one foresaw."""

    model_name = "m"
    max_model_len = 64

    def prepare(self, request, id_prefix):
        raise KeyError("a bug")


def test_an_unforeseen_failure_is_a_500_in_openais_shape():
    client = TestClient(build_app(BrokenGenerator(), 1 << 20), raise_server_exceptions=False)
    response = client.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert response.status_code == 500
    error = response.json()["error"]
    assert error["type"] == "server_error" and "KeyError" in error["message"]


def test_a_stream_that_fails_unforeseen_ends_with_an_error_event_and_done():
    async def chunks():
        yield {"choices": [{"index": 0, "text": "a"}]}
        raise ValueError("a bug")

    async def collect() -> list[bytes]:
        return [part async for part in _sse_of(chunks())]

    parts = asyncio.run(collect())
    assert parts[-1] == SSE_DONE
    error = json.loads(parts[-2].decode().removeprefix("data: "))["error"]
    assert error["type"] == "server_error" and "ValueError" in error["message"]


def test_a_nan_logprob_is_written_as_the_floor():
    token = TokenLogprob("a", b"a", math.nan, (TokenLogprob("b", b"b", math.nan),))
    shaped = completion_logprobs([token])
    json.dumps(shaped, allow_nan=False)
    assert shaped["token_logprobs"] == [-9999.0]
    assert shaped["top_logprobs"] == [{"b": -9999.0, "a": -9999.0}]


def test_a_nan_logprob_ranks_its_best_of_candidate_last_and_leaves_the_rest_in_order():
    """A NaN mean compares false with every other, so sorting by it put that candidate first
    when it came first, and left the others unsorted behind it (a mean of -5 before -0.1)."""
    means = {"good": [-0.1, -0.1], "nan": [math.nan, -0.1], "poor": [-5.0, -5.0]}
    for order in itertools.permutations(means):
        logprobs = [[TokenLogprob("t", b"t", lp) for lp in means[name]] for name in order]
        candidates = [ChoiceResult(i, name, "length", [7, 7], None) for i, name in enumerate(order)]
        ranked = [c.text for c in best_of(candidates, logprobs, 3)]
        assert ranked == ["good", "poor", "nan"], order
