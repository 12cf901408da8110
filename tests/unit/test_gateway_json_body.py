"""Request bodies that are JSON but not text: a lone UTF-16 surrogate (`"\\ud800"`, or its bytes
in UTF-8) in a prompt, a message, `user` or a /tokenize body failed the request with a 500 (the
tokenizer raised TypeError, the wire's encoding UnicodeEncodeError); both doors answer 400."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.generation import Generator
from services.gateway.json_body import load_json_body
from services.gateway.openai_protocol import ApiError
from services.gateway.rpc import RpcServer
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import PlayedCluster, delta, tokenizer  # noqa: F401

LONE = "\\ud800"  # as JSON writes it
BODIES = [
    ("/v1/completions", '{"model": "m", "prompt": "a%sb", "max_tokens": 1}'),
    ("/v1/chat/completions",
     '{"model": "m", "messages": [{"role": "user", "content": "a%s"}], "max_tokens": 1}'),
    ("/v1/completions", '{"model": "m", "prompt": "ab", "max_tokens": 1, "user": "%s"}'),
    ("/tokenize", '{"prompt": "a%sb"}'),
]  # fmt: skip


@pytest.fixture(scope="module")
def client(tokenizer):  # noqa: F811
    cluster = PlayedCluster({0: [delta([28], finish="length")]})
    generator = Generator(cluster, tokenizer, "m", 8192, GatewayEvents(get_logger()))
    return TestClient(build_app(generator, 1 << 20), raise_server_exceptions=False)


@pytest.mark.parametrize(("path", "body"), BODIES)
def test_a_lone_surrogate_is_a_400_over_http(client, path, body):
    for lone in (LONE.encode(), "\ud800".encode("utf-8", "surrogatepass")):
        response = client.post(path, content=(body % "X").encode().replace(b"X", lone))
        assert response.status_code == 400, response.text
        assert "lone UTF-16 surrogate (\\ud800)" in response.json()["error"]["message"]
    paired = client.post(path, content=body % "\\ud83d\\ude00")  # an emoji, as JSON may write it
    assert paired.status_code == 200, paired.text


def test_a_lone_surrogate_is_a_400_over_rpc():
    door = RpcServer(generator=object(), address="inproc://unused")  # type: ignore[arg-type]
    request = wire.RpcRequest(call_id="1", kind="completion", stream=False,
                              body='{"model": "m", "prompt": "a\\udfffb"}')  # fmt: skip
    with pytest.raises(ApiError) as refused:
        door._body(request)
    assert refused.value.status == 400 and "(\\udfff)" in refused.value.message


def test_json_that_only_looks_like_a_surrogate_is_taken():
    assert load_json_body('{"a": "\\\\ud800"}') == {"a": "\\ud800"}  # an escaped backslash
    assert load_json_body('{"\\ud83d\\ude00": 1}'.encode("utf-16")) == {"😀": 1}
    with pytest.raises(ApiError, match="lone"):
        load_json_body('{"\\udc00": 1}'.encode("utf-16"))  # (a key, in UTF-16)
