"""Request bodies sent compressed (`Content-Encoding: gzip` or `deflate`), decoded as they arrive.

A gzip body was read as JSON bytes and answered 400 "not valid JSON", and an encoding nobody
decodes was the same 400: the client was told its JSON was wrong. Now gzip and deflate (zlib,
or raw deflate as some clients send it) reach the routes decoded, and any other encoding is a
415 naming it. Decoding is lazy and in pieces of at most `MAX_PIECE_BYTES`, each handed on as
the routes ask for the next, so the routes' byte bounds (413) count decoded bytes and stop a
small body that inflates to gigabytes after its first pieces, not after inflating it whole.
"""

from __future__ import annotations

import zlib
from typing import Any

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from services.gateway.openai_protocol import ApiError

MAX_PIECE_BYTES = 64 << 10  # decoded bytes handed on at once
DECODED = ("gzip", "x-gzip", "deflate")


class ContentDecoding:
    """ASGI middleware: a compressed request body reaches the app decoded (its Content-Encoding
    and Content-Length headers dropped, as they describe the bytes on the wire)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        encodings = _encodings(scope) if scope["type"] == "http" else []
        if not encodings:
            await self.app(scope, receive, send)
            return
        if len(encodings) > 1 or encodings[0] not in DECODED:
            await _refuse(scope, send, ", ".join(encodings))
            return
        headers = [
            (name, value)
            for name, value in scope["headers"]
            if name not in (b"content-encoding", b"content-length")
        ]
        inflater = _Inflater(receive, encodings[0])
        await self.app({**scope, "headers": headers}, inflater.receive, send)


def _encodings(scope: Scope) -> list[str]:
    """The body's encodings in the order applied, `identity` left out."""
    named = []
    for name, value in scope["headers"]:
        if name == b"content-encoding":
            named += [part.strip().lower() for part in value.decode("latin-1").split(",")]
    return [encoding for encoding in named if encoding not in ("", "identity")]


async def _refuse(scope: Scope, send: Send, encoding: str) -> None:
    error = ApiError(
        415,
        f"the request body's Content-Encoding {encoding!r} is not supported: send it as is, "
        "or with gzip or deflate",
    )

    async def no_body() -> Message:  # (the response reads none)
        return {"type": "http.disconnect"}

    await JSONResponse(error.body(), status_code=error.status)(scope, no_body, send)


class _Inflater:
    """The app's `receive`: the upstream body's messages, inflated a piece at a time."""

    def __init__(self, receive: Receive, encoding: str) -> None:
        self.upstream = receive
        self.encoding = encoding
        self.inflater: Any = None  # chosen by the body's first two bytes
        self.tail = b""  # compressed bytes read but not yet inflated
        self.upstream_done = False
        self.delivered = False  # the whole body handed on

    async def receive(self) -> Message:
        if self.delivered:  # (the app now waits for the client's disconnect: upstream's)
            return await self.upstream()
        while True:
            if not self.upstream_done and (not self.tail or self.inflater is None):
                message = await self.upstream()
                if message["type"] != "http.request":
                    return message
                self.tail += message.get("body", b"")
                self.upstream_done = not message.get("more_body", False)
                continue
            piece = self._inflate()
            if piece:
                return {"type": "http.request", "body": piece, "more_body": True}
            if not self.upstream_done:
                continue
            if self.inflater is not None and not self.inflater.eof:
                raise self._invalid("it ends early")
            self.delivered = True
            return {"type": "http.request", "body": b"", "more_body": False}

    def _inflate(self) -> bytes:
        """The next piece of the body decoded from `tail` (empty: `tail` is spent)."""
        if self.inflater is None:
            if len(self.tail) < 2:
                if self.tail:  # (a body of one byte is no stream)
                    raise self._invalid("it ends early")
                return b""
            self.inflater = zlib.decompressobj(self._window_bits(self.tail[:2]))
        if self.inflater.eof:
            if self.tail.strip(b"\0"):  # (zero padding some writers add is no second body)
                raise self._invalid(f"bytes follow its {self.encoding} end")
            self.tail = b""
            return b""
        try:
            piece = self.inflater.decompress(self.tail, MAX_PIECE_BYTES)
        except zlib.error as error:
            raise self._invalid(str(error)) from None
        self.tail = self.inflater.unconsumed_tail
        if self.inflater.eof:
            self.tail = self.inflater.unused_data + self.tail
        return piece

    def _window_bits(self, head: bytes) -> int:
        """zlib's window bits for the stream `head` begins: gzip's, zlib's, or (a deflate body
        without zlib's header, as some clients send it) raw deflate's."""
        if head == b"\x1f\x8b":
            return 16 + zlib.MAX_WBITS
        zlib_header = head[0] & 0x0F == 8 and int.from_bytes(head, "big") % 31 == 0
        if zlib_header:
            return zlib.MAX_WBITS
        if self.encoding == "deflate":
            return -zlib.MAX_WBITS
        raise self._invalid("it has no gzip header")

    def _invalid(self, reason: str) -> ApiError:
        return ApiError(400, f"the request body is not valid {self.encoding}: {reason}")
