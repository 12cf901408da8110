"""A chat request's prompt: tools through the model's own template when it teaches a call format
we parse (templates of each family, written for these tests, on the real tokenizer), else the
fallback format; a conversation the template refuses is a 400."""

from __future__ import annotations

import copy
import json

import pytest
from transformers import AutoTokenizer

from services.gateway.chat_prompt import chat_prompt_ids, read_chat_template
from services.gateway.openai_protocol import ApiError, parse_chat_request
from services.gateway.service import use_chat_template
from services.gateway.tool_formats import LLAMA3_JSON, MISTRAL, TAGGED, template_tool_format
from shared.config import ConfigError
from shared.engine.model_files import resolve_model_dir
from tests.helpers import chat_template

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
TAGGED_TEMPLATE = chat_template("tagged_tools.jinja")
MISTRAL_TEMPLATE = chat_template("mistral_tools.jinja")
LLAMA3_TEMPLATE = chat_template("llama3_tools.jinja")


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir()[0])


def with_template(tokenizer, template: str):
    copied = copy.deepcopy(tokenizer)
    copied.chat_template = template
    return copied


@pytest.fixture(scope="module")
def tagged(tokenizer):
    return with_template(tokenizer, TAGGED_TEMPLATE)


def prompt_text(tokenizer, messages=HISTORY, **fields) -> str:
    body = {"model": MODEL, "messages": messages, **fields}
    request = parse_chat_request(body, MODEL, 2048)
    ids = chat_prompt_ids(tokenizer, request, template_tool_format(tokenizer) is not None)
    return tokenizer.decode(ids)


def test_the_template_tells_the_call_format(tokenizer, tagged):
    assert template_tool_format(tokenizer) is None  # SmolLM2's template knows no tools
    assert template_tool_format(tagged) is TAGGED
    assert template_tool_format(with_template(tokenizer, MISTRAL_TEMPLATE)) is MISTRAL
    assert template_tool_format(with_template(tokenizer, LLAMA3_TEMPLATE)) is LLAMA3_JSON
    other = with_template(tokenizer, "{% for m in messages %}{{ m.content }}{% endfor %}{{tools}}")
    assert template_tool_format(other) is None  # tools, but calls in a format we cannot parse


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


def test_a_mistral_template_renders_tools_calls_and_results_its_own_way(tokenizer):
    mistral = with_template(tokenizer, MISTRAL_TEMPLATE)
    history = copy.deepcopy(HISTORY)
    history[1]["tool_calls"][0]["id"] = history[2]["tool_call_id"] = "aB3dE6gH9"
    text = prompt_text(mistral, history, tools=[WEATHER])
    listed = text.split("[AVAILABLE_TOOLS]", 1)[1].split("[/AVAILABLE_TOOLS]", 1)[0]
    assert json.loads(listed) == [WEATHER]
    call = '[{"name": "get_weather", "arguments": {"city": "Oslo"}, "id": "aB3dE6gH9"}]'
    assert "[TOOL_CALLS]" + call in text
    assert '[TOOL_RESULTS]{"content": "Snow, -3 C", "call_id": "aB3dE6gH9"}' in text
    assert "You may call these tools" not in text


def test_a_conversation_the_template_refuses_is_a_clear_400(tokenizer):
    mistral = with_template(tokenizer, MISTRAL_TEMPLATE)
    with pytest.raises(ApiError) as refused:
        prompt_text(mistral, HISTORY, tools=[WEATHER])  # "call_1": not nine characters
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "nine letters or digits" in refused.value.message


def test_a_llama3_template_renders_calls_with_parameters(tokenizer):
    llama = with_template(tokenizer, LLAMA3_TEMPLATE)
    text = prompt_text(llama, tools=[WEATHER])
    assert '{"name": "get_weather", "parameters": {"city": "Oslo"}}' in text
    assert "ipython<|end_header_id|>\nSnow, -3 C" in text
    assert json.dumps(WEATHER) in text and "You may call" not in text


def test_a_chat_template_file_is_used_or_refused(tokenizer, tmp_path):
    path = tmp_path / "template.jinja"
    path.write_text(LLAMA3_TEMPLATE)
    assert read_chat_template(str(path)) == LLAMA3_TEMPLATE
    with pytest.raises(ConfigError, match="chat_template.*cannot read"):
        read_chat_template(str(tmp_path / "missing.jinja"))
    served = copy.deepcopy(tokenizer)
    use_chat_template(served, str(path))
    assert template_tool_format(served) is LLAMA3_JSON
    path.write_text("{% for m in messages %}{{ m.content }")  # unclosed: cannot render
    with pytest.raises(ConfigError, match="chat_template .--chat-template.: .*template.jinja"):
        use_chat_template(served, str(path))


def test_a_model_without_a_chat_template_answers_chat_with_a_400(tokenizer):
    """A base model's tokenizer has no template: transformers' ValueError was a 500."""
    base = with_template(tokenizer, None)
    with pytest.raises(ApiError) as refused:
        prompt_text(base, [{"role": "user", "content": "Hi"}])
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert "no chat template" in refused.value.message


def test_the_prompt_starts_with_one_bos_even_where_the_template_writes_it(tokenizer):
    """The template renders the BOS (SmolLM2's is `<|im_start|>`, its first turn's opener);
    tokenizing the rendered text must not add another, whatever the template."""
    bos = tokenizer.bos_token_id
    for template in (tokenizer.chat_template, "{{ bos_token }}{{ messages[0].content }}"):
        served = with_template(tokenizer, template)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}
        ids = chat_prompt_ids(served, parse_chat_request(body, MODEL, 2048), False)
        assert ids[0] == bos and ids[1] != bos


def test_a_chat_template_files_byte_order_mark_is_not_rendered(tokenizer, tmp_path):
    """A file saved with a BOM put U+FEFF's three tokens before the BOS of every prompt."""
    path = tmp_path / "template.jinja"
    path.write_text(tokenizer.chat_template, encoding="utf-8-sig")
    assert read_chat_template(str(path)) == tokenizer.chat_template
