"""The gateway's Files and Batches routes bound what they read: an upload or a create body past
its limit is a 413 once the limit is passed (at once when its Content-Length says so), never
after the whole body has been read (an upload was spooled to disk whole, a create body read into
memory whole, before either was measured)."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from services.gateway.app import build_app
from services.gateway.auth import ApiKeys
from services.gateway.batch_routes import MAX_BATCH_BODY_BYTES, add_batch_routes

CHUNK_BYTES = 64 << 10
MAX_UPLOAD_BYTES = 1 << 20


class Generator:
    model_name = "m"


class Link:
    """A batch service that answers every call; the calls it got, in order."""

    def __init__(self) -> None:
        self.ops: list[str] = []

    async def call(self, op, tenant, params, data=None):
        self.ops.append(op)
        return 200, {"upload_id": "u", "id": "file-1", "object": "file"}, None


class Body:
    """A request body of `num_bytes` (after `head`) that counts how much of it was pulled."""

    def __init__(self, num_bytes: int, head: bytes = b"", tail: bytes = b"") -> None:
        self.num_bytes, self.head, self.tail = num_bytes, head, tail
        self.num_pulled = 0

    async def __aiter__(self):
        for chunk in (
            self.head,
            *[b"x" * CHUNK_BYTES] * (self.num_bytes // CHUNK_BYTES),
            self.tail,
        ):
            self.num_pulled += len(chunk)
            yield chunk


def post(path: str, body: Body, headers: dict[str, str]) -> tuple[httpx.Response, Link]:
    link = Link()
    app = build_app(Generator(), 1 << 20)
    add_batch_routes(app, link, ApiKeys({}), "m", max_upload_bytes=MAX_UPLOAD_BYTES)

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            return await client.post(path, content=body, headers=headers)

    return asyncio.run(send()), link


BOUNDARY = "b0undary"
MULTIPART = {"Content-Type": f"multipart/form-data; boundary={BOUNDARY}"}


def upload_body(num_bytes: int) -> Body:
    head = (f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="file"; filename="in.jsonl"'
            "\r\nContent-Type: application/jsonl\r\n\r\n")  # fmt: skip
    return Body(num_bytes, head.encode(), f"\r\n--{BOUNDARY}--\r\n".encode())


@pytest.mark.parametrize("declared", [False, True])
def test_an_oversized_upload_is_a_413_before_its_body_is_read(declared):
    body = upload_body(64 * MAX_UPLOAD_BYTES)
    headers = dict(MULTIPART)
    if declared:  # (httpx sends a generator chunked: no Content-Length of its own)
        headers["Content-Length"] = str(64 * MAX_UPLOAD_BYTES + 1000)
    response, link = post("/v1/files", body, headers)
    assert response.status_code == 413, response.text
    assert f"exceeds {MAX_UPLOAD_BYTES} bytes" in response.json()["error"]["message"]
    assert body.num_pulled <= (0 if declared else MAX_UPLOAD_BYTES + CHUNK_BYTES)
    assert link.ops == []  # nothing begun at the batch service


def test_an_upload_within_the_limit_is_relayed():
    body = upload_body(MAX_UPLOAD_BYTES // 2)
    response, link = post("/v1/files", body, MULTIPART)
    assert response.status_code == 200, response.text
    assert link.ops[0] == "file_upload_begin" and link.ops[-1] == "file_upload_end"
    assert link.ops.count("file_upload_chunk") == 1


@pytest.mark.parametrize("declared", [False, True])
def test_an_oversized_create_body_is_a_413_before_it_is_read(declared):
    body = Body(64 * MAX_BATCH_BODY_BYTES, b'{"metadata": "')
    headers = {"Content-Type": "application/json"}
    if declared:
        headers["Content-Length"] = str(64 * MAX_BATCH_BODY_BYTES + 14)
    response, link = post("/v1/batches", body, headers)
    assert response.status_code == 413, response.text
    assert f"exceeds {MAX_BATCH_BODY_BYTES} bytes" in response.json()["error"]["message"]
    assert body.num_pulled <= (0 if declared else MAX_BATCH_BODY_BYTES + CHUNK_BYTES)
    assert link.ops == []


def test_a_file_list_relays_its_order_limit_purpose_and_cursor():
    """`order` (OpenAI's asc or desc) was dropped on the way: `client.files.list(order="asc")`
    listed newest first."""
    calls = []

    class Relaying(Link):
        async def call(self, op, tenant, params, data=None):
            calls.append((op, params))
            return 200, {"object": "list", "data": []}, None

    app = build_app(Generator(), 1 << 20)
    add_batch_routes(app, Relaying(), ApiKeys({}), "m")

    async def get() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            query = {"order": "asc", "limit": "5000", "purpose": "batch", "after": "file-1"}
            return await client.get("/v1/files", params=query)

    assert asyncio.run(get()).status_code == 200
    assert calls == [
        ("file_list", {"limit": 5000, "after": "file-1", "purpose": "batch", "order": "asc"})
    ]


@pytest.mark.parametrize(
    "path, answer",
    [
        ("/v1/files", {"id": "file-1"}),  # no upload_id to send the chunks under
        ("/v1/files/file-1/content", {"bytes": 3}),  # no next_offset
        ("/v1/files/file-1/content", {"next_offset": None}),  # no size
    ],
)
def test_an_answer_missing_what_a_route_reads_is_a_502(path, answer):
    """A 200 from the batch service without the field the route goes on with (an upload's id, a
    download's size and next offset) raised KeyError in the route: the gateway's 500, or a
    download cut off after its headers."""

    class Answering(Link):
        async def call(self, op, tenant, params, data=None):
            self.ops.append(op)
            return 200, answer, b"abc"

    app = build_app(Generator(), 1 << 20)
    add_batch_routes(app, Answering(), ApiKeys({}), "m")

    async def send() -> httpx.Response:
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as client:
            if path == "/v1/files":
                body = upload_body(CHUNK_BYTES)
                return await client.post(path, content=body, headers=MULTIPART)
            return await client.get(path)

    response = asyncio.run(send())
    assert response.status_code == 502, response.text
    assert "the batch service answered nonsense" in response.json()["error"]["message"]
