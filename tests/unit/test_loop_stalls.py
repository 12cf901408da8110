"""`loadtest.loop_stalls` measures what it says: against a real HTTP server whose completion
route holds its event loop (work done inline) and whose tokenize route waits off it, the probe's
worst latency shows the one stall and not the other; wrong arguments are refused by name."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from fastapi import FastAPI, Request

from loadtest import loop_stalls
from loadtest.served import free_port

STALL_S = 1.0  # what the inline route holds the loop for


def stalling_app() -> FastAPI:
    app = FastAPI()
    bodies: list[dict] = []

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [{"id": "m", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request) -> dict:
        bodies.append(json.loads(await request.body()))
        time.sleep(STALL_S)  # the work on the loop: every other client waits
        return {"error": "too long"}

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        bodies.append(json.loads(await request.body()))
        await asyncio.sleep(STALL_S)  # the work elsewhere: the loop serves others meanwhile
        return {"count": 0}

    app.state.bodies = bodies
    return app


@pytest.fixture
def served() -> Iterator[tuple[str, FastAPI]]:
    app = stalling_app()
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", app
    server.should_exit = True
    thread.join(10)


def test_the_probe_sees_a_stall_on_the_loop_and_not_a_wait_off_it(served):
    url, app = served
    kinds = ["long-prompt", "tokenize-strs"]
    result = loop_stalls.run_phases(url, kinds, mib=0.01, repeat=2, every_s=0.01)
    phases = result["phases"]
    assert list(phases) == ["idle", *kinds]
    assert phases["long-prompt"]["probe_max_ms"] >= 0.8 * STALL_S * 1000
    assert phases["tokenize-strs"]["probe_max_ms"] < 0.5 * STALL_S * 1000
    assert phases["long-prompt"]["heavy_median_ms"] >= STALL_S * 1000
    assert phases["long-prompt"]["statuses"] == [200]
    assert all(row["probes"] > 0 and row["probe_failures"] == 0 for row in phases.values())
    # The bodies are the kinds' own, of the size asked, for the model the server names.
    completion, tokenize = app.state.bodies[0], app.state.bodies[-1]
    assert completion["model"] == "m" and len(completion["prompt"].encode()) >= int(
        0.01 * (1 << 20)
    )
    assert tokenize["return_token_strs"] is True and tokenize["prompt"] == completion["prompt"]


def test_a_chat_of_many_messages_holds_the_text_in_order():
    text = loop_stalls.long_text(50_000)
    path, raw = loop_stalls.heavy_request("many-messages", "m", text)
    messages = json.loads(raw)["messages"]
    assert path == "/v1/chat/completions"
    assert len(messages) >= loop_stalls.NUM_MESSAGES
    assert "".join(m["content"] for m in messages) == text
    assert {m["role"] for m in messages} == {"user", "assistant"}


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--kinds", "long-prompt,nope"], "unknown kind(s) nope"),
        (["--kinds", ","], "unknown kind(s) (none)"),
        (["--mib", "0"], "must be positive"),
        (["--repeat", "-1"], "must be positive"),
        (["--probe-every-ms", "x"], "invalid"),
    ],
)
def test_wrong_arguments_are_refused_by_name(argv, needle, capsys):
    with pytest.raises(SystemExit) as exited:
        loop_stalls.main(argv)
    assert exited.value.code == 2
    assert needle in capsys.readouterr().err
