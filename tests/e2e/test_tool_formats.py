"""Tool calls in the formats chat templates teach, end to end: a second gateway, started with
`--chat-template` on the shared cluster, renders the tools with a Mistral-family or Llama-3-family
template, the real model writes a call in that format (steered by a regex, as a 135M model that
never learned it would not), and the official client gets it back as `tool_calls`, streamed and
whole alike. A history the template refuses is a 400."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time

import httpx
import pytest

from loadtest.served import free_port
from tests.e2e.test_tool_calls import MODEL, NOW, QUESTION, WEATHER, streamed_calls
from tests.helpers import CHAT_TEMPLATES

pytestmark = pytest.mark.slow
# What each family's model would write for the question, and the content left beside the call.
ANSWERS = {
    "mistral": (
        'Sure. [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]',
        "Sure.",
    ),
    "llama3": ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None),
}


def scheduler_address(cluster) -> str:
    run_dir = re.search(r"ipc://(/[^\s\"']*?/tandem-[^/\s\"']+)/", cluster.log()).group(1)
    return f"ipc://{run_dir}/scheduler.sock"


@pytest.fixture(scope="module", params=sorted(ANSWERS))
def family_gateway(request, cluster, tmp_path_factory):
    """(the family, an OpenAI client of a gateway with that family's template)."""
    from openai import OpenAI

    family = request.param
    root = tmp_path_factory.mktemp(f"gateway-{family}")
    port = free_port()
    log = (root / "gateway.log").open("wb")
    process = subprocess.Popen(
        [
            sys.executable, "-m", "services.commands.cli", "gateway", "--port", str(port),
            "--scheduler-address", scheduler_address(cluster),
            "--stream-address", f"ipc://{root}/stream.sock",
            "--chat-template", str(CHAT_TEMPLATES / f"{family}_tools.jinja"),
        ],
        stdout=log, stderr=subprocess.STDOUT,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and process.poll() is None:
        try:
            if httpx.get(url + "/ready", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    else:
        process.kill()
        pytest.fail(f"the {family} gateway did not start:\n{(root / 'gateway.log').read_text()}")
    yield family, OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    process.terminate()
    process.wait(timeout=30)


def steered(family: str) -> dict:
    """Fields that make the model write the family's call for the question."""
    literal = re.sub(r"([\\.^$|?*+()\[\]{}])", r"\\\1", ANSWERS[family][0])
    return {"extra_body": {"structured_outputs": {"regex": literal}}}


def test_a_call_in_the_templates_format_comes_back_as_tool_calls(family_gateway):
    family, client = family_gateway
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, temperature=0, tools=[WEATHER, NOW],
        **steered(family),
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == ANSWERS[family][1]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    if family == "mistral":  # ids its template takes back
        assert len(call.id) == 9 and call.id.isalnum()
    content, calls, finish = streamed_calls(client, QUESTION, **steered(family))
    assert (content or None, finish) == (choice.message.content, "tool_calls")
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"})
    ]


def test_the_call_and_its_result_go_back_through_the_template(family_gateway):
    family, client = family_gateway
    first = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=60, temperature=0, tools=[WEATHER, NOW],
        **steered(family),
    )  # fmt: skip
    (call,) = first.choices[0].message.tool_calls
    history = [
        *QUESTION,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, max_tokens=8, temperature=0, tools=[WEATHER, NOW],
        tool_choice="none",
    )  # fmt: skip
    assert answer.choices[0].message.content
    if family == "mistral":  # an id of another shape: the template refuses it, a clear 400
        history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "call_1"
        response = httpx.post(
            str(client.base_url) + "chat/completions",
            json={"model": MODEL, "messages": history, "tools": [WEATHER]},
            timeout=30,
        )
        assert response.status_code == 400
        error = response.json()["error"]
        assert error["param"] == "messages" and "nine letters or digits" in error["message"]
