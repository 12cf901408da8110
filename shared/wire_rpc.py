"""The RPC front door: a client's DEALER to the gateway's RPC ROUTER. Bodies are the HTTP API's
JSON as text, so both doors share one parser and one response shape, field for field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal

from shared.wire_base import (
    CallId,
    JsonText,
    MaxLen,
    Message,
    MessageType,
)


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcRequest(Message):
    """Client -> gateway: one completion or chat call, or a use of the served model's
    tokenizer (never streamed)."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_REQUEST
    call_id: CallId  # chosen by the client, unique among its calls in flight; names its events
    # /v1/completions, /v1/chat/completions, /tokenize or /detokenize
    kind: Literal["completion", "chat", "tokenize", "detokenize"]
    body: JsonText  # the HTTP API's request body, as JSON text
    stream: bool  # chunks as they come, or one response; the body's `stream` must agree
    api_key: Annotated[str, MaxLen(256)] | None = None  # when the gateway has keys: one of them
    bulk: bool = False  # a batch job's line (the scheduler's bulk class: spare capacity only)


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcCancel(Message):
    """Client -> gateway: abandon a call; its request is cancelled in the cluster."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_CANCEL
    call_id: CallId


@dataclass(frozen=True, slots=True, kw_only=True)
class RpcEvent(Message):
    """Gateway -> client: one event of a call. A streaming call gets chunks and then an `end`
    (SSE's `[DONE]`); a non-streaming one gets one response; either may end with an error.
    While a client's calls wait with nothing to send, the gateway sends it a `waiting` event
    now and then (a probe: it fails at once when the client has gone, which cancels its calls);
    clients drop it."""

    TYPE: ClassVar[MessageType] = MessageType.RPC_EVENT
    call_id: CallId
    kind: Literal["chunk", "response", "error", "end", "waiting"]
    # JSON text: an OpenAI stream chunk, the whole OpenAI response, or OpenAI's error object
    # ({"error": {"message", "type", "param", "code"}}); empty for `end` and `waiting`.
    body: JsonText
    status: int  # as HTTP would answer: 200 for chunks, responses and end; the error's status
    retry_after_s: float | None = None  # with 429/503: when to try again
    done: bool  # the call's last event; the gateway forgets the call
