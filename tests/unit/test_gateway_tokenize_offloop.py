"""A long prompt is tokenized off the gateway's event loop: an 8 MiB completion body took ~8 s of
tokenization on the loop, and every other client's stream stalled meanwhile. The fast tokenizer
releases the GIL while it encodes, so a thread lets the loop run. These tests check it
structurally, not by the clock: the tokenizer records whether an event loop runs on the thread
that called it. The tokens are the ones inline tokenization gives; a short prompt stays inline
(a thread hop costs more than its tokenization); at most `tokenize_threads` prompts are
tokenized at once; and a client that leaves while its prompt waits for a thread leaves no work
behind."""

from __future__ import annotations

import asyncio
import json
import math
import threading

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from services.gateway.app import build_app
from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.cluster import ClusterView
from services.gateway.generation import Generator
from services.gateway.openai_protocol import parse_chat_request, parse_completion_request
from services.gateway.rpc import RpcServer
from shared import wire
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger
from tests.unit.test_generation_events import PlayedCluster, delta, tokenizer  # noqa: F401

MODEL = "m"
MAX_MODEL_LEN = 16384
LONG_TEXT = "Tell me about the quick brown fox. " * 1000  # 35,000 characters, ~9,000 tokens
SHORT_TEXT = "Tell me about the quick brown fox."


def on_a_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


class RecordingTokenizer:
    """The real tokenizer, recording for each tokenization whether an event loop ran on the
    calling thread; `gate`, when set, holds every tokenization until it opens."""

    def __init__(self, real) -> None:
        self._tokenizer = real
        self.on_loop: list[bool] = []
        self.gate: threading.Event | None = None
        self.running = 0
        self.most_running = 0
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)

    def __call__(self, *args, **kwargs):
        return self._recorded(self._tokenizer, *args, **kwargs)

    def apply_chat_template(self, *args, **kwargs):
        return self._recorded(self._tokenizer.apply_chat_template, *args, **kwargs)

    def _recorded(self, tokenize, /, *args, **kwargs):
        self.on_loop.append(on_a_loop())
        with self._lock:
            self.running += 1
            self.most_running = max(self.most_running, self.running)
        try:
            if self.gate is not None:
                assert self.gate.wait(30), "the gate never opened"
            return tokenize(*args, **kwargs)
        finally:
            with self._lock:
                self.running -= 1


class SubmittedCluster(PlayedCluster):
    """Answers every choice with one token; the prompts submitted, in order."""

    def __init__(self) -> None:
        super().__init__({0: [delta([28], finish="length")]})
        self.prompts: list[list[int]] = []

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        self.prompts.append(list(submit.prompt_token_ids))
        return await super().submit(submit, timeout_s)


@pytest.fixture
def recording(tokenizer):  # noqa: F811
    return RecordingTokenizer(tokenizer)


def generator_of(recording, tokenize_threads: int | None = None) -> Generator:
    threads = {} if tokenize_threads is None else {"tokenize_threads": tokenize_threads}
    events = GatewayEvents(get_logger())
    generator = Generator(SubmittedCluster(), recording, MODEL, MAX_MODEL_LEN, events, **threads)
    recording.on_loop.clear()  # (what the constructor looked up)
    return generator


def completion(text: str) -> dict:
    return {"model": MODEL, "prompt": text, "max_tokens": 1}


def chat(text: str) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": 1}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", completion(LONG_TEXT)),
        ("/v1/chat/completions", chat(LONG_TEXT)),
        ("/tokenize", {"prompt": LONG_TEXT}),
        ("/tokenize", {"messages": [{"role": "user", "content": LONG_TEXT}]}),
    ],
)
def test_a_long_prompt_is_tokenized_off_the_event_loop_over_http(recording, path, body):
    client = TestClient(build_app(generator_of(recording), 1 << 20))
    response = client.post(path, json=body)
    assert response.status_code == 200, response.text
    assert recording.on_loop == [False]


def test_a_short_prompt_is_tokenized_inline(recording):
    client = TestClient(build_app(generator_of(recording), 1 << 20))
    for path, body in [("/v1/completions", completion(SHORT_TEXT)),
                       ("/v1/chat/completions", chat(SHORT_TEXT))]:  # fmt: skip
        assert client.post(path, json=body).status_code == 200
    assert recording.on_loop == [True, True]


def test_a_long_batch_of_prompts_is_tokenized_off_the_event_loop(recording):
    client = TestClient(build_app(generator_of(recording), 1 << 20))
    body = {"model": MODEL, "prompt": [LONG_TEXT, SHORT_TEXT], "max_tokens": 1}
    assert client.post("/v1/completions", json=body).status_code == 200
    assert recording.on_loop == [False, True]


def test_a_long_prompt_past_the_context_is_refused_off_the_event_loop(recording):
    client = TestClient(build_app(generator_of(recording), 1 << 20))
    response = client.post("/v1/completions", json=completion(LONG_TEXT * 3))
    assert response.status_code == 400 and "context" in response.json()["error"]["message"]
    assert recording.on_loop == [False]


def test_tokens_off_the_loop_are_inline_tokenizations(recording, tokenizer):  # noqa: F811
    generator = generator_of(recording)
    client = TestClient(build_app(generator, 1 << 20))
    assert client.post("/v1/completions", json=completion(LONG_TEXT)).status_code == 200
    assert client.post("/v1/chat/completions", json=chat(LONG_TEXT)).status_code == 200
    counted = client.post("/tokenize", json={"prompt": LONG_TEXT, "return_token_strs": True})
    assert recording.on_loop == [False, False, False]
    inline = tokenizer(LONG_TEXT).input_ids
    chat_request = parse_chat_request(chat(LONG_TEXT), MODEL, MAX_MODEL_LEN)
    assert generator.cluster.prompts == [inline, chat_prompt_ids(tokenizer, chat_request, False)]
    assert counted.json()["tokens"] == inline and counted.json()["count"] == len(inline)
    assert counted.json()["token_strs"] == tokenizer.convert_ids_to_tokens(inline)


@pytest.mark.parametrize(
    ("kind", "body"),
    [("completion", completion(LONG_TEXT)), ("chat", chat(LONG_TEXT))],
)
def test_a_long_prompt_is_tokenized_off_the_event_loop_over_rpc(recording, tokenizer, kind, body):  # noqa: F811
    door = RpcServer(generator_of(recording), address="inproc://unused")
    request = wire.RpcRequest(call_id="1", kind=kind, stream=False, body=json.dumps(body))
    generation = asyncio.run(door._prepare(request))
    assert recording.on_loop == [False]
    parse = parse_chat_request if kind == "chat" else parse_completion_request
    inline = door.generator.prepare(parse(body, MODEL, MAX_MODEL_LEN), "x").prompt_token_ids
    assert generation.prompt_token_ids == inline


def test_an_rpc_tokenize_call_of_a_long_prompt_is_answered_off_the_event_loop(recording):
    door = RpcServer(generator_of(recording), address="inproc://unused")
    body = json.dumps({"prompt": LONG_TEXT})
    request = wire.RpcRequest(call_id="1", kind="tokenize", stream=False, body=body)
    answer = json.loads(asyncio.run(door._tokenizer_answer(request)))
    assert recording.on_loop == [False] and answer["count"] == len(answer["tokens"])


def test_at_most_tokenize_threads_prompts_are_tokenized_at_once(recording):
    generator = generator_of(recording, tokenize_threads=2)
    recording.gate = threading.Event()
    request = parse_completion_request(completion(LONG_TEXT), MODEL, MAX_MODEL_LEN)

    async def scenario() -> list:
        calls = [asyncio.create_task(generator.prepare_async(request, "x")) for _ in range(6)]
        while recording.running < 2:
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.2)  # (time for a third to start, were it allowed to)
        assert recording.running == 2
        recording.gate.set()
        return await asyncio.gather(*calls)

    generations = asyncio.run(scenario())
    assert recording.most_running == 2 and len(recording.on_loop) == 6
    assert len({tuple(g.prompt_token_ids) for g in generations}) == 1


def test_a_prompt_whose_caller_left_while_it_waited_is_never_tokenized(recording):
    generator = generator_of(recording, tokenize_threads=1)
    recording.gate = threading.Event()
    request = parse_completion_request(completion(LONG_TEXT), MODEL, MAX_MODEL_LEN)

    async def scenario() -> None:
        first = asyncio.create_task(generator.prepare_async(request, "x"))
        while recording.running < 1:
            await asyncio.sleep(0.01)
        waiting = asyncio.create_task(generator.prepare_async(request, "x"))
        await asyncio.sleep(0.05)
        waiting.cancel()  # its client left
        await asyncio.gather(waiting, return_exceptions=True)
        recording.gate.set()
        await first
        await asyncio.sleep(0.2)  # (time for the one cancelled to run, were it still queued)

    asyncio.run(scenario())
    assert len(recording.on_loop) == 1


def test_a_client_that_leaves_while_its_prompt_waits_gets_a_499(recording):
    """The handler watches the connection while the prompt waits for its tokenization, so it
    answers (and its queued tokenization is dropped) without waiting the thread out."""
    generator = generator_of(recording, tokenize_threads=1)
    recording.gate = threading.Event()
    app = build_app(generator, 1 << 20)
    request = parse_completion_request(completion(LONG_TEXT), MODEL, MAX_MODEL_LEN)
    body = json.dumps(completion(LONG_TEXT)).encode()

    async def scenario() -> list[dict]:
        blocking = asyncio.create_task(generator.prepare_async(request, "x"))
        while recording.running < 1:
            await asyncio.sleep(0.01)
        left = asyncio.Event()
        sent: list[dict] = []
        messages = [{"type": "http.request", "body": body, "more_body": False}]

        async def receive() -> dict:
            if messages:
                return messages.pop(0)
            await left.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict) -> None:
            sent.append(message)

        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "scheme": "http", "path": "/v1/completions",
                 "raw_path": b"/v1/completions", "query_string": b"", "root_path": "",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("gateway", 80)}  # fmt: skip
        handling = asyncio.create_task(app(scope, receive, send))
        await asyncio.sleep(0.1)
        left.set()
        await asyncio.wait_for(handling, 5)  # (the gate is still shut)
        recording.gate.set()
        await blocking
        await asyncio.sleep(0.2)
        return sent

    sent = asyncio.run(scenario())
    assert sent[0]["status"] == 499
    assert len(recording.on_loop) == 1  # the blocking one alone


def ready_view(**fields) -> ClusterView:
    worker = wire.WorkerStatus(
        peer_id="w", role="decode", healthy=True, heartbeat_age_s=fields.pop("age", 0.5),
        num_running=0, num_waiting=0, num_swapped=0, num_free_blocks=1, num_total_blocks=1,
        steps_completed=0,
    )  # fmt: skip
    party = wire.PartyService(tenant="t", class_name="c", served_tokens=1,
                              virtual_tokens=fields.pop("virtual", 1.0))  # fmt: skip
    return ClusterView(num_decode=1, service=[party], workers=[worker], **fields)


class ReadyGenerator:
    model_name = MODEL

    def __init__(self, view: ClusterView) -> None:
        self.cluster = type("Cluster", (), {"view": view, "ready": True, "peer_id": "gw"})()
        self.telemetry = GatewayEvents(get_logger())


def test_ready_reports_a_non_finite_number_as_null():
    """Starlette's JSONResponse refuses NaN: a scheduler status carrying one made /ready a 500."""
    view = ready_view(max_queue_wait_s=math.nan, age=math.inf, virtual=-math.inf)
    response = TestClient(build_app(ReadyGenerator(view), 1 << 20)).get("/ready")
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["scheduler"]["max_queue_wait_s"] is None
    assert body["scheduler"]["service"][0]["virtual_tokens"] is None
    assert body["workers"][0]["heartbeat_age_s"] is None
    finite = TestClient(build_app(ReadyGenerator(ready_view()), 1 << 20)).get("/ready").json()
    assert finite["workers"][0]["heartbeat_age_s"] == 0.5


def test_ready_shows_tenants_only_to_a_key_that_may_see_them():
    """With API keys set, /ready stays open for probes (its status and the cluster's shape),
    but showed every tenant's name and usage to anyone: the tenants of the keys, and the `user`
    values bare-key clients sent (often an end user's email). Without a valid key no tenant is
    shown; a tenant's key sees its own; a bare key (which may charge any tenant) sees all."""
    from services.gateway.auth import ApiKeys

    parties = [
        wire.PartyService(tenant=name, class_name="c", served_tokens=1, virtual_tokens=1.0)
        for name in ("alice", "bob", "carol@example.com")
    ]
    view = ClusterView(num_decode=1, service=parties, workers=[])
    keys = ApiKeys.parse(["sk-alice-0123456789abcdef=alice", "sk-bare-0123456789abcdef"])
    client = TestClient(build_app(ReadyGenerator(view), 1 << 20, keys=keys))

    def tenants(key: str | None) -> tuple[int, list[str]]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = client.get("/ready", headers=headers)
        return response.status_code, [p["tenant"] for p in response.json()["scheduler"]["service"]]

    assert tenants(None) == (200, [])
    assert tenants("sk-wrong-0123456789abcdef") == (200, [])  # a probe's answer, not a 401
    assert tenants("sk-alice-0123456789abcdef") == (200, ["alice"])
    assert tenants("sk-bare-0123456789abcdef") == (200, ["alice", "bob", "carol@example.com"])
    open_door = TestClient(build_app(ReadyGenerator(view), 1 << 20))  # no keys: all, as before
    assert [p["tenant"] for p in open_door.get("/ready").json()["scheduler"]["service"]] == [
        "alice",
        "bob",
        "carol@example.com",
    ]


def test_metrics_shows_tenants_only_to_a_key_that_may_see_them():
    """/metrics labelled the fair-share gauges (the scheduler's, which it federates) with every
    tenant's name to anyone who could reach the gateway's port, the `user` values of bare-key
    clients (emails) among them. Now it shows them as /ready does, whichever peer's they are;
    the rest of the metrics stay open to every scraper."""
    from services.gateway.auth import ApiKeys
    from shared.lifecycle import SchedulerEvents
    from shared.metrics import serve_metrics

    parties = [
        wire.PartyService(tenant=name, class_name="c", served_tokens=1, virtual_tokens=1.0)
        for name in ("alice", "bob", "carol@example.com")
    ]
    scheduler = SchedulerEvents(get_logger())
    scheduler.refresh(
        wire.ClusterStatus(
            num_prefill=1, num_decode=1, num_queued=2, num_in_flight=0, service=parties
        )
    )
    address = serve_metrics(scheduler.registry, "127.0.0.1", 0)
    view = ClusterView(num_decode=1, service=parties, workers=[], scheduler_metrics_address=address)
    keys = ApiKeys.parse(["sk-alice-0123456789abcdef=alice", "sk-bare-0123456789abcdef"])
    client = TestClient(build_app(ReadyGenerator(view), 1 << 20, keys=keys))

    def scraped(key: str | None, client: TestClient = client) -> tuple[set[str], float]:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = client.get("/metrics", headers=headers)
        assert response.status_code == 200, response.text
        found = list(text_string_to_metric_families(response.text))
        tenants = {s.labels["tenant"] for f in found for s in f.samples if "tenant" in s.labels}
        waiting = [s.value for f in found for s in f.samples if s.name.endswith("waiting")]
        return tenants, waiting[0]

    everyone = {"alice", "bob", "carol@example.com"}
    assert scraped(None) == (set(), 2.0)
    assert scraped("sk-wrong-0123456789abcdef") == (set(), 2.0)
    assert scraped("sk-alice-0123456789abcdef") == ({"alice"}, 2.0)
    assert scraped("sk-bare-0123456789abcdef") == (everyone, 2.0)
    open_door = TestClient(build_app(ReadyGenerator(view), 1 << 20))  # no keys: all, as before
    assert scraped(None, open_door) == (everyone, 2.0)
