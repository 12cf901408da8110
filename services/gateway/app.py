"""The gateway's HTTP API: OpenAI's completions, chat completions and models, plus health and
the tokenizer (`tokenize_api`).

Handlers parse and validate the body (`openai_protocol`), tokenize and run the request through
the cluster (`generation`), and answer either one JSON response or a stream of server-sent
events ending with `data: [DONE]`. Every error has OpenAI's shape. A client that disconnects
cancels its request everywhere: a handler watches the connection while it waits on the cluster (a
stream for its first event, so a request queued or prefilling is cancelled too), and a stream
that has begun is closed by the server. A long prompt is tokenized off the event loop
(`generation`), and its client is watched while it waits for that too.

The server's shutdown bounds every wait on the cluster (`drain`): past its grace, a 503.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from services.gateway.auth import ApiKeys, tenant_of
from services.gateway.batch_link import BatchLink
from services.gateway.batched_prompts import (
    batched_chunks,
    batched_response,
    first_events,
    split_prompts,
)
from services.gateway.body_encoding import ContentDecoding
from services.gateway.drain import Drain, until_drained
from services.gateway.federation import cluster_metrics
from services.gateway.generation import ChoiceEvent, Generation, Generator, tokenizes_off_loop
from services.gateway.json_body import load_json_body
from services.gateway.openai_protocol import (
    ApiError,
    GenerationRequest,
    model_not_found,
    parse_chat_request,
    parse_completion_request,
    unforeseen,
)
from services.gateway.openai_shapes import SSE_DONE, sse_event
from services.gateway.response_store import ResponseStore
from services.gateway.responses import (
    StreamChunks,
    collect_response,
    final_usage_chunk,
    first_event,
)
from services.gateway.responses_api import (
    ResponseEvents,
    ResponseKeeper,
    chat_body,
    check_body,
    in_responses_terms,
    input_item_page,
    response_object,
    sse,
)
from services.gateway.sliced_json import sliced_dumps
from services.gateway.tokenize_api import detokenize, tokenize_async
from shared.logs import get_logger
from shared.metrics import CONTENT_TYPE

T = TypeVar("T")
log = get_logger(component="gateway")


def unforeseen_in_stream(error: Exception) -> bytes:
    """The error event of a stream a bug ended, logged here (no server sees the exception)."""
    log.error("a stream failed unforeseen", exc_info=error)
    return sse_event(unforeseen(error).body())


def _drain_of(request: Request) -> Drain:
    return request.app.state.drain


def error_response(error: ApiError) -> JSONResponse:
    headers = {}
    retry_after = getattr(error, "retry_after_s", None)
    if retry_after is not None:
        headers["Retry-After"] = str(max(1, round(retry_after)))
    if error.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def routing_error(request: Request, error: HTTPException) -> JSONResponse:
    """A path or method no route serves, in OpenAI's shape rather than the framework's."""
    call = f"{request.method} {request.url.path}"
    headers = {name.lower(): value for name, value in (error.headers or {}).items()}
    if error.status_code == 404:
        message = f"Invalid URL ({call})"
    elif error.status_code == 405:
        message = f"{call} is not allowed here; this path takes {headers.get('allow', 'no method')}"
    else:
        message = str(error.detail)
    response = error_response(ApiError(error.status_code, message))
    response.headers.update(headers)
    return response


def build_app(
    generator: Generator,
    max_body_bytes: int,
    keys: ApiKeys | None = None,
    lifespan=None,
    batch: BatchLink | None = None,
    responses: ResponseStore | None = None,
    drain: Drain | None = None,
) -> FastAPI:
    """The HTTP API; `batch`, the link to the batch service, adds its metrics to /metrics (its
    routes are `batch_routes`'); `drain`, the server's shutdown (default: one never begun)."""
    app = FastAPI(title="tandem", lifespan=lifespan)
    app.add_middleware(ContentDecoding)  # (gzip and deflate bodies; other encodings 415)
    app.state.drain = drain or Drain()
    model = generator.model_name
    keys = keys or ApiKeys({})
    responses = responses if responses is not None else ResponseStore()

    def tenant(request: Request, generation: Generation) -> str:
        caller = keys.check_header(request.headers.get("authorization"))
        return tenant_of(caller, generation.request.user)

    @app.exception_handler(ApiError)
    async def on_api_error(_: Request, error: ApiError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(ClientDisconnect)
    async def on_left_while_sending(_: Request, __: ClientDisconnect) -> Response:
        # The client left before its body was whole: nobody to answer, nothing to log (it was
        # an ERROR traceback, "Exception in ASGI application", at every dropped upload).
        return Response(status_code=499)

    @app.exception_handler(HTTPException)
    async def on_routing_error(request: Request, error: HTTPException) -> JSONResponse:
        return routing_error(request, error)

    @app.exception_handler(Exception)
    async def on_unforeseen(_: Request, error: Exception) -> JSONResponse:
        # (Starlette raises it on after this answer: the server logs its traceback.)
        return error_response(unforeseen(error))

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready(request: Request) -> JSONResponse:
        view = generator.cluster.view
        shown = keys.tenant_filter(request.headers.get("authorization"))
        body = {
            "ready": generator.cluster.ready,
            "prefill_workers": view.num_prefill,
            "decode_workers": view.num_decode,
            "queued": view.num_queued,
            "in_flight": view.num_in_flight,
            "decode_free_blocks": view.num_decode_free_blocks,
            "decode_total_blocks": view.num_decode_total_blocks,
            "preemptions": {
                "swap": view.num_swap_preemptions,
                "recompute": view.num_recompute_preemptions,
            },
            "scheduler": {
                "policy": view.policy,
                "max_queue_wait_s": view.max_queue_wait_s,
                "metrics_address": view.scheduler_metrics_address,
                "service": [
                    {
                        "tenant": party.tenant,
                        "class": party.class_name,
                        "served_tokens": party.served_tokens,
                        "virtual_tokens": party.virtual_tokens,
                        "queued": party.num_queued,
                    }
                    for party in view.service
                    if shown(party.tenant)
                ],
            },
            "workers": [
                {
                    "peer_id": w.peer_id,
                    "role": w.role,
                    "healthy": w.healthy,
                    "heartbeat_age_s": w.heartbeat_age_s,
                    "running": w.num_running,
                    "waiting": w.num_waiting,
                    "swapped": w.num_swapped,
                    "free_blocks": w.num_free_blocks,
                    "total_blocks": w.num_total_blocks,
                    "steps_completed": w.steps_completed,
                    "recent_batch_sizes": w.recent_batch_sizes,
                    "metrics_address": w.metrics_address,
                    "dtype": w.dtype,
                    "prefix_query_tokens": w.num_prefix_query_tokens,
                    "prefix_hit_tokens": w.num_prefix_hit_tokens,
                }
                for w in view.workers
            ],
        }
        # (A number JSON cannot write, NaN or infinite, is null: JSONResponse refused the whole
        # body, and a scheduler's status carrying one made /ready a 500.)
        return JSONResponse(_finite_or_null(body), status_code=200 if body["ready"] else 503)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """This gateway's metrics and every peer's, each sample labelled with its `peer`; the
        fair-share accounts' only of the tenants the caller may see, as /ready's (a scraper
        sends a bare key: Prometheus's `authorization: {credentials: ...}`)."""
        cluster = generator.cluster
        shown = keys.tenant_filter(request.headers.get("authorization"))
        body = await cluster_metrics(
            cluster.peer_id, generator.telemetry, cluster.view, batch, tenant_shown=shown
        )
        return Response(body, media_type=CONTENT_TYPE)

    def model_card() -> dict[str, Any]:
        return {
            "id": model,
            "object": "model",
            "created": 0,
            "owned_by": "tandem",
            "max_model_len": generator.max_model_len,
            "sampling_defaults": dict(generator.sampling_defaults),
            # What the workers run in (`--dtype auto` resolved on each), as they registered.
            "dtypes": sorted({w.dtype for w in generator.cluster.view.workers if w.dtype}),
        }

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        keys.check_header(request.headers.get("authorization"))
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")  # (a model's name may hold slashes)
    async def model_entry(request: Request, model_id: str) -> dict[str, Any]:
        keys.check_header(request.headers.get("authorization"))
        if model_id != model:
            raise model_not_found(model_id, model)
        return model_card()

    @app.post("/tokenize")
    async def tokenize_prompt(request: Request) -> Response:
        keys.check_header(request.headers.get("authorization"))
        body = await _read_json(request, max_body_bytes)
        try:  # (rendered with the answer: FastAPI's own encoding of a long one took seconds)
            return await _unless_gone(request, tokenize_async(generator, body, _sliced_json))
        except ClientGone:
            return Response(status_code=499)

    @app.post("/detokenize")
    async def detokenize_ids(request: Request) -> dict[str, Any]:
        keys.check_header(request.headers.get("authorization"))
        return detokenize(generator, await _read_json(request, max_body_bytes))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        keys.check_header(request.headers.get("authorization"))  # before reading the body
        body = await _read_json(request, max_body_bytes)
        bodies = split_prompts(body)
        if bodies is not None:  # a batch of prompts: each its own request, answered as one
            parsed = [parse_completion_request(b, model, generator.max_model_len) for b in bodies]
            try:
                generations = [await _prepare(request, generator, p, "cmpl") for p in parsed]
            except ClientGone:
                return Response(status_code=499)
            caller = tenant(request, generations[0])
            return await _serve_batch(request, generator, generations, caller)
        parsed = parse_completion_request(body, model, generator.max_model_len)
        return await _prepare_and_serve(request, generator, parsed, "cmpl", tenant)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        keys.check_header(request.headers.get("authorization"))
        body = await _read_json(request, max_body_bytes)
        parsed = parse_chat_request(body, model, generator.max_model_len)
        return await _prepare_and_serve(request, generator, parsed, "chatcmpl", tenant)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        """OpenAI's Responses API, served as a chat (services.gateway.responses_api), stored
        for `previous_response_id` unless `store` is false."""
        owner = keys.check_header(request.headers.get("authorization")).owner
        body = check_body(await _read_json(request, max_body_bytes))
        keeps = responses.enabled and body.get("store") is not False
        try:
            previous = body.get("previous_response_id")
            earlier = (
                responses.conversation(owner, previous, max_body_bytes)
                if previous is not None
                else []
            )
            # (read as the earlier messages are, before the turn runs: the chain may leave)
            earlier_items = (
                responses.input_items(owner, previous, answered=True) if keeps and previous else []
            )
            parsed = parse_chat_request(chat_body(body, earlier), model, generator.max_model_len)
            generation = await _prepare(request, generator, parsed, "resp")
        except ApiError as error:
            raise in_responses_terms(error) from None
        except ClientGone:
            return Response(status_code=499)
        keeper = ResponseKeeper(responses, owner, body, earlier, earlier_items) if keeps else None
        caller = tenant(request, generation)
        return await _serve_response(request, generator, generation, body, caller, keeper)

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> dict[str, Any]:
        owner = keys.check_header(request.headers.get("authorization")).owner
        return responses.response(owner, response_id)

    @app.get("/v1/responses/{response_id}/input_items")
    async def list_input_items(request: Request, response_id: str) -> dict[str, Any]:
        """The items a stored response was generated from (its conversation's), a page of
        them (`limit`, `order`, `after`), as OpenAI's `input_items` lists them."""
        owner = keys.check_header(request.headers.get("authorization")).owner
        return input_item_page(responses.input_items(owner, response_id), request.query_params)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> dict[str, Any]:
        owner = keys.check_header(request.headers.get("authorization")).owner
        responses.delete(owner, response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    return app


def _finite_or_null(value: Any) -> Any:
    """`value` (JSON: dicts, lists, numbers, ...) with every NaN or infinite float as None."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite_or_null(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_finite_or_null(item) for item in value]
    return value


def _sliced_json(answer: dict[str, Any]) -> Response:
    """A long answer's JSON, written in slices (services.gateway.sliced_json)."""
    return Response(sliced_dumps(answer).encode(), media_type="application/json")


async def _read_json(request: Request, max_body_bytes: int) -> Any:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_body_bytes:
        raise ApiError(413, f"the request body exceeds {max_body_bytes} bytes")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_body_bytes:
            raise ApiError(413, f"the request body exceeds {max_body_bytes} bytes")
    return load_json_body(body)


SSE_MEDIA_TYPE = "text/event-stream"


class ClientGone(Exception):
    """The client disconnected while its handler waited on the cluster."""


async def _prepare(
    request: Request, generator: Generator, parsed: GenerationRequest, id_prefix: str
) -> Generation:
    """The request tokenized: a short prompt at once, a long one off the event loop with its
    client watched meanwhile (ClientGone; a tokenization that has not begun never does)."""
    if not tokenizes_off_loop(parsed):
        return generator.prepare(parsed, id_prefix)
    return await _unless_gone(request, generator.prepare_async(parsed, id_prefix))


async def _prepare_and_serve(
    request: Request,
    generator: Generator,
    parsed: GenerationRequest,
    id_prefix: str,
    tenant: Callable[[Request, Generation], str],
) -> Response:
    try:
        generation = await _prepare(request, generator, parsed, id_prefix)
    except ClientGone:
        return Response(status_code=499)
    return await _serve(request, generator, generation, tenant(request, generation))


async def _serve(
    request: Request, generator: Generator, generation: Generation, tenant: str
) -> Response:
    events = generator.events(generation, tenant)
    try:
        if generation.request.stream:
            first = await _unless_gone(request, first_event(events))
            rest = until_drained(events, _drain_of(request))
            return StreamingResponse(_sse(generation, first, rest), media_type=SSE_MEDIA_TYPE)
        return JSONResponse(await _unless_gone(request, collect_response(generation, events)))
    except ClientGone:
        await events.aclose()  # type: ignore[attr-defined]
        return Response(status_code=499)


async def _serve_batch(
    request: Request, generator: Generator, generations: list[Generation], tenant: str
) -> Response:
    try:
        if generations[0].request.stream:
            started = await _unless_gone(request, first_events(generator, generations, tenant))
            chunks = until_drained(batched_chunks(generations, started), _drain_of(request))
            return StreamingResponse(_sse_of(chunks), media_type=SSE_MEDIA_TYPE)
        return JSONResponse(
            await _unless_gone(request, batched_response(generator, generations, tenant))
        )
    except ClientGone:
        return Response(status_code=499)


async def _unless_gone(request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result; ClientGone, the work cancelled (its cluster requests with it: a queued
    prompt leaves the queue unprefilled), as soon as the client disconnects. A stream waits
    here for its first event, a whole answer for its last: either may take minutes in a queue.
    Past the shutdown's grace, ApiError 503, the work cancelled (`Drain`)."""
    working = asyncio.create_task(work)
    leaving = asyncio.create_task(_disconnect(request))
    try:
        waiting = asyncio.wait({working, leaving}, return_when=asyncio.FIRST_COMPLETED)
        await _drain_of(request).within(waiting)
    finally:  # (also when this handler is cancelled: both tasks end with it)
        leaving.cancel()
        if not working.done():
            working.cancel()
        await asyncio.gather(working, leaving, return_exceptions=True)
    if working.cancelled():  # the client left first
        raise ClientGone
    return working.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects. The body has been read, so the server's next
    message is `http.disconnect`: one suspended task a request (asking `is_disconnected()`
    every 0.5 s cost the gateway 18% of a core with 1,000 requests waiting)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _sse_of(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    except ApiError as error:
        yield sse_event(error.body())
    except Exception as error:  # a bug: the client still gets an error event and [DONE]
        yield unforeseen_in_stream(error)
    finally:
        await chunks.aclose()  # type: ignore[attr-defined]
    yield SSE_DONE


async def _sse(
    generation: Generation, first: ChoiceEvent | None, events: AsyncIterator[ChoiceEvent]
) -> AsyncIterator[bytes]:
    req = generation.request
    chunks = StreamChunks(generation)
    num_tokens = 0
    try:
        pending = [first] if first is not None else []
        async for event in _chain(pending, events):
            num_tokens += len(event.token_ids)
            for chunk in chunks.chunks(event):
                yield sse_event(chunk)
        if req.include_usage:
            yield sse_event(final_usage_chunk(generation, num_tokens))
    except ApiError as error:
        yield sse_event(error.body())
    except Exception as error:  # a bug: the client still gets an error event and [DONE]
        yield unforeseen_in_stream(error)
    finally:
        await events.aclose()
    yield SSE_DONE


async def _serve_response(
    request: Request,
    generator: Generator,
    generation: Generation,
    body: Any,
    tenant: str,
    keeper: ResponseKeeper | None,
) -> Response:
    """A Responses API request's answer: its chat answer as a Response, or its chat stream as a
    Response's events; kept by `keeper` once answered."""
    events = generator.events(generation, tenant)
    try:
        if generation.request.stream:
            first = await _unless_gone(request, first_event(events))
            rest = until_drained(events, _drain_of(request))
            stream = _response_sse(body, generation, first, rest, keeper)
            return StreamingResponse(stream, media_type=SSE_MEDIA_TYPE)
        chat = await _unless_gone(request, collect_response(generation, events))
        response = response_object(body, chat)
        if keeper is not None:
            keeper.keep(response)
        return JSONResponse(response)
    except ClientGone:
        await events.aclose()  # type: ignore[attr-defined]
        return Response(status_code=499)


async def _response_sse(
    body: Any,
    generation: Generation,
    first: ChoiceEvent | None,
    events: AsyncIterator[ChoiceEvent],
    keeper: ResponseKeeper | None,
) -> AsyncIterator[bytes]:
    """`_sse`'s chat chunks as a Response's events (no `[DONE]`: the last event says it)."""
    chunks, shaped = StreamChunks(generation), ResponseEvents(body, keeper)
    num_tokens = 0
    try:
        for start in shaped.start():
            yield sse(start)
        async for event in _chain([first] if first is not None else [], events):
            num_tokens += len(event.token_ids)
            for chunk in chunks.chunks(event):
                for shaped_event in shaped.chunk(chunk):
                    yield sse(shaped_event)
        for shaped_event in shaped.chunk(final_usage_chunk(generation, num_tokens)):
            yield sse(shaped_event)
        for end in shaped.end():
            yield sse(end)
    except ApiError as error:
        for failed in shaped.failed(error.body()):
            yield sse(failed)
    except Exception as error:  # a bug: the client still gets the failed stream's end
        log.error("a stream failed unforeseen", exc_info=error)
        for failed in shaped.failed(unforeseen(error).body()):
            yield sse(failed)
    finally:
        await events.aclose()


async def _chain(
    first: list[ChoiceEvent], rest: AsyncIterator[ChoiceEvent]
) -> AsyncIterator[ChoiceEvent]:
    for event in first:
        yield event
    async for event in rest:
        yield event
