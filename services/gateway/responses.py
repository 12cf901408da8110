"""OpenAI response shapes assembled from a generation's choice events, for HTTP and RPC alike."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from services.gateway.generation import ChoiceEvent, Generation
from services.gateway.openai_shapes import (
    ChoiceResult,
    chat_chunk,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_logprobs,
    completion_response,
    usage_chunk,
    usage_dict,
)
from services.gateway.tool_output import ToolCallParser, extract_tool_calls


class StreamChunks:
    """A generation's stream chunks, event by event: each chat choice's first chunk carries the
    role; with tools, calls are cut out of the text as it streams (services.gateway.tool_output),
    so a chunk may carry `tool_calls` deltas, and an event whose text is held back sends none."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._role_sent: set[int] = set()
        tools, n = generation.request.tools, generation.request.n
        self._parsers = None
        if tools is not None:
            self._parsers = [ToolCallParser(tools, generation.tool_format) for _ in range(n)]

    def chunk(self, event: ChoiceEvent) -> dict[str, Any] | None:
        """The event's chunk; None when it has nothing to send."""
        generation, req = self.generation, self.generation.request
        if not req.chat:
            logprobs = completion_logprobs(event.logprobs) if event.logprobs is not None else None
            return completion_chunk(
                generation.request_id, req.model, generation.created,
                event.index, event.text, event.finish_reason, logprobs,
            )  # fmt: skip
        logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
        first = event.index not in self._role_sent
        self._role_sent.add(event.index)
        content, calls, finish = event.text, None, event.finish_reason
        if self._parsers is not None:
            content, calls, finish = self._cut_calls(event)
            if not (content or calls or first or logprobs or finish):
                return None
        return chat_chunk(
            generation.request_id, req.model, generation.created, event.index,
            content, finish, logprobs, role_first=first, tool_calls=calls,
        )  # fmt: skip

    def _cut_calls(self, event: ChoiceEvent) -> tuple[str | None, list | None, str | None]:
        parser = self._parsers[event.index]
        out = parser.push(event.text)
        finish = event.finish_reason
        if finish is not None:
            rest = parser.finish()
            out.content += rest.content
            out.calls += rest.calls
            if parser.num_calls:
                finish = "tool_calls"
        return out.content or None, out.calls or None, finish


def final_usage_chunk(generation: Generation, num_completion_tokens: int) -> dict[str, Any]:
    req = generation.request
    usage = usage_dict(
        generation.num_prompt_tokens, num_completion_tokens, generation.num_cached_tokens
    )
    return usage_chunk(generation.request_id, req.model, generation.created, usage, chat=req.chat)


async def collect_response(
    generation: Generation, events: AsyncIterator[ChoiceEvent]
) -> dict[str, Any]:
    """The whole (non-streaming) response once every choice has finished."""
    req = generation.request
    texts = [""] * req.n
    token_ids: list[list[int]] = [[] for _ in range(req.n)]
    logprobs: list[list | None] = [[] if req.logprobs is not None else None for _ in range(req.n)]
    finish: list[str] = ["length"] * req.n
    async for event in events:
        texts[event.index] += event.text
        token_ids[event.index] += event.token_ids
        if event.logprobs is not None and logprobs[event.index] is not None:
            logprobs[event.index] += event.logprobs
        if event.finish_reason is not None:
            finish[event.index] = event.finish_reason
    choices = [
        ChoiceResult(i, texts[i], finish[i], token_ids[i], logprobs[i]) for i in range(req.n)
    ]
    usage = usage_dict(
        generation.num_prompt_tokens,
        sum(len(t) for t in token_ids),
        generation.num_cached_tokens,
    )
    build = chat_response if req.chat else completion_response
    response = build(generation.request_id, req.model, generation.created, choices, usage)
    if req.tools is not None:
        for choice in response["choices"]:
            text = choice["message"]["content"]
            content, calls = extract_tool_calls(req.tools, text, generation.tool_format)
            if calls:
                choice["message"].update(content=content, tool_calls=calls)
                choice["finish_reason"] = "tool_calls"
    return response
