"""Completions with a batch of prompts (`"prompt": ["a", "b"]` or `[[1, 2], [3]]`), as OpenAI
takes them: one request per prompt, run side by side, answered as one.

The body is split into one body per prompt, each parsed and prepared as a request of its own
(the same validation: any prompt's error refuses the whole before anything runs). The answer
is OpenAI's: prompt j's choice i is choice `j * n + i`, the usage sums the prompts', and a
stream interleaves the prompts' chunks as they come (with `include_usage`, one usage chunk at
the end for all). A refusal or failure of any prompt ends the whole request and cancels the
rest.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from services.gateway.generation import ChoiceEvent, Generation, Generator
from services.gateway.openai_protocol import bad_request, is_int
from services.gateway.openai_shapes import usage_chunk, usage_dict
from services.gateway.responses import StreamChunks, collect_response, first_event

MAX_PROMPTS = 64  # prompts in one request (each with its `n` choices)


def split_prompts(body: Any) -> list[dict[str, Any]] | None:
    """One body per prompt when `body` is a completion with two prompts or more; None when it
    is anything else (a single prompt, or no body the parser would take: it refuses it). A
    list of two or more that is neither is refused here."""
    if not isinstance(body, dict):
        return None
    prompts = body.get("prompt")
    if not isinstance(prompts, list) or len(prompts) < 2:
        return None
    if all(is_int(p) for p in prompts):
        return None  # one prompt's token ids (the parser checks them)
    if not all(isinstance(p, (str, list)) for p in prompts):
        # (The one-prompt parser would call it a batch, taken "by HTTP /v1/completions only".)
        raise bad_request(
            "prompt", "must be a string or a list of token ids, or a list of those (a batch)"
        )
    if len(prompts) > MAX_PROMPTS:
        raise bad_request("prompt", f"at most {MAX_PROMPTS} prompts in one request")
    return [{**body, "prompt": prompt} for prompt in prompts]


async def batched_response(
    generator: Generator, generations: list[Generation], tenant: str
) -> dict[str, Any]:
    """The whole answer to the prompts once every choice of every prompt has finished (under
    the first prompt's id)."""
    try:
        async with asyncio.TaskGroup() as group:  # one failing cancels the others
            tasks = [
                group.create_task(collect_response(g, generator.events(g, tenant)))
                for g in generations
            ]
    except BaseExceptionGroup as failed:  # the first prompt's error is the request's
        raise failed.exceptions[0] from None
    responses = [task.result() for task in tasks]
    n = generations[0].request.n
    choices = [
        {**choice, "index": j * n + choice["index"]}
        for j, response in enumerate(responses)
        for choice in response["choices"]
    ]
    usage = _usage(generations, sum(r["usage"]["completion_tokens"] for r in responses))
    return {**responses[0], "choices": choices, "usage": usage}


def _usage(generations: list[Generation], num_completion_tokens: int) -> dict:
    return usage_dict(
        sum(g.num_prompt_tokens for g in generations),
        num_completion_tokens,
        sum(g.num_cached_tokens for g in generations),
    )


async def first_events(
    generator: Generator, generations: list[Generation], tenant: str
) -> list[tuple[AsyncIterator[ChoiceEvent], ChoiceEvent | None]]:
    """Every prompt's events started side by side, and each one's first event awaited: a
    refusal (429, 503) still answers with a status. A prompt refused, or the wait cancelled
    (the client gone), closes them all, which cancels their cluster requests."""
    streams = [generator.events(generation, tenant) for generation in generations]
    try:
        async with asyncio.TaskGroup() as group:  # one failing cancels the others
            firsts = [group.create_task(first_event(events)) for events in streams]
    except BaseException as failed:
        for events in streams:
            await events.aclose()  # type: ignore[attr-defined]
        if isinstance(failed, BaseExceptionGroup):  # the first prompt's error is the request's
            raise failed.exceptions[0] from None
        raise
    return [(events, first.result()) for events, first in zip(streams, firsts, strict=True)]


async def batched_chunks(
    generations: list[Generation],
    started: list[tuple[AsyncIterator[ChoiceEvent], ChoiceEvent | None]],
) -> AsyncIterator[dict[str, Any]]:
    """The prompts' stream chunks as they come, choice indices made the batch's; with
    `include_usage`, the usage of all at the end. Raises the first prompt's error."""
    merged: asyncio.Queue[tuple[int, ChoiceEvent | None | BaseException]] = asyncio.Queue()
    n = generations[0].request.n

    async def pump(j: int, events: AsyncIterator[ChoiceEvent], first: ChoiceEvent | None) -> None:
        try:
            if first is not None:
                await merged.put((j, first))
            async for event in events:
                await merged.put((j, event))
            await merged.put((j, None))
        except Exception as error:  # the consumer raises it, ending the stream
            await merged.put((j, error))

    pumps = [asyncio.create_task(pump(j, *pair)) for j, pair in enumerate(started)]
    chunks = [StreamChunks(g) for g in generations]
    first = generations[0]
    num_tokens, running = 0, len(generations)
    try:
        while running:
            j, item = await merged.get()
            if item is None:
                running -= 1
                continue
            if isinstance(item, BaseException):
                raise item
            num_tokens += len(item.token_ids)
            for chunk in chunks[j].chunks(item):
                # one response's: the first prompt's id, every choice's index
                chunk.update(id=first.request_id, created=first.created)
                chunk["choices"][0]["index"] += j * n
                yield chunk
        if first.request.include_usage:
            usage = _usage(generations, num_tokens)
            yield usage_chunk(first.request_id, first.request.model, first.created, usage,
                              chat=False)  # fmt: skip
    finally:
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)
        for events, _ in started:
            await events.aclose()
