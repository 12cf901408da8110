"""The call format a tokenizer's chat template teaches (services.gateway.tool_formats)."""

from __future__ import annotations

import copy

import pytest
from transformers import AutoTokenizer

from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.openai_protocol import parse_chat_request
from services.gateway.tool_formats import TAGGED, template_tool_format
from shared.engine.model_files import resolve_model_dir
from tests.helpers import chat_template

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {}}},
}


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(resolve_model_dir()[0])


def test_named_templates_tell_the_format_of_the_one_that_renders_tools(tokenizer):
    """A tokenizer may hold a `default` template that knows no tools and a `tool_use` one (as
    Hermes 2 Pro's): transformers renders a request with tools through `tool_use`, but the
    format was read off `default`, so the model's own tool prompt was never used (the fallback
    format's was, through `default`)."""
    named = copy.deepcopy(tokenizer)
    plain = tokenizer.chat_template
    named.chat_template = {"default": plain, "tool_use": chat_template("tagged_tools.jinja")}
    assert template_tool_format(named) is TAGGED
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": [WEATHER]}
    request = parse_chat_request(body, MODEL, 2048)
    prompt = named.decode(chat_prompt_ids(named, request, template_tools=True))
    assert "<tools>" in prompt and "get_weather" in prompt  # the tool_use template's
    tools_only_in_default = copy.deepcopy(tokenizer)
    tools_only_in_default.chat_template = {"default": chat_template("tagged_tools.jinja")}
    assert template_tool_format(tools_only_in_default) is TAGGED
