"""A chat request's prompt: tools through the model's own template when it renders them as
tagged calls (a template of that family, on the real tokenizer), else the fallback format."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from services.gateway.chat_prompt import chat_prompt_ids, renders_tagged_tools
from services.gateway.openai_protocol import parse_chat_request
from shared.engine.loader import resolve_model_dir

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "Snow, -3 C"},
]  # fmt: skip
# A template of the tagged-call family (tools listed in the system turn, calls and results in
# tags), written for this test.
TAGGED_TEMPLATE = """\
{%- if tools %}<|im_start|>system
Tools:<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.tool_calls %}<|im_start|>assistant
{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}</tool_call>{% endfor %}\
<|im_end|>
{% elif message.role == "tool" %}<|im_start|>user
<tool_response>{{ message.content }}</tool_response><|im_end|>
{% else %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir()[0])


@pytest.fixture(scope="module")
def tagged(tokenizer):
    tagged = copy.deepcopy(tokenizer)
    tagged.chat_template = TAGGED_TEMPLATE
    return tagged


def prompt_text(tokenizer, **fields) -> str:
    body = {"model": MODEL, "messages": HISTORY, **fields}
    request = parse_chat_request(body, MODEL, 2048)
    ids = chat_prompt_ids(tokenizer, request, renders_tagged_tools(tokenizer))
    return tokenizer.decode(ids)


def test_only_a_template_that_writes_tagged_calls_renders_tools(tokenizer, tagged):
    assert not renders_tagged_tools(tokenizer)  # SmolLM2's template knows no tools
    assert renders_tagged_tools(tagged)
    other = copy.deepcopy(tokenizer)
    other.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}{{ tools }}"
    assert not renders_tagged_tools(other)  # tools, but calls in a format we cannot parse


def test_a_tagged_template_renders_tools_and_history_its_own_way(tagged):
    text = prompt_text(tagged, tools=[WEATHER])
    listed = text.split("<tools>", 1)[1].split("</tools>", 1)[0]
    assert json.loads(listed) == WEATHER  # the tool in OpenAI's form, as templates take it
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    assert "<tool_response>Snow, -3 C</tool_response>" in text
    assert "You may call these tools" not in text  # not the fallback's instructions
    assert text.endswith("<|im_start|>assistant\n")


def test_other_templates_get_the_fallback_format(tokenizer):
    text = prompt_text(tokenizer, tools=[WEATHER])
    assert "You may call these tools" in text and '"get_weather"' in text
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text
    # Without tools, the history's calls are still shown as the model would have written them.
    assert "<tool_call>" in prompt_text(tokenizer) and "You may call" not in prompt_text(tokenizer)
