"""API keys and CurveZMQ on the guarded cluster: 401 in OpenAI's shape without a valid key, over
HTTP (the `openai` package) and RPC; a key's tenant is what fair share charges, whatever `user`
says; an RPC client without the cluster's CurveZMQ trust gets no answer at all."""

from __future__ import annotations

import httpx
import pytest

from services.gateway.rpc_client import RpcError, TandemClient
from shared.curve import ClientKeys
from tests.e2e.conftest import ALPHA_KEY, OPEN_KEY

pytestmark = pytest.mark.slow


def openai_client(url: str, key: str):
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)


@pytest.mark.parametrize("key", ["", "not-a-key-of-this-cluster", ALPHA_KEY[:-1]])
def test_without_a_valid_key_http_answers_401(guarded_cluster, key):
    from openai import AuthenticationError

    client = openai_client(guarded_cluster.url, key or "x")
    headers = {} if not key else {"Authorization": f"Bearer {key}"}
    gets = ("/v1/models", "/v1/models/smollm2")
    for path in (*gets, "/v1/completions", "/tokenize", "/detokenize"):
        response = httpx.request(
            "GET" if path in gets else "POST",
            guarded_cluster.url + path,
            headers=headers,
            json={"model": "smollm2", "prompt": "hi", "max_tokens": 2, "tokens": [1]},
        )
        assert response.status_code == 401, path
        assert response.json()["error"]["code"] == "invalid_api_key"
        assert response.headers["www-authenticate"] == "Bearer"
    with pytest.raises(AuthenticationError):
        client.completions.create(model="smollm2", prompt="hi", max_tokens=2)
    for open_path in ("/health", "/ready", "/metrics"):  # probes and scrapers need no key
        assert httpx.get(guarded_cluster.url + open_path, timeout=10).status_code == 200


def rpc_client(cluster, api_key: str | None, timeout_s: float = 60) -> TandemClient:
    curve = ClientKeys.from_dir(cluster.curve_keys_dir, "agent")
    return TandemClient(cluster.rpc_address, timeout_s=timeout_s, api_key=api_key, curve=curve)


def test_without_a_valid_key_rpc_answers_401(guarded_cluster):
    for key in (None, "wrong-key-0123456789abcdef"):
        client = rpc_client(guarded_cluster, key)
        with client, pytest.raises(RpcError) as raised:
            client.completion(model="smollm2", prompt="hi", max_tokens=2)
        assert raised.value.status == 401
    with rpc_client(guarded_cluster, OPEN_KEY, timeout_s=120) as client:
        answer = client.completion(model="smollm2", prompt="hi", max_tokens=2)
    assert answer["usage"]["completion_tokens"] == 2


def test_an_rpc_client_without_the_clusters_trust_gets_no_answer(guarded_cluster):
    import zmq

    server = ClientKeys.from_dir(guarded_cluster.curve_keys_dir, "agent").server_public
    stranger = ClientKeys(*zmq.curve_keypair(), server_public=server)
    for curve in (None, stranger):  # no encryption at all; a key the cluster never issued
        client = TandemClient(
            guarded_cluster.rpc_address, timeout_s=3, api_key=OPEN_KEY, curve=curve
        )
        with client, pytest.raises(TimeoutError):
            client.completion(model="smollm2", prompt="hi", max_tokens=2)
    assert stranger.public.decode() in guarded_cluster.log()  # logged with its key
