"""OpenAI response shapes assembled from a generation's choice events, for HTTP and RPC alike."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from typing import Any

from services.gateway.generation import ChoiceEvent, Generation
from services.gateway.openai_shapes import (
    ChoiceResult,
    TokenLogprob,
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


async def first_event(events: AsyncIterator[ChoiceEvent]) -> ChoiceEvent | None:
    """The events' first (None when there is none), awaited before a stream's answer starts, so
    that a refusal (429, 503) still answers with a status."""
    try:
        return await anext(events)
    except StopAsyncIteration:
        return None


class StreamChunks:
    """A generation's stream chunks, event by event: each chat choice's first chunk carries the
    role; with tools, calls are cut out of the text as it streams (services.gateway.tool_output),
    so a chunk may carry `tool_calls` deltas, and an event whose text is held back sends none."""

    def __init__(self, generation: Generation) -> None:
        self.generation = generation
        self._role_sent: set[int] = set()
        self._text_offsets: dict[int, int] = {}  # per choice: where its next token's text starts
        tools, n = generation.request.tools, generation.request.n
        self._parsers = None
        if tools is not None:
            self._parsers = [ToolCallParser(tools, generation.tool_format) for _ in range(n)]

    def chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        """The event's chunks: none when it has nothing to send, two when it ends a choice with
        tool calls (below). Asked with include_usage, every chunk carries `"usage": null` until
        the last one's (OpenAI's shape)."""
        chunks = self._chunks(event)
        if self.generation.request.include_usage:
            for chunk in chunks:
                chunk["usage"] = None
        return chunks

    def _chunks(self, event: ChoiceEvent) -> list[dict[str, Any]]:
        generation, req = self.generation, self.generation.request
        if not req.chat:
            logprobs = None
            if event.logprobs is not None:  # offsets run on from the choice's earlier chunks
                offset = self._text_offsets.get(event.index, 0)
                logprobs = completion_logprobs(event.logprobs, offset)
                self._text_offsets[event.index] = offset + sum(len(t.text) for t in event.logprobs)
            return [completion_chunk(
                generation.request_id, req.model, generation.created,
                event.index, event.text, event.finish_reason, logprobs,
            )]  # fmt: skip
        logprobs = chat_logprobs(event.logprobs) if event.logprobs is not None else None
        first = event.index not in self._role_sent
        self._role_sent.add(event.index)
        content, calls, finish = event.text, None, event.finish_reason
        if self._parsers is not None:
            content, calls, finish = self._cut_calls(event)
            if not (content or calls or first or logprobs or finish):
                return []
        # Calls and the choice's end come apart, the end in a chunk of its own (as OpenAI ends
        # every choice): the openai SDK's stream helper reads a chunk's finish reason before its
        # calls, and never said a call's arguments were done (a forced call comes whole at the
        # end, being judged there).
        apart = calls is not None and finish is not None
        shaped = [chat_chunk(
            generation.request_id, req.model, generation.created, event.index,
            content, None if apart else finish, logprobs, role_first=first, tool_calls=calls,
        )]  # fmt: skip
        if apart:
            shaped.append(chat_chunk(
                generation.request_id, req.model, generation.created, event.index,
                None, finish, None,
            ))  # fmt: skip
        return shaped

    def _cut_calls(self, event: ChoiceEvent) -> tuple[str | None, list | None, str | None]:
        parser = self._parsers[event.index]
        out = parser.push(event.text)
        finish = event.finish_reason
        if finish is not None:
            rest = parser.finish()
            out.content += rest.content
            out.calls += rest.calls
            if parser.num_calls and finish != "length":  # (see `collect_response`)
                finish = "tool_calls"
        return out.content or None, out.calls or None, finish


def best_of(
    candidates: list[ChoiceResult], logprobs: list[list[TokenLogprob]], n: int
) -> list[ChoiceResult]:
    """The `n` candidates of highest mean logprob per generated token (OpenAI's "best"), best
    first, numbered from 0; a candidate without tokens ranks last, as does one with a NaN
    logprob (a model's broken logits: shown as the floor, and a NaN key left the sort's order
    to chance)."""

    def mean_logprob(i: int) -> float:
        num_tokens = len(candidates[i].token_ids)
        if num_tokens == 0:
            return -math.inf
        generated = logprobs[i][len(logprobs[i]) - num_tokens :]  # (after an echoed prompt's)
        mean = sum(token.logprob or 0.0 for token in generated) / num_tokens
        return -math.inf if math.isnan(mean) else mean

    ranked = sorted(range(len(candidates)), key=mean_logprob, reverse=True)[:n]
    return [dataclasses.replace(candidates[i], index=new) for new, i in enumerate(ranked)]


def final_usage_chunk(generation: Generation, num_completion_tokens: int) -> dict[str, Any]:
    req = generation.request
    usage = usage_dict(
        generation.num_prompt_tokens, num_completion_tokens, generation.num_cached_tokens
    )
    return usage_chunk(generation.request_id, req.model, generation.created, usage, chat=req.chat)


async def collect_response(
    generation: Generation, events: AsyncIterator[ChoiceEvent]
) -> dict[str, Any]:
    """The whole (non-streaming) response once every choice has finished; with `best_of`, the
    n best of its candidates (the usage counts every candidate's tokens, as OpenAI bills)."""
    req = generation.request
    count = req.num_candidates
    texts = [""] * count
    token_ids: list[list[int]] = [[] for _ in range(count)]
    logprobs: list[list[TokenLogprob]] = [[] for _ in range(count)]
    finish: list[str] = ["length"] * count
    async for event in events:
        texts[event.index] += event.text
        token_ids[event.index] += event.token_ids
        if event.logprobs is not None:
            logprobs[event.index] += event.logprobs
        if event.finish_reason is not None:
            finish[event.index] = event.finish_reason
    asked = req.logprobs is not None
    choices = [
        ChoiceResult(i, texts[i], finish[i], token_ids[i], logprobs[i] if asked else None)
        for i in range(count)
    ]
    if count > req.n:
        choices = best_of(choices, logprobs, req.n)
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
                # A cut answer says so, calls or not: what followed its calls (a call being
                # written) was lost, and "tool_calls" told the client the answer was whole
                # (the Responses API said `completed`, with no `incomplete_details`).
                if choice["finish_reason"] != "length":
                    choice["finish_reason"] = "tool_calls"
    return response
