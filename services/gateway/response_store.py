"""The Responses API's stored responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, in this gateway's memory.

Each stored response keeps the chat messages it added to its conversation (its input, but for
the instructions, which OpenAI does not carry over, and its answer) and the id of the response
it continued, so a conversation of n turns takes memory linear in its length, not n copies of
it. Continuing one walks the chain back to its start; the walk touches every response in it, so
the least recently used ones, which leave first once `max_bytes` is passed, are never the middle
of a chain in use. A response whose chain lost a link (evicted, deleted) cannot be continued:
its client gets a 400 that says so. Responses belong to the API key's tenant that made them: a
tenant neither reads nor continues another's. Nothing survives a restart of the gateway, and a
cluster of several gateways needs its clients to stay on one (or to send the whole
conversation, as the OpenAI Agents SDK does by default).
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_protocol import ApiError

DEFAULT_MAX_BYTES = 64 << 20
MAX_CHAIN = 10_000  # turns walked back at most (a chain is acyclic: ids are new each time)


@dataclass(frozen=True)
class Stored:
    tenant: str
    previous_id: str | None
    messages: tuple[dict[str, Any], ...]  # the chat messages this turn added
    response: dict[str, Any]  # the Response object, as answered
    num_bytes: int


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[str, Stored] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        previous_id: str | None,
        messages: list[dict[str, Any]],
    ) -> bool:
        """Keeps the response; False when it alone is larger than the store."""
        num_bytes = len(json.dumps([response, messages]))
        if num_bytes > self.max_bytes:
            return False
        stored = Stored(tenant, previous_id, tuple(messages), response, num_bytes)
        self._entries[response["id"]] = stored
        self.num_bytes += num_bytes
        while self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return True

    def response(self, tenant: str, response_id: str) -> dict[str, Any]:
        """The stored Response (ApiError 404 if this tenant has none of that id)."""
        return self._get(tenant, response_id, "response_id").response

    def delete(self, tenant: str, response_id: str) -> None:
        self._get(tenant, response_id, "response_id")
        self.num_bytes -= self._entries.pop(response_id).num_bytes

    def conversation(self, tenant: str, response_id: str) -> list[dict[str, Any]]:
        """The chat messages of the conversation that ended with `response_id`, first to last
        (ApiError 400 naming `previous_response_id` when it, or a turn before it, is gone)."""
        chain: list[Stored] = []
        at: str | None = response_id
        while at is not None and len(chain) < MAX_CHAIN:
            stored = self._entries.get(at)
            if stored is None or stored.tenant != tenant:
                gone = "" if at == response_id else f", of which {at} was"
                raise ApiError(
                    400,
                    f"no response {response_id} is stored here{gone} (responses live in the"
                    " memory of the gateway that answered them, and the oldest leave first):"
                    " send the whole conversation in `input`",
                    param="previous_response_id",
                )
            self._entries.move_to_end(at)
            chain.append(stored)
            at = stored.previous_id
        if at is not None:
            raise ApiError(
                400,
                f"the conversation of {response_id} is longer than {MAX_CHAIN} responses:"
                " send the whole conversation in `input`",
                param="previous_response_id",
            )
        return [message for stored in reversed(chain) for message in stored.messages]

    def _get(self, tenant: str, response_id: str, param: str) -> Stored:
        stored = self._entries.get(response_id)
        if stored is None or stored.tenant != tenant:
            raise ApiError(404, f"no response {response_id} is stored here", param=param)
        return stored
