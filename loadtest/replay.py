"""Replays a workload against an OpenAI-compatible server and measures what its clients see.

Every request is a streamed `/v1/completions` call (greedy, `ignore_eos`, `stream_options:
include_usage`), sent at its arrival time (or all at once) on its own connection, so that a slow
request never queues another in the client. Each record notes when the request was sent, when
each chunk of tokens arrived and when the stream ended; the final usage chunk gives the number of
tokens, which must equal `max_tokens` since EOS is ignored. Anything that goes wrong (an HTTP
error, an error event in the stream, a missing usage chunk, a wrong count, a timeout) is recorded
on the request, never raised, so one bad request cannot hide the rest of the run.

Bounded twice: `timeout_s` per request, and a global `deadline_s` after which every request still
running is cancelled and recorded as such. Requests go only to the given base URL (no redirects,
no proxies from the environment).

    .venv/bin/python -m loadtest.replay --url http://127.0.0.1:8000 --model smollm2 \\
        --workload loadtest/workloads/mixed64.jsonl [--burst] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from loadtest.metrics import Clock, RequestRecord, Result, format_summary, summarize
from loadtest.workload import WorkloadRequest, read_workload

COMPLETIONS_PATH = "/v1/completions"
MAX_ERROR_CHARS = 500


def request_body(
    model: str, request: WorkloadRequest, send_text: bool = False, user: str | None = None
) -> dict[str, Any]:
    prompt: Any = request.prompt
    if request.prompt_token_ids is not None and not send_text:
        prompt = request.prompt_token_ids  # exact: no tokenizer round trip on the server
    return {
        **({"user": user} if user is not None else {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": request.ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


async def sse_events(response: httpx.Response) -> AsyncIterator[str]:
    """The `data` of each server-sent event; multi-line data is joined with newlines."""
    data: list[str] = []
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
        elif not line and data:
            yield "\n".join(data)
            data = []
    if data:
        yield "\n".join(data)


class StreamError(Exception):
    """The server answered, but not with a well-formed, complete stream."""


async def consume_stream(response: httpx.Response, record: RequestRecord, clock: Clock) -> None:
    done = False
    async for data in sse_events(response):
        now = clock()
        if data == "[DONE]":
            done = True
            break
        event = json.loads(data)
        if "error" in event:
            raise StreamError(f"error event: {json.dumps(event['error'])[:MAX_ERROR_CHARS]}")
        if event.get("choices"):
            record.chunk_times.append(now)
            if record.first_token_time is None:
                record.first_token_time = now
        if event.get("usage"):
            record.completion_tokens = int(event["usage"]["completion_tokens"])
    record.finish_time = clock()
    if not done:
        raise StreamError("the stream ended without [DONE]")


def check_counts(record: RequestRecord, request: WorkloadRequest) -> None:
    if record.completion_tokens is None:
        raise StreamError("no usage chunk (stream_options.include_usage)")
    if request.ignore_eos and record.completion_tokens != request.max_tokens:
        raise StreamError(
            f"completion_tokens {record.completion_tokens} != max_tokens {request.max_tokens}"
        )


async def send_one(
    client: httpx.AsyncClient,
    model: str,
    request: WorkloadRequest,
    record: RequestRecord,
    clock: Clock,
    honor_arrivals: bool,
    timeout_s: float,
    send_text: bool,
    user: str | None = None,  # the tenant it is charged to
) -> None:
    if honor_arrivals:
        await asyncio.sleep(max(0.0, request.arrival_time - clock()))
    record.send_time = clock()
    try:
        async with asyncio.timeout(timeout_s):
            body = request_body(model, request, send_text, user)
            async with client.stream("POST", COMPLETIONS_PATH, json=body) as response:
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise StreamError(f"HTTP {response.status_code}: {text[:MAX_ERROR_CHARS]}")
                await consume_stream(response, record, clock)
        check_counts(record, request)
    except TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
    except Exception as error:  # recorded, not raised: the run goes on
        record.error = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]


async def replay(
    url: str,
    model: str,
    requests: Sequence[WorkloadRequest],
    *,
    honor_arrivals: bool = True,
    timeout_s: float = 600.0,
    deadline_s: float = 3600.0,
    send_text: bool = False,
    slo_ttft_s: float | None = None,
    slo_tpot_s: float | None = None,
    name: str = "replay",
) -> Result:
    """Sends every request to `url` (the server's base URL) and returns the measured result."""
    records = [RequestRecord(i, r.max_tokens, r.num_prompt_tokens) for i, r in enumerate(requests)]
    limits = httpx.Limits(max_connections=max(1, len(requests)), max_keepalive_connections=0)
    async with httpx.AsyncClient(
        base_url=url,
        trust_env=False,
        follow_redirects=False,
        limits=limits,
        timeout=httpx.Timeout(timeout_s),
    ) as client:
        clock = Clock()
        tasks = [
            asyncio.create_task(
                send_one(client, model, r, rec, clock, honor_arrivals, timeout_s, send_text)
            )
            for r, rec in zip(requests, records, strict=True)
        ]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.error is None and record.finish_time is None:
            record.error = f"cancelled at the global deadline of {deadline_s:g} s"
    summary = summarize(records, slo_ttft_s, slo_tpot_s)
    extra = {"url": url, "model": model, "honor_arrivals": honor_arrivals}
    return Result(name, summary, records, extra)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--workload", default="loadtest/workloads/mixed64.jsonl")
    parser.add_argument("--burst", action="store_true", help="send all at once, ignoring arrivals")
    parser.add_argument("--send-text", action="store_true", help="send prompts as text, not ids")
    parser.add_argument("--timeout", type=float, default=600.0, help="per request, seconds")
    parser.add_argument("--deadline", type=float, default=3600.0, help="whole run, seconds")
    parser.add_argument("--slo-ttft", type=float, default=None, help="goodput objective, seconds")
    parser.add_argument("--slo-tpot", type=float, default=None, help="goodput objective, seconds")
    parser.add_argument("--json", help="write the summary and per-request records here")
    args = parser.parse_args(argv)
    requests = read_workload(args.workload)
    result = asyncio.run(
        replay(
            args.url,
            args.model,
            requests,
            honor_arrivals=not args.burst,
            timeout_s=args.timeout,
            deadline_s=args.deadline,
            send_text=args.send_text,
            slo_ttft_s=args.slo_ttft,
            slo_tpot_s=args.slo_tpot,
        )
    )
    print(format_summary(result.summary))
    for record in result.records:
        if record.error:
            print(f"request {record.index}: {record.error}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result.to_dict(), f, indent=2)


if __name__ == "__main__":
    main()
