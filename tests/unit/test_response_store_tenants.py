"""The Responses API's store shared by tenants: one tenant's stored responses cannot push out
another's conversations (it evicted the least recently used response of any tenant, so a
tenant storing many, as every request does by default, broke every other tenant's
`previous_response_id`)."""

from __future__ import annotations

import openai
import pytest
from fastapi.testclient import TestClient

from services.gateway.app import build_app
from services.gateway.auth import ApiKeys
from services.gateway.generation import Generator
from services.gateway.openai_protocol import ApiError
from services.gateway.response_store import ResponseStore
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import tokenizer  # noqa: F401
from tests.unit.test_responses_routes import MODEL, TextCluster


def stored_turn(store: ResponseStore, tenant: str, response_id: str, previous: str | None) -> None:
    response = {"id": response_id, "output": [], "status": "completed"}
    messages = [{"role": "user", "content": "x" * 20}, {"role": "assistant", "content": "y"}]
    assert store.put(tenant, response, previous, messages)


def test_a_tenant_storing_many_evicts_its_own_before_anothers_conversation():
    store = ResponseStore(max_bytes=1000)
    stored_turn(store, "light", "l1", None)
    stored_turn(store, "light", "l2", "l1")
    for i in range(40):  # many times the bound
        stored_turn(store, "heavy", f"h{i}", None)
        assert store.num_bytes <= 1000
    assert len(store.conversation("light", "l2")) == 4
    with pytest.raises(ApiError):
        store.response("heavy", "h0")  # the heavy tenant's oldest left
    assert store.response("heavy", "h39")["id"] == "h39"


def test_the_turn_being_stored_is_kept_when_its_tenant_holds_the_most():
    """Its tenant holds nothing else, and more than the other once it is counted: the room is
    made by the other's responses, never by the turn itself (put said True)."""
    store = ResponseStore(max_bytes=1000)
    stored_turn(store, "small", "s1", None)
    big = {"id": "b1", "output": [], "status": "completed"}
    assert store.put("big", big, None, [{"role": "user", "content": "z" * 800}])
    assert store.response("big", "b1")["id"] == "b1" and store.num_bytes <= 1000
    with pytest.raises(ApiError):
        store.response("small", "s1")


def test_a_delete_and_the_bound_count_each_tenant_apart():
    store = ResponseStore(max_bytes=1000)
    stored_turn(store, "a", "a1", None)
    stored_turn(store, "b", "b1", None)
    with pytest.raises(ApiError):
        store.delete("b", "a1")  # (another tenant's: nothing counted leaves)
    before = store.num_bytes
    store.delete("a", "a1")
    assert 0 < store.num_bytes < before and len(store) == 1


def test_a_tenants_flood_of_stored_responses_leaves_anothers_conversation_continuable(
    tokenizer,  # noqa: F811
):
    """Through the gateway and the `openai` client, with one key per tenant."""
    keys = {"k-light-000000000": "light", "k-heavy-000000000": "heavy"}
    cluster = TextCluster(tokenizer, "Hello.")
    generator = Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()))
    store = ResponseStore(max_bytes=20_000)
    http = TestClient(build_app(generator, 1 << 20, ApiKeys(keys), responses=store))
    light, heavy = (
        openai.OpenAI(base_url="http://testserver/v1", api_key=key, http_client=http)
        for key in keys
    )
    first = light.responses.create(model=MODEL, input="Remember: 42.")
    for _ in range(3 * store.max_bytes // store.num_bytes):  # the bound passed 3 times over
        heavy.responses.create(model=MODEL, input="Hi")
    light.responses.create(model=MODEL, input="What was it?", previous_response_id=first.id)
    assert "Remember: 42." in tokenizer.decode(cluster.prompts[-1])


@pytest.mark.parametrize("verbosity", [5, "loud", ["low"]])
def test_a_text_verbosity_openai_does_not_have_is_a_400_naming_it(verbosity):
    """It was taken whatever it was, and echoed in the Response as given, where the `openai`
    package's types allow only OpenAI's three (a client validating them refused the answer)."""
    from services.gateway.responses_api import chat_body

    with pytest.raises(ApiError) as info:
        chat_body({"model": MODEL, "input": "x", "text": {"verbosity": verbosity}})
    assert info.value.status == 400 and info.value.param == "text.verbosity"
    chat_body({"model": MODEL, "input": "x", "text": {"verbosity": "low", "format": None}})
