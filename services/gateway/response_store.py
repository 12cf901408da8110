"""The Responses API's stored responses: what `previous_response_id` continues and
`GET /v1/responses/{id}` returns, in this gateway's memory.

Each stored response keeps the chat messages it added to its conversation (its input, but for
the instructions, which OpenAI does not carry over, and its answer) and the id of the response
it continued, so a conversation of n turns takes memory linear in its length, not n copies of
it. Continuing one walks the chain back to its start; the walk touches every response in it, so
the least recently used ones, which leave first once `max_bytes` is passed, are never the middle
of a chain in use. A response whose chain lost a link (evicted, deleted) cannot be continued:
its client gets a 400 that says so. (A turn whose chain left while it was generated keeps the
whole conversation it began with instead: it was answered as stored, and can be continued.)
Each turn keeps its input items too, for `GET /v1/responses/{id}/input_items`, which lists
the items a response was generated from as OpenAI does: the earlier turns' input and output
items, then its own input (the instructions are no items).
Responses belong to the API key's tenant that made them: a tenant neither reads nor continues
another's. Nothing survives a restart of the gateway, and a cluster of several gateways needs
its clients to stay on one (or to send the whole conversation, as the OpenAI Agents SDK does by
default).

The bound is shared fairly: to make room, the tenant holding the most bytes gives up its least
recently used response (the turn being stored never leaves for itself), so a tenant storing
many responses, as every request does by default, evicts its own and not another's
conversation. (Until 2026-12-07 the least recently used of any tenant's left: one tenant's
traffic broke every other tenant's `previous_response_id`.) A single tenant's responses leave
least recently used first.

A response and its messages are kept as their JSON text, so what `max_bytes` counts is what
they hold: as Python objects they held up to ~20 times their JSON (an empty object is 3
characters of JSON and 64 bytes of memory), and a tool's schema of them passed the bound.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from services.gateway.openai_protocol import ApiError

DEFAULT_MAX_BYTES = 64 << 20
MAX_CHAIN = 10_000  # turns walked back at most (a chain is acyclic: ids are new each time)


@dataclass(frozen=True)
class Stored:
    previous_id: str | None
    messages: str  # the chat messages this turn added, as JSON
    response: str  # the Response object, as answered, as JSON
    items: str = "[]"  # the input items of this turn (with ids) as listed, as JSON

    @property
    def num_bytes(self) -> int:  # (ASCII: JSON's escapes)
        return len(self.messages) + len(self.response) + len(self.items)


@dataclass
class Holdings:
    """One tenant's stored responses, by id, least recently used first, and what they count."""

    entries: OrderedDict[str, Stored] = field(default_factory=OrderedDict)
    num_bytes: int = 0


class ResponseStore:
    def __init__(self, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        self.max_bytes = max_bytes
        self.num_bytes = 0  # (the sum of every tenant's)
        self._tenants: dict[str, Holdings] = {}

    @property
    def enabled(self) -> bool:
        return self.max_bytes > 0

    def __len__(self) -> int:
        return sum(len(holdings.entries) for holdings in self._tenants.values())

    def put(
        self,
        tenant: str,
        response: dict[str, Any],
        previous_id: str | None,
        messages: list[dict[str, Any]],
        earlier: list[dict[str, Any]] | None = None,
        *,
        items: Sequence[Mapping[str, Any]] = (),
        earlier_items: list[dict[str, Any]] | None = None,
    ) -> bool:
        """Keeps the response (a copy: its JSON), the `messages` its turn added to the
        conversation of `previous_id` and its input `items` (`earlier` and `earlier_items`,
        that conversation's messages and items as they were when the turn began: kept with the
        turn if that chain lost a turn since); False when it alone is larger than the store.
        The chain it continues is used again: others leave before it to make room."""
        stored = Stored(previous_id, json.dumps(messages), json.dumps(response), json.dumps(items))
        if previous_id is not None:
            chain, at = self._walk(tenant, previous_id)
            if at is not None and earlier is not None:
                stored = Stored(
                    None,
                    json.dumps([*earlier, *messages]),
                    stored.response,
                    json.dumps([*(earlier_items or ()), *items]),
                )
            self._touch(tenant, chain)
        if stored.num_bytes > self.max_bytes:
            return False
        while self.num_bytes + stored.num_bytes > self.max_bytes:
            self._evict(self._fullest(tenant, stored.num_bytes))
        holdings = self._tenants.setdefault(tenant, Holdings())
        holdings.entries[response["id"]] = stored
        holdings.num_bytes += stored.num_bytes
        self.num_bytes += stored.num_bytes
        return True

    def _fullest(self, tenant: str, num_incoming: int) -> str:
        """The tenant to give up a response: the one holding the most bytes, counting the
        `num_incoming` that `tenant` is storing (one holding any: the store is over its bound
        only with the incoming turn, which fits alone)."""

        def held(name: str) -> int:
            return self._tenants[name].num_bytes + (num_incoming if name == tenant else 0)

        return max((name for name, h in self._tenants.items() if h.entries), key=held)

    def _evict(self, tenant: str) -> None:
        _, evicted = self._tenants[tenant].entries.popitem(last=False)
        self._drop_bytes(tenant, evicted.num_bytes)

    def _drop_bytes(self, tenant: str, num_bytes: int) -> None:
        holdings = self._tenants[tenant]
        holdings.num_bytes -= num_bytes
        self.num_bytes -= num_bytes
        if not holdings.entries:  # (a tenant holding nothing is forgotten: keys come and go)
            del self._tenants[tenant]

    def response(self, tenant: str, response_id: str) -> dict[str, Any]:
        """The stored Response (ApiError 404 if this tenant has none of that id)."""
        return json.loads(self._get(tenant, response_id, "response_id").response)

    def input_items(
        self, tenant: str, response_id: str, answered: bool = False
    ) -> list[dict[str, Any]]:
        """The items `response_id` was generated from, first to last: each earlier turn's
        input and output items, then its own input items, and its output items if `answered`
        (the conversation a turn continuing it began with). ApiError 404 naming `response_id`
        if this tenant has no response of that id, as `response` answers, or when a turn of
        its conversation is gone (the list would be cut short)."""
        self._get(tenant, response_id, "response_id")
        chain, at = self._walk(tenant, response_id)
        if at is not None:
            why = (
                f"{at}, a response of its conversation, is gone"
                if len(chain) < MAX_CHAIN
                else f"its conversation is longer than {MAX_CHAIN} responses"
            )
            raise ApiError(
                404,
                f"the input items of {response_id} are not stored here: {why}",
                param="response_id",
            )
        items: list[dict[str, Any]] = []
        for turn_id, turn in reversed(chain):
            items += json.loads(turn.items)
            if answered or turn_id != response_id:  # an earlier turn's answer: input to this
                items += json.loads(turn.response)["output"]
        return items

    def delete(self, tenant: str, response_id: str) -> None:
        self._get(tenant, response_id, "response_id")
        self._drop_bytes(tenant, self._tenants[tenant].entries.pop(response_id).num_bytes)

    def conversation(
        self, tenant: str, response_id: str, max_chars: int | None = None
    ) -> list[dict[str, Any]]:
        """The chat messages of the conversation that ended with `response_id`, first to last
        (ApiError 400 naming `previous_response_id` when it, or a turn before it, is gone, or
        when they hold more than `max_chars` characters of JSON: the gateway passes its body
        limit, as the conversation sent whole would be refused, and each turn's input is
        bounded by it, but a chain of them is not, and all of it would be tokenized before the
        context's bound refused it)."""
        chain, at = self._walk(tenant, response_id)
        if at is not None and len(chain) < MAX_CHAIN:
            gone = "" if at == response_id else f", of which {at} was"
            raise ApiError(
                400,
                f"no response {response_id} is stored here{gone} (responses live in the"
                " memory of the gateway that answered them, and the oldest leave first):"
                " send the whole conversation in `input`",
                param="previous_response_id",
            )
        if at is not None:
            raise ApiError(
                400,
                f"the conversation of {response_id} is longer than {MAX_CHAIN} responses:"
                " send the whole conversation in `input`",
                param="previous_response_id",
            )
        num_chars = sum(len(turn.messages) for _, turn in chain)
        if max_chars is not None and num_chars > max_chars:
            raise ApiError(
                400,
                f"the conversation of {response_id} holds {num_chars} characters, more than the"
                f" {max_chars} a request body may: start a new conversation",
                param="previous_response_id",
            )
        self._touch(tenant, chain)
        return [message for _, turn in reversed(chain) for message in json.loads(turn.messages)]

    def _touch(self, tenant: str, chain: list[tuple[str, Stored]]) -> None:
        """The chain's turns (`_walk`'s: the tenant's) used now: the last of theirs to leave."""
        for turn_id, _ in chain:
            self._tenants[tenant].entries.move_to_end(turn_id)

    def _walk(self, tenant: str, response_id: str) -> tuple[list[tuple[str, Stored]], str | None]:
        """The turns of `response_id`'s chain, last first, at most MAX_CHAIN of them, and the id
        the walk stopped at: None at the chain's start, else a turn gone (or another tenant's),
        or the one past MAX_CHAIN."""
        entries = self._entries_of(tenant)
        chain: list[tuple[str, Stored]] = []
        at: str | None = response_id
        while at is not None and len(chain) < MAX_CHAIN:
            stored = entries.get(at)
            if stored is None:
                return chain, at
            chain.append((at, stored))
            at = stored.previous_id
        return chain, at

    def _get(self, tenant: str, response_id: str, param: str) -> Stored:
        stored = self._entries_of(tenant).get(response_id)
        if stored is None:
            raise ApiError(404, f"no response {response_id} is stored here", param=param)
        return stored

    def _entries_of(self, tenant: str) -> Mapping[str, Stored]:
        holdings = self._tenants.get(tenant)
        return holdings.entries if holdings is not None else {}
