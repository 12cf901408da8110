"""The HTTP client of `tandem bench` (and the other benchmarks): a workload against any
OpenAI-compatible server, measured as its clients see it.

Every request is a `/v1/completions` call (greedy, `ignore_eos`), streamed with `stream_options:
include_usage` unless the request says otherwise, sent at its arrival time (or all at once) on its
own connection, so that a slow request never queues another in the client. Each record notes
when the request was due (scheduled: the run's start plus its arrival time, counted from the
workload's first arrival, so a log's Unix timestamps replay from its start), when it went on the
wire (sent: httpcore's trace event as its request headers start to be written, after the body is
built and the connection opened, so that the client's own work in a burst is not charged to the
server's TTFT but shows as send lateness), when each chunk carrying output arrived (a chunk with
only a finish reason or the usage, as llama.cpp's server ends a stream, is no token) and when it
ended; the usage gives the number of tokens, which must equal `max_tokens` since EOS is ignored,
and the prompt tokens the server took from its cache (`prompt_tokens_details.cached_tokens`).
Anything that goes wrong (an HTTP error, an error event in the stream, a missing usage, a wrong
count, a timeout) is recorded on the request, never raised, so one bad request cannot hide the
rest of the run.

Bounded twice: `timeout_s` per request, and a global `deadline_s` after which every request still
running is cancelled and recorded as such. Requests go only to the given base URL (no redirects,
no proxies from the environment).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import httpx

from loadtest.metrics import Clock, RequestRecord, Result, summarize
from loadtest.workload import WorkloadRequest

COMPLETIONS_PATH = "/v1/completions"
MAX_ERROR_CHARS = 500


def request_body(
    model: str, request: WorkloadRequest, send_text: bool = False, user: str | None = None
) -> dict[str, Any]:
    prompt: Any = request.prompt
    if request.prompt_token_ids is not None and not send_text:
        prompt = request.prompt_token_ids  # exact: no tokenizer round trip on the server
    body = {
        **({"user": user} if user is not None else {}),
        "model": model,
        "prompt": prompt,
        "max_tokens": request.max_tokens,
        "temperature": 0.0,
        "ignore_eos": request.ignore_eos,
        "stream": request.stream,
    }
    if request.stream:
        body["stream_options"] = {"include_usage": True}
    if request.response_format is not None:
        body["response_format"] = request.response_format
    return body


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


def carries_output(event: dict[str, Any]) -> bool:
    """Whether a stream event brings output in any choice: text (a chat delta's content or tool
    calls) or logprob tokens. llama.cpp's last chunk, an empty text with the finish reason and
    the usage, brings none."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        logprobs = choice.get("logprobs") or {}
        if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
        if isinstance(logprobs, dict) and logprobs.get("tokens"):
            return True
    return False


def take_usage(record: RequestRecord, usage: dict[str, Any]) -> None:
    if "completion_tokens" in usage:
        record.completion_tokens = int(usage["completion_tokens"])
    if usage.get("prompt_tokens") is not None:
        record.num_prompt_tokens = int(usage["prompt_tokens"])
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if cached is not None:
        record.cached_tokens = int(cached)


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
        if carries_output(event):
            record.chunk_times.append(now)
            if record.first_token_time is None:
                record.first_token_time = now
        if event.get("usage"):
            take_usage(record, event["usage"])
    record.finish_time = clock()
    if not done:
        raise StreamError("the stream ended without [DONE]")


async def consume_response(response: httpx.Response, record: RequestRecord, clock: Clock) -> None:
    body = json.loads(await response.aread())
    record.finish_time = clock()
    if not body.get("choices"):
        raise StreamError(f"a response without choices: {json.dumps(body)[:MAX_ERROR_CHARS]}")
    take_usage(record, body.get("usage") or {})


def check_counts(record: RequestRecord, request: WorkloadRequest) -> None:
    if record.completion_tokens is None:
        raise StreamError("no usage (stream_options.include_usage for a stream)")
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
    scheduled_time: float | None = None,  # when it is due (default: its arrival time, or now)
) -> None:
    if scheduled_time is None:
        scheduled_time = request.arrival_time if honor_arrivals else clock()
    record.scheduled_time = scheduled_time
    record.stream = request.stream
    if honor_arrivals:
        await asyncio.sleep(max(0.0, scheduled_time - clock()))
    try:
        async with asyncio.timeout(timeout_s):
            body = request_body(model, request, send_text, user)
            handed = clock()
            trace = {"trace": on_the_wire(record, clock)}
            async with client.stream(
                "POST", COMPLETIONS_PATH, json=body, extensions=trace
            ) as response:
                if record.send_time is None:  # a transport without httpcore's trace events
                    record.send_time = handed
                if response.status_code != 200:
                    text = (await response.aread()).decode(errors="replace")
                    raise StreamError(f"HTTP {response.status_code}: {text[:MAX_ERROR_CHARS]}")
                if request.stream:
                    await consume_stream(response, record, clock)
                else:
                    await consume_response(response, record, clock)
        check_counts(record, request)
    except TimeoutError:
        record.error = f"timed out after {timeout_s:g} s"
        record.failure_time = clock()
    except Exception as error:  # recorded, not raised: the run goes on
        record.error = f"{type(error).__name__}: {error}"[:MAX_ERROR_CHARS]
        record.failure_time = clock()


def on_the_wire(record: RequestRecord, clock: Clock) -> Callable[[str, Any], Awaitable[None]]:
    """httpcore's trace hook: the request is sent when its headers start to be written (the
    last such event, should the pool retry it on another connection)."""

    async def trace(event: str, info: Any) -> None:
        if event.endswith(".send_request_headers.started"):
            record.send_time = clock()

    return trace


async def run_workload(
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
    name: str = "run",
    on_done: Callable[[RequestRecord], None] | None = None,
    clock: Clock | None = None,
    api_key: str | None = None,
) -> Result:
    """Sends every request to `url` (the server's base URL) and returns the measured result;
    `on_done` hears of each request as it ends (a progress bar); `clock`: the run's time base
    (default: starts now)."""
    records = [
        RequestRecord(i, r.max_tokens, r.num_prompt_tokens, label=r.label, stream=r.stream)
        for i, r in enumerate(requests)
    ]
    limits = httpx.Limits(max_connections=max(1, len(requests)), max_keepalive_connections=0)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        base_url=url,
        trust_env=False,
        follow_redirects=False,
        limits=limits,
        timeout=httpx.Timeout(timeout_s),
        headers=headers,
    ) as client:
        clock = clock or Clock()
        start = clock()  # the schedule's origin: the first arrival is due here
        first = min((r.arrival_time for r in requests), default=0.0)

        async def one(request: WorkloadRequest, record: RequestRecord) -> None:
            due = start + (request.arrival_time - first) if honor_arrivals else start
            await send_one(client, model, request, record, clock, honor_arrivals, timeout_s,
                           send_text, scheduled_time=due)  # fmt: skip
            if on_done is not None:
                on_done(record)

        tasks = [asyncio.create_task(one(r, rec)) for r, rec in zip(requests, records, strict=True)]
        _, pending = await asyncio.wait(tasks, timeout=deadline_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    for record in records:
        if record.error is None and record.finish_time is None:
            record.error = f"cancelled at the global deadline of {deadline_s:g} s"
            record.failure_time = clock()
    summary = summarize(records, slo_ttft_s, slo_tpot_s)
    extra = {"url": url, "model": model, "honor_arrivals": honor_arrivals}
    return Result(name, summary, records, extra)
