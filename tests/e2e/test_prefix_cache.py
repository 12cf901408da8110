"""The prefix cache through the served cluster: a repeated system prompt is reported as cached
tokens (HTTP and RPC), a conversation's answers equal the cache-off engine's through the kill of
the decode worker holding it, and idle workers hold no referenced block."""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from services.gateway.rpc_client import TandemClient
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from tests.e2e.conftest import ALPHA_KEY
from tests.e2e.test_worker_failure import wait_for_workers, worker_pid

pytestmark = pytest.mark.slow

SYSTEM = (
    "You are the help desk of a small library. Answer briefly and politely. Opening hours: "
    "Monday to Friday 9 to 18, Saturday 10 to 14. Loans last three weeks and can be renewed "
    "twice online. Fines are ten cents per day. Printing costs five cents per page."
)


def chat(question: str) -> dict:
    return {
        "model": "smollm2",
        "messages": [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": question},
        ],
        "max_tokens": 12,
        "temperature": 0,
        "user": "prefix-e2e",
    }


def test_repeated_system_prompt_is_reported_cached_and_answers_do_not_change(
    cluster, openai_client
):
    first = openai_client.chat.completions.create(**chat("When do you open on Saturday?"))
    again = openai_client.chat.completions.create(**chat("When do you open on Saturday?"))
    other = openai_client.chat.completions.create(**chat("How long is a loan?"))
    assert again.choices[0].message.content == first.choices[0].message.content
    prompt_tokens = first.usage.prompt_tokens
    assert prompt_tokens > 64
    # The identical prompt finds every full block but the one holding its last token.
    assert again.usage.prompt_tokens_details.cached_tokens == (prompt_tokens - 1) // 16 * 16
    # Another question after the same system prompt finds at least the system prompt's blocks.
    assert other.usage.prompt_tokens_details.cached_tokens >= 64
    with TandemClient(cluster.rpc_address, timeout_s=120) as client:
        rpc = client.chat(**chat("How long is a loan?"))
    assert rpc["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64
    assert rpc["choices"][0]["message"]["content"] == other.choices[0].message.content
    info = cluster.wait_blocks_free()
    assert all(w["free_blocks"] == w["total_blocks"] for w in info["workers"]), info


TURNS = ["Can I renew a loan?", "How many times?", "And what if I return it late?"]


def reference_turns(smollm2, messages: list[dict]) -> str:
    """The engine's greedy answer with the prefix cache off: the truth for every turn."""
    prompt = smollm2.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=128, enable_prefix_caching=False))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    token_ids = engine.generate([list(prompt)], params)[0].token_ids
    return smollm2.tokenizer.decode(token_ids, skip_special_tokens=True)


def decode_queries(cluster) -> dict[str, int]:
    workers = cluster.ready_info()["workers"]
    return {w["peer_id"]: w["prefix_query_tokens"] for w in workers if w["role"] == "decode"}


def decode_worker_of(cluster, completion_id: str) -> str:
    """The decode worker the scheduler gave a chat completion to (its one choice), from the
    scheduler's "request dispatched" log line."""
    for line in cluster.log().splitlines():
        if line.startswith("[scheduler]") and "request dispatched" in line:
            event = json.loads(line.split("]", 1)[1])
            if event["request_id"] == f"{completion_id}-0":
                return event["decode"]
    raise AssertionError(f"no dispatch of {completion_id} in the scheduler's log")


def test_a_conversation_survives_the_kill_of_the_decode_worker_holding_it(guarded_cluster, smollm2):
    """Each turn's greedy answer equals the cache-off engine's. Turn 2 goes to the decode worker
    that kept turn 1 (which prefills the short new suffix itself when its wait is predicted no
    longer than a prefill worker's: its lookups grow; a measured prefill rate above the decode
    worker's unmeasured one sends the suffix to a prefill worker, which skips the blocks the
    decode worker holds); that worker is killed, and turn 3 is still answered right, elsewhere.
    Idle, no block is referenced."""
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)
    messages = [{"role": "system", "content": SYSTEM}]
    headers = {"Authorization": f"Bearer {ALPHA_KEY}"}
    holder = None
    for turn, question in enumerate(TURNS):
        messages.append({"role": "user", "content": question})
        time.sleep(1.5)  # the agent thinks; the scheduler hears of the cached blocks meanwhile
        before = decode_queries(guarded_cluster)
        body = {"model": "smollm2", "messages": messages, "max_tokens": 12, "temperature": 0}
        response = httpx.post(
            guarded_cluster.url + "/v1/chat/completions", json=body, headers=headers, timeout=300
        )
        assert response.status_code == 200, response.text
        answer = response.json()["choices"][0]["message"]["content"]
        assert answer == reference_turns(smollm2, messages), turn
        served_by = decode_worker_of(guarded_cluster, response.json()["id"])
        if turn == 0:
            first_holder = served_by
        if turn == 1:
            holder = served_by
            assert holder == first_holder  # the cache-aware pick: the worker holding turn 1
            time.sleep(1.5)  # the workers' counters ride on heartbeats
            after = decode_queries(guarded_cluster)
            grown = {peer for peer in after if after[peer] > before.get(peer, 0)}
            assert grown <= {holder}, (grown, holder)  # a local prefill only where it is cached
            os.kill(worker_pid(guarded_cluster.process.pid, holder), signal.SIGKILL)
        messages.append({"role": "assistant", "content": answer})
    assert holder is not None
    wait_for_workers(guarded_cluster, num_prefill=2, num_decode=2)
    info = guarded_cluster.wait_blocks_free(timeout_s=60)
    assert all(w["free_blocks"] == w["total_blocks"] for w in info["workers"]), info
