"""A chat request's prompt tokens: the model's chat template, given tools its own way when the
template teaches a call format our parser reads, else the documented fallback.

Templates that render tools (Hermes' and Qwen2.5's tagged calls, Mistral's `[TOOL_CALLS]`, Llama
3's bare JSON: services.gateway.tool_formats) take the tools as `tools=[...]` and assistant
`tool_calls` as structured messages; for those the model sees its own instructions, and the
generation's calls are parsed in that format. A template that never mentions tools (the default
SmolLM2's) would drop them silently, and one with a call format not listed there would teach the
model calls we could not parse; both get the fallback format
(services.gateway.tools.fallback_messages).
"""

from __future__ import annotations

from jinja2 import TemplateError

from services.gateway.openai_protocol import GenerationRequest, bad_request
from shared.config import ConfigError


def chat_prompt_ids(
    tokenizer, request: GenerationRequest, template_tools: bool, add_generation_prompt: bool = True
) -> list[int]:
    """The prompt of a chat request; `template_tools`: the template renders tools in a format
    we parse (tool_formats.template_tool_format); `add_generation_prompt`: the assistant turn's
    opening after the messages (always, to generate; /tokenize may leave it out). A
    conversation the template refuses (its `raise_exception`, e.g. Mistral's call ids of nine
    characters) is the client's error."""
    return list(_applied_template(tokenizer, request, template_tools, True, add_generation_prompt))


def chat_prompt_text(tokenizer, request: GenerationRequest, template_tools: bool) -> str:
    """The text `chat_prompt_ids` tokenizes (without the special tokens a tokenizer adds)."""
    return _applied_template(tokenizer, request, template_tools, tokenize=False)


def _applied_template(
    tokenizer,
    request: GenerationRequest,
    template_tools: bool,
    tokenize: bool,
    add_generation_prompt: bool = True,
):
    if getattr(tokenizer, "chat_template", None) is None:
        # (transformers raises a ValueError, which was a 500 on every chat with a base model)
        raise bad_request(
            "messages",
            "this model has no chat template: send a prompt to /v1/completions, or start the "
            "gateway with --chat-template FILE",
        )
    try:
        if template_tools:
            tools = request.tools.template_tools() if request.tools is not None else None
            return tokenizer.apply_chat_template(
                request.template_messages, tools=tools,
                add_generation_prompt=add_generation_prompt, tokenize=tokenize, return_dict=False,
            )  # fmt: skip
        return tokenizer.apply_chat_template(
            request.messages,
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            return_dict=False,
        )
    except TemplateError as error:
        raise bad_request("messages", f"the model's chat template refused them: {error}") from None


def read_chat_template(path: str) -> str:
    """The template's text; a byte order mark (editors on Windows write one) is dropped, or
    every prompt would begin with its tokens, before the model's BOS."""
    try:
        with open(path, encoding="utf-8-sig") as file:
            template = file.read()
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"chat_template (--chat-template): cannot read {path}: {error}") from None
    return template
