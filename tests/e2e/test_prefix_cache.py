"""The prefix cache through the served cluster: a repeated system prompt is reported as cached
tokens (HTTP and RPC), the answers do not change, and idle workers hold no referenced block."""

from __future__ import annotations

import pytest

from services.gateway.rpc_client import TandemClient

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
