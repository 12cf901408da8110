"""The ZeroMQ RPC front door against a `tandem up` cluster: the same answers and errors as the
HTTP API, streams, cancellation that frees the KV blocks, and garbage that is dropped."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from services.gateway.rpc_client import AsyncTandemClient, RpcError, TandemClient
from shared import wire
from tests.e2e.test_garbage_frames import GARBAGE

pytestmark = pytest.mark.slow
MODEL = "smollm2"
REPO = Path(__file__).resolve().parents[2]
LONG_STREAM = {"model": MODEL, "prompt": "Tell me a long story", "max_tokens": 400,
               "ignore_eos": True, "temperature": 0}  # fmt: skip


@pytest.fixture
def client(cluster):
    with TandemClient(cluster.rpc_address, timeout_s=120) as client:
        yield client


def test_greedy_answers_equal_the_http_api(client, openai_client):
    completion = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 16,
                  "temperature": 0}  # fmt: skip
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "What is 2 + 2?"}],
            "max_tokens": 16, "temperature": 0}  # fmt: skip
    http = openai_client.completions.with_raw_response.create(**completion)
    assert _same_but_id(client.completion(**completion), json.loads(http.text))
    http = openai_client.chat.completions.with_raw_response.create(**chat)
    assert _same_but_id(client.chat(**chat), json.loads(http.text))


def _same_but_id(rpc: dict, http: dict) -> bool:
    """Equal but for ids, times and cached tokens (the second of two equal prompts finds the
    first's blocks in the prefix cache)."""
    assert rpc["id"].split("-")[0] == http["id"].split("-")[0]  # cmpl- or chatcmpl-
    unique = ("id", "created", "usage")
    return {k: v for k, v in rpc.items() if k not in unique} == {
        k: v for k, v in http.items() if k not in unique
    } and _uncached(rpc["usage"]) == _uncached(http["usage"])


def _uncached(usage: dict) -> dict:
    return {k: v for k, v in usage.items() if k != "prompt_tokens_details"}


def test_async_stream_concatenates_to_the_response(cluster):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Name three colors."}],
            "max_tokens": 24, "temperature": 0}  # fmt: skip

    async def run() -> tuple[dict, list[dict]]:
        async with AsyncTandemClient(cluster.rpc_address, timeout_s=120) as client:
            stream = client.stream_chat(**body, stream_options={"include_usage": True})
            return await asyncio.gather(client.chat(**body), _collect(stream))

    response, chunks = asyncio.run(run())
    assert len(chunks) > 2 and all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == response["choices"][0]["message"]["content"]
    assert _uncached(chunks[-1]["usage"]) == _uncached(response["usage"])


async def _collect(stream) -> list[dict]:
    return [chunk async for chunk in stream]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
     ({"model": "gpt-5", "prompt": "x"}, 404, "model")],
)  # fmt: skip
def test_errors_have_the_http_status_and_body(client, body, status, param):
    with pytest.raises(RpcError) as raised:
        client.completion(**body)
    assert raised.value.status == status
    assert set(raised.value.body["error"]) == {"message", "type", "param", "code"}
    assert raised.value.param == param


def test_tokenize_and_detokenize_answer_as_http_does(cluster, client):
    import httpx

    chat = {"messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 4}
    http = httpx.post(cluster.url + "/tokenize", json=chat, timeout=60).json()
    assert client.tokenize(**chat) == http and http["count"] > 10
    text = {"model": MODEL, "tokens": http["tokens"]}
    assert client.detokenize(**text)["prompt"].endswith(
        "What is 2 + 2?<|im_end|>\n<|im_start|>assistant\n"
    )

    async def run() -> dict:
        async with AsyncTandemClient(cluster.rpc_address, timeout_s=120) as async_client:
            return await async_client.tokenize(prompt="The capital of France is")

    assert asyncio.run(run())["count"] == 5
    for call, body, param in [
        (client.tokenize, {"prompt": "x", "messages": chat["messages"]}, "prompt"),
        (client.detokenize, {"tokens": [-3]}, "tokens"),
    ]:
        with pytest.raises(RpcError) as raised:
            call(**body)
        assert raised.value.status == 400 and raised.value.param == param
    sock = _raw_socket(cluster)  # the tokenizer's calls are never streamed
    try:
        wire.send(sock, wire.RpcRequest(call_id="t", kind="tokenize", body=json.dumps(chat),
                                        stream=True))  # fmt: skip
        (event,) = _events_past_probes(sock, 1) or [None]
    finally:
        sock.close(linger=0)
    assert event is not None and (event.kind, event.status) == ("error", 400)
    assert json.loads(event.body)["error"]["param"] == "stream"


def test_an_answer_over_one_events_limit_is_refused_not_lost(cluster, client):
    """The client drops an event over the wire's JSON limit as malformed: sent, it would leave
    the call waiting for good. The gateway answers 400 instead, naming the way round."""
    import httpx

    prompt = " a" * 1_500_000  # 1.5 million tokens: their ids fit one event, with strings not
    assert client.tokenize(prompt=prompt)["count"] == 1_500_000
    with pytest.raises(RpcError) as raised:
        client.tokenize(prompt=prompt, return_token_strs=True, timeout_s=60)
    assert raised.value.status == 400 and "HTTP API" in raised.value.body["error"]["message"]
    body = {"prompt": prompt, "return_token_strs": True}
    http = httpx.post(cluster.url + "/tokenize", json=body, timeout=120).json()
    assert http["token_strs"][:2] == ["Ġa", "Ġa"] and http["count"] == 1_500_000
    # A call over the limit the other way is refused by the client, before it is sent.
    with pytest.raises(RpcError, match="nothing was sent") as raised:
        client.tokenize(prompt=" a" * 4_200_000, timeout_s=60)
    assert raised.value.status == 413 and client._inbox == {}  # (nothing kept for it)
    assert client.tokenize(prompt="Hi")["count"] == 1  # the connection still serves


def test_cancel_mid_stream_frees_the_blocks(cluster, client):
    # Leaving the stream early.
    stream = client.stream_completion(**LONG_STREAM)
    next(stream)
    _wait_in_flight(cluster)
    stream.close()
    _assert_blocks_free(cluster)
    # An explicit cancel: the stream ends with 499.
    stream = client.stream_completion(**LONG_STREAM)
    next(stream)
    _wait_in_flight(cluster)
    client.cancel(stream.call_id)
    with pytest.raises(RpcError) as raised:
        list(stream)
    assert raised.value.status == 499
    _assert_blocks_free(cluster)
    # A client that vanished: its next chunk finds no route.
    sock = _raw_socket(cluster)
    request = wire.RpcRequest(call_id="1", kind="completion", body=json.dumps(LONG_STREAM),
                              stream=True)  # fmt: skip
    wire.send(sock, request)
    assert sock.poll(120_000)
    _wait_in_flight(cluster)
    sock.close(linger=0)
    _assert_blocks_free(cluster)
    assert "rpc client gone" in cluster.log()


@pytest.mark.parametrize("end", ["killed", "stopped"])
def test_a_client_gone_while_its_answer_is_generated_has_the_call_cancelled(cluster, end):
    """A client process killed (its connection closed) or stopped (its connection silent) while
    a whole answer is generated: ZeroMQ tells the gateway nothing, its probe and heartbeats do
    (4 s in this cluster), and the call is cancelled in seconds, not left to run 3,000 steps."""
    cluster.wait_blocks_free()
    call = (
        "from services.gateway.rpc_client import TandemClient\n"
        f"with TandemClient({cluster.rpc_address!r}, timeout_s=600) as client:\n"
        f"    client.completion(**{LONG_STREAM | {'max_tokens': 3_000}!r})\n"
    )
    process = subprocess.Popen([sys.executable, "-c", call], cwd=REPO)
    try:
        assert wait_for_in_flight(cluster, lambda n: n == 1, timeout_s=60), "never submitted"
        time.sleep(1.0)  # (generating)
        process.send_signal(signal.SIGKILL if end == "killed" else signal.SIGSTOP)
        assert wait_for_in_flight(cluster, lambda n: n == 0, timeout_s=15), "still generating"
    finally:
        process.kill()
        process.wait()
    info = cluster.wait_blocks_free()
    assert info["decode_free_blocks"] == info["decode_total_blocks"]


def wait_for_in_flight(cluster, wanted, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if wanted(cluster.ready_info()["in_flight"]):
            return True
        time.sleep(0.1)
    return False


def test_garbage_and_misuse_are_dropped_or_refused(cluster, client):
    sock = _raw_socket(cluster)
    try:
        for frames in [*GARBAGE, [bytes([wire.MessageType.RPC_REQUEST]), b"\x80"]]:
            sock.send_multipart(frames)
        body = json.dumps({**LONG_STREAM, "max_tokens": 8})
        for _ in range(2):  # the second, with a call id in flight, ends the id's call: one 409
            wire.send(sock, wire.RpcRequest(call_id="d", kind="completion", body=body,
                                            stream=False))  # fmt: skip
        events = _events_past_probes(sock, 1)
        wire.send(sock, wire.RpcRequest(call_id="e", kind="completion", body=body, stream=False))
        events += _events_past_probes(sock, 1)  # (nothing more for "d" before "e"'s answer)
    finally:
        sock.close(linger=0)
    assert [(e.call_id, e.kind, e.status, e.done) for e in events] == [
        ("d", "error", 409, True), ("e", "response", 200, True)]  # fmt: skip
    assert [status for status, _ in _raw_calls(cluster, UNPARSABLE_JSON)] == [400, 400]
    answer = client.completion(model=MODEL, prompt="Still there?", max_tokens=2, temperature=0)
    assert answer["usage"]["completion_tokens"] >= 1
    rpc_lines = [line for line in cluster.log().splitlines() if '"component": "rpc"' in line]
    assert any("dropped malformed" in line for line in rpc_lines)


def _events_past_probes(sock: zmq.Socket, count: int) -> list[wire.RpcEvent]:
    """The next `count` events, leaving out the door's `waiting` probes (sent when a call takes
    over 2 s, as on a loaded machine)."""
    events = []
    while len(events) < count and sock.poll(120_000):
        event = wire.recv(sock)
        if event.kind != "waiting":
            events.append(event)
    return events


# JSON that Python's parser refuses past JSONDecodeError (the client's json.dumps would too).
UNPARSABLE_JSON = ['{"seed": ' + "1" * 5_000 + "}", "[" * 100_000]


def _raw_calls(cluster, bodies: list[str]) -> list[tuple[int, str]]:
    """(status, error message) of each body sent as a completion call from a raw socket."""
    sock = _raw_socket(cluster)
    try:
        answers = []
        for n, body in enumerate(bodies):
            call = wire.RpcRequest(call_id=f"raw-{n}", kind="completion", body=body, stream=False)
            wire.send(sock, call)
            (event,) = _events_past_probes(sock, 1) or [None]
            assert event is not None, "no answer"
            answers.append((event.status, json.loads(event.body)["error"]["message"]))
        return answers
    finally:
        sock.close(linger=0)


def _raw_socket(cluster) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(cluster.rpc_address)
    return sock


def _wait_in_flight(cluster, timeout_s: float = 10.0) -> None:
    """Until the gateway's view of the cluster shows the request (the view lags a little)."""
    deadline = time.monotonic() + timeout_s
    while cluster.ready_info()["in_flight"] == 0:
        assert time.monotonic() < deadline, "the request never showed in flight"
        time.sleep(0.1)


def _assert_blocks_free(cluster) -> None:
    info = cluster.wait_blocks_free()
    assert info["in_flight"] == 0
    assert info["decode_free_blocks"] == info["decode_total_blocks"]
