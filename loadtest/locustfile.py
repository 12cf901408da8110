"""Locust users shaped like tandem's traffic, for `locust --headless` against a running cluster.

Four kinds of users, each its own tenant (the `user` field) for the fair-share scheduler:

- `ChatUser` (weight 4, the most common): a short question to /v1/chat/completions, streamed.
- `BulkUser` (2): synthetic data generation: back-to-back non-streaming /v1/completions of a
  few tokens each.
- `CodeAnalysisUser` (1): a slice of tandem's own source, about 400 to 1,500 tokens, with a
  question about it, streamed.
- `AgentUser` (1): an agent over the ZeroMQ RPC front door: a few streamed chat turns, each
  adding the answer and a tool's result to the context. Only when `TANDEM_RPC_ADDRESS` is set.

Every call is one Locust request (HTTP: POST and the path with the user's kind in brackets;
RPC: type `RPC`), timed to its end: a stream's `[DONE]` or `end`. A streamed call also reports
its time to first token, from sending to the first chunk, as a request of type `TTFT` named by
its kind, so TTFT gets its own row (percentiles, CSV, charts) beside the request times. A call
fails in Locust's stats when the status is not 200, when a stream carries an error event or
ends without `[DONE]` or without a chunk, or when an answer has no choices; a failed call reports
no TTFT.

Locust runs users as greenlets under gevent. The RPC client's socket comes from `zmq.green`,
so waiting for an answer yields to the other users instead of blocking the whole process.
Decoding is greedy (temperature 0) with small `max_tokens`; traffic goes to `--host` only.

    TANDEM_RPC_ADDRESS=tcp://127.0.0.1:8001 .venv/bin/locust -f loadtest/locustfile.py \
        --headless -u 16 -r 4 -t 2m --stop-timeout 60 --host http://127.0.0.1:8000 --csv out/run

Settings: `TANDEM_MODEL` (default smollm2), `TANDEM_RPC_ADDRESS` (the `tcp://` or `ipc://`
address of `tandem up --rpc-port`; unset or empty: no agent users), `TANDEM_API_KEY` (when the
gateway requires keys), `TANDEM_CURVE_CLIENT_DIR` and `TANDEM_CURVE_CLIENT` (a `tandem keys`
directory and client name, default agent, when the cluster uses CurveZMQ).
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import gevent
import locust.stats
import requests
import zmq.green
from locust import HttpUser, User, between, constant, events, task
from locust.env import Environment

from services.gateway.rpc_client import RpcError, TandemClient
from shared.curve import ClientKeys

MODEL = os.environ.get("TANDEM_MODEL") or "smollm2"
REQUEST_TIMEOUT_S = 120.0  # the longest wait for an answer, or for a stream's next chunk
CODE_PROMPT_CHARS = (1_500, 5_400)  # about 400 to 1,500 tokens of Python (3.6 chars a token)
NUM_AGENT_TURNS = 3
REPO_ROOT = Path(__file__).resolve().parents[1]


def _rpc_address(value: str | None) -> str | None:
    if not value:
        return None
    if not value.startswith(("tcp://", "ipc://")):
        raise ValueError(
            f"TANDEM_RPC_ADDRESS must be a tcp:// or ipc:// ZeroMQ address "
            f"(such as tcp://127.0.0.1:8001), got {value!r}"
        )
    return value


RPC_ADDRESS = _rpc_address(os.environ.get("TANDEM_RPC_ADDRESS"))
API_KEY = os.environ.get("TANDEM_API_KEY") or None  # when the gateway requires keys
# CurveZMQ for the agents, when the cluster uses it: a `tandem keys` directory and client name.
CURVE = (
    ClientKeys.from_dir(os.environ["TANDEM_CURVE_CLIENT_DIR"],
                        os.environ.get("TANDEM_CURVE_CLIENT", "agent"))
    if os.environ.get("TANDEM_CURVE_CLIENT_DIR") else None
)  # fmt: skip


@events.test_stop.add_listener
def _let_the_csv_catch_up(environment: Environment, **_: Any) -> None:
    # Locust rewrites the --csv files once a second and not at exit, so they miss the calls of
    # the last second (locustio/locust#1806, #2299); one more turn of its writer makes them whole.
    if getattr(environment.parsed_options, "csv_prefix", None):
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.5)


# --- prompts -----------------------------------------------------------------------------------

_QUESTIONS = [
    "What is {}?", "Explain {} in two sentences.", "Give me three facts about {}.",
    "Why does {} matter?", "Write a haiku about {}.", "How would you teach {} to a child?",
]  # fmt: skip
_SUBJECTS = [
    "photosynthesis", "the French revolution", "a binary search", "compound interest",
    "the moon's phases", "sourdough bread", "plate tectonics", "the TCP handshake",
    "a rainbow", "chess openings", "vaccines", "the water cycle",
]  # fmt: skip
_PRODUCTS = ["kettle", "backpack", "desk lamp", "bicycle", "pair of boots", "coffee grinder"]
_MOODS = ["delighted", "disappointed", "surprised", "indifferent", "furious", "grateful"]


def _read_sources() -> list[tuple[str, str]]:
    """(path, text) of tandem's Python files long enough for any code prompt."""
    folders = [REPO_ROOT / name for name in ("services", "shared", "kernels")]
    paths = sorted(path for folder in folders for path in folder.rglob("*.py"))
    texts = [(str(p.relative_to(REPO_ROOT)), p.read_text(encoding="utf-8")) for p in paths]
    sources = [(name, text) for name, text in texts if len(text) > CODE_PROMPT_CHARS[1]]
    assert sources, f"no Python sources under {REPO_ROOT} for the code analysis prompts"
    return sources


_SOURCES = _read_sources()


def chat_prompt() -> str:
    return random.choice(_QUESTIONS).format(random.choice(_SUBJECTS))


def bulk_prompt() -> str:
    product, mood = random.choice(_PRODUCTS), random.choice(_MOODS)
    return f"A one-sentence review of a {product} by a {mood} customer:"


def code_prompt() -> str:
    """A window of one source file, whole lines, of a random length in `CODE_PROMPT_CHARS`."""
    name, text = random.choice(_SOURCES)
    size = random.randint(*CODE_PROMPT_CHARS)
    start = text.rfind("\n", 0, random.randrange(len(text) - size)) + 1
    code = text[start : start + size].rsplit("\n", 1)[0]
    return f"Here is part of {name}:\n\n{code}\n\nWhat does this code do, and what could go wrong?"


def _chat_body(messages: list[dict[str, str]], kind: str, max_tokens: int) -> dict[str, Any]:
    # `user` is the tenant: each kind of user has its own share of the cluster.
    return {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
            "user": kind}  # fmt: skip


# --- HTTP users --------------------------------------------------------------------------------


class _StreamError(Exception):
    """A stream that went wrong after its 200: an error event, no chunk, no [DONE], bad JSON."""


class _OpenAIUser(HttpUser):
    abstract = True

    def on_start(self) -> None:
        if API_KEY:
            self.client.headers["Authorization"] = f"Bearer {API_KEY}"

    def stream(self, path: str, body: dict[str, Any], kind: str) -> None:
        """One streamed call, timed to [DONE]; then its TTFT, if it succeeded."""
        start = time.perf_counter()
        ttft_ms: float | None = None
        num_bytes = 0
        post = self._post(path, {**body, "stream": True}, kind, stream=True)
        with post as response:
            if response.status_code != 200:
                response.failure(_http_error(response))
                return
            try:
                for line in _sse_chunks(response):
                    num_bytes += len(line)
                    if ttft_ms is None:
                        ttft_ms = (time.perf_counter() - start) * 1000
                if ttft_ms is None:
                    raise _StreamError("[DONE] before any chunk")
            except (_StreamError, requests.RequestException) as error:
                response.failure(f"{type(error).__name__}: {error}")
                return
            finally:
                # Locust stops the clock of a stream=True request when the headers arrive.
                response.request_meta["response_time"] = (time.perf_counter() - start) * 1000
                response.request_meta["response_length"] = num_bytes
        _fire(self, "TTFT", kind, ttft_ms)

    def complete(self, path: str, body: dict[str, Any], kind: str) -> None:
        """One non-streamed call; a 200 without choices fails too."""
        with self._post(path, body, kind, stream=False) as response:
            if response.status_code != 200:
                response.failure(_http_error(response))
                return
            try:
                choices = response.json()["choices"]
            except (ValueError, KeyError):
                choices = None
            if not choices:
                response.failure(f"a 200 without choices: {response.text[:200]}")

    def _post(self, path: str, body: dict[str, Any], kind: str, stream: bool) -> Any:
        return self.client.post(
            path,
            json=body,
            name=f"{path} [{kind}]",
            stream=stream,
            catch_response=True,
            timeout=REQUEST_TIMEOUT_S,
        )


def _sse_chunks(response: requests.Response) -> Iterator[str]:
    """The data lines of an OpenAI stream before [DONE]; `_StreamError` at an error event or
    when the stream ends without [DONE]."""
    for line in response.iter_lines(decode_unicode=True):
        if not line.startswith("data: "):
            continue
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            return
        try:
            chunk = json.loads(data)
        except json.JSONDecodeError:
            raise _StreamError(f"a chunk that is not JSON: {data[:200]}") from None
        if "error" in chunk:
            raise _StreamError(f"error event: {chunk['error']}")
        yield line
    raise _StreamError("the stream ended without [DONE]")


def _http_error(response: Any) -> str:
    error = getattr(response, "error", None)  # set by Locust when no answer came at all
    if error is not None:
        return f"no answer: {error}"
    return f"HTTP {response.status_code}: {response.text[:200]}"


class ChatUser(_OpenAIUser):
    weight = 4
    wait_time = between(1, 3)  # a person reading the answer and typing the next question

    @task
    def ask(self) -> None:
        messages = [{"role": "user", "content": chat_prompt()}]
        self.stream("/v1/chat/completions", _chat_body(messages, "chat", 32), "chat")


class CodeAnalysisUser(_OpenAIUser):
    weight = 1
    wait_time = between(2, 5)

    @task
    def analyze(self) -> None:
        messages = [{"role": "user", "content": code_prompt()}]
        self.stream("/v1/chat/completions", _chat_body(messages, "code", 64), "code")


class BulkUser(_OpenAIUser):
    weight = 2
    wait_time = constant(0)  # a script: the next request as soon as the last one is answered

    @task
    def generate(self) -> None:
        body = {"model": MODEL, "prompt": bulk_prompt(), "max_tokens": 16, "temperature": 0,
                "user": "bulk"}  # fmt: skip
        self.complete("/v1/completions", body, "bulk")


# --- the RPC user ------------------------------------------------------------------------------


# A green context of its own: its sockets' waits yield to the other greenlets.
# (`zmq.green.Context.instance()` may return a plain context made earlier in the process.)
_GREEN_CONTEXT = zmq.green.Context()


class AgentUser(User):
    weight = 1
    wait_time = between(0.5, 1)
    abstract = RPC_ADDRESS is None  # no front door, no agents

    def on_start(self) -> None:
        assert RPC_ADDRESS is not None
        self.client = TandemClient(
            RPC_ADDRESS, REQUEST_TIMEOUT_S, context=_GREEN_CONTEXT, api_key=API_KEY, curve=CURVE
        )

    def on_stop(self) -> None:
        self.client.close()

    @task
    def solve(self) -> None:
        """A task in turns: each answer and a made-up tool result join the context."""
        messages = [
            {"role": "system", "content": "You are an agent. Think step by step; be brief."},
            {"role": "user", "content": f"Plan how to research {random.choice(_SUBJECTS)}."},
        ]
        for turn in range(NUM_AGENT_TURNS):
            answer = self.turn(messages)
            if answer is None:
                return  # reported; an agent whose call failed gives up on the task
            messages.append({"role": "assistant", "content": answer})
            messages.append({"role": "user", "content": f"Tool result {turn}: 42 documents found."})

    def turn(self, messages: list[dict[str, str]]) -> str | None:
        """One streamed chat call: the answer, or None once the failure is reported."""
        start = time.perf_counter()
        ttft_ms: float | None = None
        pieces: list[str] = []
        try:
            for chunk in self.client.stream_chat(**_chat_body(messages, "agent", 32)):
                if ttft_ms is None:
                    ttft_ms = (time.perf_counter() - start) * 1000
                pieces.extend(c["delta"].get("content") or "" for c in chunk["choices"])
            if ttft_ms is None:
                raise _StreamError("`end` before any chunk")
        except (RpcError, TimeoutError, _StreamError) as error:
            _fire(self, "RPC", "chat [agent]", (time.perf_counter() - start) * 1000, error)
            return None
        answer = "".join(pieces)
        total_ms = (time.perf_counter() - start) * 1000
        _fire(self, "RPC", "chat [agent]", total_ms, response_length=len(answer.encode()))
        _fire(self, "TTFT", "agent", ttft_ms)
        return answer


def _fire(
    user: User,
    request_type: str,
    name: str,
    response_time_ms: float,
    exception: Exception | None = None,
    response_length: int = 0,
) -> None:
    user.environment.events.request.fire(
        request_type=request_type,
        name=name,
        response_time=response_time_ms,
        response_length=response_length,
        exception=exception,
        context=user.context(),
    )
