"""The gateway's Files and Batches routes, relayed to the batch service (`batch_link`).

The gateway owns nothing here: it authenticates the caller, names the owner (the API key's
tenant; a key without one owns by a digest of itself, so two bare keys never see each other's
files; with no keys configured, everyone is `default`), and relays. An upload is parsed by
python-multipart (spooled to disk past 1 MiB) and sent on in chunks; a download is streamed
back chunk by chunk. Without `--batch-address` the routes answer 404, as for any unknown path.

Bodies are bounded before they are read: a Content-Length past the limit is a 413 at once, and a
body without one (chunked) or with a false one is counted as it arrives and refused (413) the
moment it passes the limit, so the gateway never reads or spools more than the limit (an upload:
the batch service's default `--max-file-bytes` and a little multipart framing). The batch
service checks its own file limit again on every relayed chunk.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile
from starlette.types import Message

from services.gateway.auth import ApiKeys
from services.gateway.batch_link import BatchLink, field
from services.gateway.openai_protocol import ApiError
from shared.wire_batch import MAX_CHUNK_BYTES

UPLOAD_CHUNK_BYTES = min(MAX_CHUNK_BYTES, 1 << 20)
MAX_BATCH_BODY_BYTES = 64 << 10  # POST /v1/batches: ids, a window and 16 metadata strings
MAX_UPLOAD_FILE_BYTES = 200 << 20  # the batch service's default --max-file-bytes
MULTIPART_SLACK_BYTES = 64 << 10  # boundaries, part headers, the `purpose` field


def owner_of(keys: ApiKeys, authorization: str | None) -> str:
    caller = keys.check_header(authorization)
    if caller.tenant is not None:
        return caller.tenant
    if not keys.enabled:
        return "default"
    key = (authorization or "").partition(" ")[2].strip()
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def bounded(request: Request, max_bytes: int) -> Request:
    """`request` whose body is refused (413) past `max_bytes`: at once when its Content-Length
    says so, else as soon as the bytes received pass it. Until 2026-12-06 an upload was spooled
    to disk whole (Starlette bounds only a form's non-file parts) and a create body read whole
    before either was measured: a 50 GB POST filled the gateway's disk before its 413."""
    too_big = ApiError(413, f"the request body exceeds {max_bytes} bytes")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    num_bytes = 0

    async def receive() -> Message:
        nonlocal num_bytes
        message = await request.receive()
        if message["type"] == "http.request":
            num_bytes += len(message.get("body", b""))
            if num_bytes > max_bytes:
                raise too_big
        return message

    return Request(request.scope, receive)


def add_batch_routes(
    app: FastAPI,
    link: BatchLink,
    keys: ApiKeys,
    model: str,
    max_upload_bytes: int = MAX_UPLOAD_FILE_BYTES + MULTIPART_SLACK_BYTES,
) -> None:
    async def relay(request: Request, op: str, params: dict[str, Any]) -> JSONResponse:
        owner = owner_of(keys, request.headers.get("authorization"))
        _, body, _ = await link.call(op, owner, params)
        return JSONResponse(body)

    @app.post("/v1/files")
    async def create_file(request: Request) -> JSONResponse:
        owner = owner_of(keys, request.headers.get("authorization"))
        form = await bounded(request, max_upload_bytes).form(max_files=1, max_fields=8)
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a multipart field `file` is required", param="file")
            begin = {"purpose": purpose, "filename": upload.filename}
            # An expiry policy, as the openai client's form sends one (`expires_after`).
            expiry = {key: form.get(f"expires_after[{key}]") for key in ("anchor", "seconds")}
            if any(value is not None for value in expiry.values()):
                begin["expires_after"] = expiry
            _, body, _ = await link.call("file_upload_begin", owner, begin)
            params = {"upload_id": field(body, "upload_id", str)}
            while chunk := await upload.read(UPLOAD_CHUNK_BYTES):
                await link.call("file_upload_chunk", owner, params, chunk)
            _, body, _ = await link.call("file_upload_end", owner, params)
            return JSONResponse(body)
        finally:
            await form.close()

    @app.get("/v1/files")
    async def list_files(request: Request) -> JSONResponse:
        return await relay(request, "file_list", _list_params(request, "purpose", "order"))

    @app.get("/v1/files/{file_id}")
    async def get_file(request: Request, file_id: str) -> JSONResponse:
        return await relay(request, "file_get", {"file_id": file_id})

    @app.delete("/v1/files/{file_id}")
    async def delete_file(request: Request, file_id: str) -> JSONResponse:
        return await relay(request, "file_delete", {"file_id": file_id})

    @app.get("/v1/files/{file_id}/content")
    async def file_content(request: Request, file_id: str) -> StreamingResponse:
        owner = owner_of(keys, request.headers.get("authorization"))
        params = {"file_id": file_id, "offset": 0}
        _, body, chunk = await link.call("file_content", owner, params)  # errors before 200
        num_bytes, next_offset = field(body, "bytes", int), field(body, "next_offset", int, None)

        async def chunks() -> AsyncIterator[bytes]:
            nonlocal chunk, next_offset
            while True:
                yield chunk or b""
                if next_offset is None:
                    return
                params["offset"] = next_offset
                _, body, chunk = await link.call("file_content", owner, params)
                next_offset = field(body, "next_offset", int, None)

        headers = {"Content-Length": str(num_bytes)}
        return StreamingResponse(chunks(), media_type="application/jsonl", headers=headers)

    @app.post("/v1/batches")
    async def create_batch(request: Request) -> JSONResponse:
        owner_of(keys, request.headers.get("authorization"))  # before reading the body
        raw = await bounded(request, MAX_BATCH_BODY_BYTES).body()
        try:
            params = json.loads(raw)
        except (ValueError, RecursionError) as error:
            raise ApiError(400, f"the body is not valid JSON: {error}") from None
        if not isinstance(params, dict):
            raise ApiError(400, "the body must be a JSON object")
        params.pop("models", None)
        return await relay(request, "batch_create", {**params, "models": [model]})

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> JSONResponse:
        return await relay(request, "batch_list", _list_params(request))

    @app.get("/v1/batches/{batch_id}")
    async def get_batch(request: Request, batch_id: str) -> JSONResponse:
        return await relay(request, "batch_get", {"batch_id": batch_id})

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(request: Request, batch_id: str) -> JSONResponse:
        return await relay(request, "batch_cancel", {"batch_id": batch_id})


def _list_params(request: Request, *extra: str) -> dict[str, Any]:
    params: dict[str, Any] = {}
    query = request.query_params
    if "limit" in query:
        try:
            params["limit"] = int(query["limit"])
        except ValueError:
            raise ApiError(400, "limit must be an integer", param="limit") from None
    for name in ("after", *extra):
        if name in query:
            params[name] = query[name]
    return params
