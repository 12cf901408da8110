"""Fuzzing the shared cluster's doors with hypothesis: thousands of malformed HTTP bodies and
ZeroMQ frames. Every HTTP body gets a 2xx or a 4xx in OpenAI's shape, never a 5xx; every
malformed frame is dropped with a log line; afterwards no service has died, none has grown its
memory past a bound, and the cluster serves a normal request."""

from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import httpx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared import wire
from tests.e2e.test_garbage_frames import send_to_every_socket, socket_addresses

pytestmark = pytest.mark.slow
HTTP_EXAMPLES = 1500
FRAMES_PER_SOCKET = 1000
MAX_RSS_GROWTH_BYTES = 150 << 20

FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "temperature",
          "top_p", "top_k", "n", "stop", "stream", "stream_options", "logprobs", "top_logprobs",
          "seed", "user", "presence_penalty", "frequency_penalty", "ignore_eos", "priority",
          "echo", "logit_bias", "min_tokens", "role", "content", "best_of", "tokens",
          "return_token_strs", "parallel_tool_calls"]  # fmt: skip
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions",
         "tokenize": "/tokenize", "detokenize": "/detokenize"}  # fmt: skip

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.sampled_from(["smollm2", "user", "assistant", "system", "", "\x00", "\ud7ff" * 3]),
)
json_values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=8), inner, max_size=5)
    ),
    max_leaves=20,
)
# What msgpack can carry: integers within 64 bits.
packable_values = st.recursive(
    st.one_of(scalars.filter(lambda v: not isinstance(v, int) or -(2**63) <= v < 2**64),
              st.binary(max_size=16)),
    lambda inner: st.lists(inner, max_size=5)
    | st.dictionaries(st.text(max_size=8), inner, max_size=5),
    max_leaves=20,
)  # fmt: skip
# Small or invalid: a large valid max_tokens would only make the run slow, not the test better.
max_tokens = st.one_of(st.integers(-5, 3), st.floats(), st.text(max_size=5), st.none(), json_values)
bodies = st.dictionaries(st.sampled_from(FIELDS), json_values, max_size=8).flatmap(
    lambda body: st.builds(lambda m: {**body, "max_tokens": m}, max_tokens)
)
raw_bodies = st.one_of(
    st.binary(max_size=200),
    st.text(max_size=200).map(str.encode),
    st.just(b'{"model": "smollm2", "prompt": "x", "max_tokens": 2'),  # cut short
    st.just(b"\xff\xfe{}"),
)


def rss_by_service(cluster) -> dict[str, int]:
    """Resident memory of each child of `tandem up`, by the name in its argv."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(re.search(r"PPid:\s+(\d+)", status).group(1))
        if ppid == cluster.process.pid and b"services.commands.cli" in argv:
            name = argv[argv.index(b"services.commands.cli") + 1].decode()
            peer = argv[argv.index(b"--peer-id") + 1].decode() if b"--peer-id" in argv else name
            found[peer] = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) * 1024
    return found


def check_answer(response: httpx.Response, body) -> None:
    assert response.status_code < 500, (response.status_code, body, response.text[:300])
    if response.status_code >= 400:
        error = response.json()["error"]
        assert error["message"] and error["type"], error
    elif response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.rstrip().endswith("data: [DONE]"), response.text[-300:]


@pytest.fixture(scope="module")
def memory_before(cluster):
    cluster.wait_blocks_free()
    return rss_by_service(cluster)


def test_malformed_http_bodies_get_4xx_never_5xx(cluster, memory_before):
    client = httpx.Client(base_url=cluster.url, timeout=120, trust_env=False)

    @settings(max_examples=HTTP_EXAMPLES, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(body=st.one_of(bodies, json_values), path=st.sampled_from(sorted(PATHS)))
    def json_bodies(body, path):
        check_answer(client.post(PATHS[path], content=json.dumps(body, allow_nan=True)), body)

    @settings(max_examples=HTTP_EXAMPLES // 5, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(raw=raw_bodies)
    def raw(raw):
        response = client.post("/v1/completions", content=raw)
        assert 400 <= response.status_code < 500, (raw, response.status_code)

    with client:
        json_bodies()
        raw()
        # NaN and infinities are not JSON, but Python's parser takes them: still a 4xx.
        body = {"model": "smollm2", "prompt": "x", "max_tokens": 2, "temperature": math.nan}
        check_answer(client.post("/v1/completions", content=json.dumps(body)), body)
        # What the parser refuses past JSONDecodeError: an int over 4,300 digits, deep nesting.
        for raw_body in (b'{"seed": ' + b"1" * 5_000 + b"}", b"[" * 100_000):
            assert client.post("/v1/completions", content=raw_body).status_code == 400
        # The n choices' seeds are seed, seed + 1, ...: past 2**64 they wrap, not fail.
        body = {"model": "smollm2", "prompt": "x", "max_tokens": 2, "seed": 2**64 - 1, "n": 2}
        assert client.post("/v1/completions", json=body).status_code == 200


def field_names(code: int) -> list[str]:
    cls = wire.MESSAGE_CLASSES.get(code)
    return [f.name for f in dataclasses.fields(cls)] if cls else ["x"]


@st.composite
def frames(draw) -> list[bytes]:
    code = draw(st.sampled_from([*map(int, wire.MessageType), 0, 99, 255]))
    names = field_names(code)
    header = draw(st.dictionaries(st.sampled_from(names) | st.text(max_size=6), packable_values,
                                  max_size=len(names) + 1))  # fmt: skip
    packed = msgpack.packb(header, use_bin_type=True)
    if draw(st.booleans()):
        packed = draw(st.binary(max_size=64)) if draw(st.booleans()) else packed[: len(packed) // 2]
    extra = draw(st.lists(st.binary(max_size=64), max_size=2))
    return [bytes([code]), packed, *extra]


def test_malformed_frames_are_dropped_and_nothing_dies_or_grows(cluster, memory_before):
    addresses = socket_addresses(cluster.log())
    if cluster.rpc_address:
        addresses["rpc"] = cluster.rpc_address
    messages = []

    @settings(max_examples=FRAMES_PER_SOCKET, deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(message=frames())
    def collect(message):
        messages.append(message)

    collect()
    send_to_every_socket(addresses, messages)
    info = cluster.wait_blocks_free(timeout_s=60)
    assert info["prefill_workers"] == 1 and info["decode_workers"] == 2, info
    memory_after = rss_by_service(cluster)
    assert set(memory_after) == set(memory_before), "a service died or was restarted"
    for service, before in memory_before.items():
        assert memory_after[service] - before < MAX_RSS_GROWTH_BYTES, (service, before)
    assert cluster.log().count("dropped malformed") >= len(messages) // 2
    response = httpx.post(
        cluster.url + "/v1/completions",
        json={"model": "smollm2", "prompt": "Still here", "max_tokens": 4, "ignore_eos": True},
        timeout=120,
    )
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 4
