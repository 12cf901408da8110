"""A chat request's prompt tokens: the model's chat template, given tools its own way when the
template renders them in the format our parser reads, else the documented fallback.

Templates that render tools (Qwen2.5's, Hermes', and others in the same family) take the tools
as `tools=[...]` and assistant `tool_calls` as structured messages, and teach the model to answer
`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: exactly the tagged format
services.gateway.tool_output parses. For those the model sees its own instructions. A template
that never mentions tools (the default SmolLM2's) would drop them silently, and one with another
call format (Llama 3.1's bare JSON, Mistral's [TOOL_CALLS]) would teach the model calls we could
not parse; both get the fallback format (services.gateway.tools.fallback_messages).
"""

from __future__ import annotations

from services.gateway.openai_protocol import GenerationRequest

TAGGED_CALL = "<tool_call>"


def renders_tagged_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template takes `tools` and writes tagged calls."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: the default one renders chats
        template = template.get("default") or template.get("tool_use")
    return isinstance(template, str) and "tools" in template and TAGGED_CALL in template


def chat_prompt_ids(tokenizer, request: GenerationRequest, template_tools: bool) -> list[int]:
    """The prompt of a chat request; `template_tools` is renders_tagged_tools(tokenizer)."""
    if template_tools:
        tools = request.tools.template_tools() if request.tools is not None else None
        ids = tokenizer.apply_chat_template(
            request.template_messages, tools=tools, add_generation_prompt=True,
            tokenize=True, return_dict=False,
        )  # fmt: skip
    else:
        ids = tokenizer.apply_chat_template(
            request.messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    return list(ids)
