"""Compressed request bodies: decoded in pieces as the app reads them (ContentDecoding)."""

from __future__ import annotations

import asyncio
import gzip
import zlib

import pytest
from fastapi.testclient import TestClient
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from services.gateway import body_encoding
from services.gateway.app import build_app
from services.gateway.body_encoding import ContentDecoding
from services.gateway.cluster import ClusterView
from services.gateway.openai_protocol import ApiError

BODY = b'{"prompt": "' + b"tandem " * 40_000 + b'"}'  # 280 KB: several pieces


def echo_app() -> TestClient:
    """An app that answers what it read: its length, its headers, and each piece's size."""

    async def echo(request: Request) -> JSONResponse:
        pieces = [len(piece) async for piece in request.stream()]
        return JSONResponse({
            "num_bytes": sum(pieces),
            "largest_piece": max(pieces),
            "encoding": request.headers.get("content-encoding"),
            "length": request.headers.get("content-length"),
        })  # fmt: skip

    async def on_api_error(_: Request, error: ApiError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    app = Starlette(routes=[Route("/", echo, methods=["POST"])],
                    exception_handlers={ApiError: on_api_error})  # fmt: skip
    app.add_middleware(ContentDecoding)
    return TestClient(app)


def raw_deflate(data: bytes) -> bytes:
    compressor = zlib.compressobj(wbits=-zlib.MAX_WBITS)
    return compressor.compress(data) + compressor.flush()


@pytest.mark.parametrize(
    ("content", "encoding"),
    [
        (gzip.compress(BODY), "gzip"),
        (gzip.compress(BODY), "x-gzip"),
        (gzip.compress(BODY), "GZIP, identity"),
        (zlib.compress(BODY), "deflate"),
        (raw_deflate(BODY), "deflate"),  # (no zlib header, as some clients send it)
        (gzip.compress(BODY) + b"\0" * 8, "gzip"),  # zero padding after the stream
        (BODY, "identity"),
        (BODY, None),
    ],
)
def test_the_app_reads_the_body_decoded_in_pieces(content, encoding):
    headers = {"content-encoding": encoding} if encoding else {}
    answer = echo_app().post("/", content=content, headers=headers)
    assert answer.status_code == 200, answer.text
    read = answer.json()
    assert read["num_bytes"] == len(BODY)
    if encoding not in (None, "identity"):  # (they describe the bytes on the wire)
        assert read["encoding"] is None and read["length"] is None
        assert read["largest_piece"] <= body_encoding.MAX_PIECE_BYTES


def test_a_body_sent_in_small_chunks_is_decoded_whole():
    """The stream's header and body split across the client's chunks, a byte at a time first."""
    packed = gzip.compress(BODY)
    chunks = [packed[:1], packed[1:2], packed[2:9]] + [
        packed[i : i + 1000] for i in range(9, len(packed), 1000)
    ]
    answer = echo_app().post("/", content=iter(chunks), headers={"content-encoding": "gzip"})
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_bytes"] == len(BODY)


@pytest.mark.parametrize(
    ("content", "encoding", "status", "words"),
    [
        (BODY, "br", 415, "'br' is not supported"),
        (gzip.compress(BODY), "gzip, br", 415, "'gzip, br' is not supported"),
        (BODY, "gzip", 400, "not valid gzip: it has no gzip header"),
        (gzip.compress(BODY)[:-20], "gzip", 400, "not valid gzip: it ends early"),
        (b"\x1f", "gzip", 400, "not valid gzip: it ends early"),
        (gzip.compress(BODY) + b"{}", "gzip", 400, "bytes follow its gzip end"),
        (b"\x1f\x8b" + b"\xff" * 40, "gzip", 400, "not valid gzip"),
        (b"\x78\x9c" + b"\xff" * 40, "deflate", 400, "not valid deflate"),
    ],
)
def test_wrong_encodings_and_corrupt_streams_are_refused_by_name(content, encoding, status, words):
    answer = echo_app().post("/", content=content, headers={"content-encoding": encoding})
    assert answer.status_code == status, answer.text
    assert words in answer.json()["error"]["message"]


class NoGenerator:
    model_name = "m"

    def __init__(self) -> None:
        self.cluster = type("Cluster", (), {"view": ClusterView(), "ready": True})()


def test_a_body_that_inflates_past_the_bound_is_refused_before_it_is_inflated_whole(
    monkeypatch,
):
    """A few hundred KB of gzip that inflates to 256 MiB: the app's byte bound (413) counts
    the decoded bytes, and the decoding stops at the piece that passes it."""
    inflated = []
    real_decompressobj = zlib.decompressobj

    class Counting:
        def __init__(self, *args) -> None:
            self.inner = real_decompressobj(*args)

        def decompress(self, data: bytes, max_length: int) -> bytes:
            piece = self.inner.decompress(data, max_length)
            inflated.append(len(piece))
            return piece

        def __getattr__(self, name: str):
            return getattr(self.inner, name)

    monkeypatch.setattr(body_encoding.zlib, "decompressobj", Counting)
    compressor = zlib.compressobj(9, wbits=16 + zlib.MAX_WBITS)
    zeros = b"0" * (1 << 20)
    bomb = b"".join(compressor.compress(zeros) for _ in range(256)) + compressor.flush()
    assert len(bomb) < 1 << 20
    client = TestClient(build_app(NoGenerator(), 1 << 20))
    answer = client.post("/v1/completions", content=bomb, headers={"content-encoding": "gzip"})
    assert answer.status_code == 413, answer.text
    assert sum(inflated) <= (1 << 20) + body_encoding.MAX_PIECE_BYTES


def test_once_the_body_is_read_the_app_waits_on_the_client():
    """A streaming route, once it has the body, waits on `receive` for the client to leave:
    the decoder then hands on upstream's messages (it returned its last piece again at once,
    and the gateway's watch for a client gone spun on it instead of serving the stream)."""
    upstream = [
        {"type": "http.request", "body": gzip.compress(BODY), "more_body": False},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict:
        return upstream.pop(0)

    async def read_all() -> tuple[int, dict]:
        inflater = body_encoding._Inflater(receive, "gzip")
        num_bytes = 0
        while True:
            message = await inflater.receive()
            num_bytes += len(message["body"])
            if not message["more_body"]:
                return num_bytes, await inflater.receive()

    assert asyncio.run(read_all()) == (len(BODY), {"type": "http.disconnect"})


@pytest.mark.parametrize("encoding", [None, "gzip"])
def test_a_client_that_leaves_mid_body_is_not_an_error(encoding):
    """A client that closed its connection while sending its body made the route raise
    ClientDisconnect out of the app: an ERROR traceback in the gateway's log at every one."""
    app = build_app(NoGenerator(), 1 << 20)
    headers = [(b"content-type", b"application/json"), (b"content-length", b"500")]
    if encoding is not None:
        headers.append((b"content-encoding", encoding.encode()))
    first = gzip.compress(b'{"model": "m", "prompt": "' + b"x" * 400)[:18]
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
             "method": "POST", "scheme": "http", "path": "/v1/completions", "raw_path": b"",
             "query_string": b"", "root_path": "", "headers": headers,
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2)}  # fmt: skip
    arrivals = [{"type": "http.request", "body": first, "more_body": True},
                {"type": "http.disconnect"}]  # fmt: skip
    sent = []

    async def receive() -> dict:
        return arrivals.pop(0) if arrivals else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 499
