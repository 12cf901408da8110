"""OpenAI's Responses API (`POST /v1/responses`), served as a chat completion.

Agent frameworks speak it first (the OpenAI Agents SDK's default model, Codex): a request's
`instructions`, `input` items (messages, `function_call`s and their `function_call_output`s),
flat function `tools`, `tool_choice`, `text.format` and `max_output_tokens` become a chat
request (`chat_body`), which runs as any other (its tools, structured output, prefix cache and
fair share included); the chat answer becomes a Response (`response_object`), its stream a
Response's typed events (`ResponseEvents`).

A response is stored (`store`, true by default, as OpenAI's) in the gateway's memory
(services.gateway.response_store), so `previous_response_id` continues its conversation: the
earlier turns' chat messages come before this input (the earlier instructions do not, as
OpenAI has it), and `GET /v1/responses/{id}/input_items` lists the items it was generated from
(`input_items`, kept with it; `input_item_page`). Where no store serves (a batch line),
`previous_response_id` is a 400, as are item references and `conversation`: the conversation
is to be sent in `input`. Hosted tools (web search, file search, computer use, ...), images,
files and reasoning items are refused by name. Every refusal is a 400 naming the field, as the
chat API's are.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

from services.gateway.openai_protocol import MAX_USER_CHARS, ApiError, check_metadata
from services.gateway.response_store import ResponseStore

_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "text",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "user",
        "metadata",
        "store",
        "previous_response_id",
        "truncation",
        "reasoning",
        "service_tier",
        "prompt_cache_key",
        "safety_identifier",
        "include",
        "background",
        "conversation",
        "stream_options",
        "prompt_cache_retention",  # (as `prompt_cache_key`: the prefix cache needs no hint)
        "max_tool_calls",  # calls to built-in tools, of which none are served
        "top_logprobs",
        "prompt",
    }
)
_STATELESS = "no responses are kept for this: send the whole conversation in `input`"
# (Responses are kept, by `previous_response_id`; conversations and single items are not.)
_NOT_REFERENCED = (
    "conversations and item references are not served: send the whole conversation in `input`,"
    " or continue a stored response with `previous_response_id`"
)
# Fields served only at the value that asks nothing of this server, and why.
_ONLY = {
    "conversation": ((None,), _NOT_REFERENCED),
    "prompt": ((None,), "stored prompts are not served: send the `instructions` and `input`"),
    "truncation": ((None, "disabled"), 'only "disabled" is served'),
    "background": ((None, False), "only false is served"),
    "top_logprobs": ((None,), "log probabilities are not served here: use /v1/chat/completions"),
}
_ROLES = frozenset({"user", "assistant", "system", "developer"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})
_FINISH_STATUS = {"length": ("incomplete", "max_output_tokens")}
_ITEM_STATUSES = frozenset({"in_progress", "completed", "incomplete"})
_VERBOSITIES = (None, "low", "medium", "high")  # (echoed in the Response: typed as these)
MAX_ITEMS_PAGE = 100  # OpenAI's bounds on `limit` of a list of input items, and its default
DEFAULT_ITEMS_PAGE = 20


def _fail(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


# -- the request -----------------------------------------------------------------------------


def check_body(body: Any) -> dict[str, Any]:
    """The body, if a JSON object of the Responses API's fields at values served here."""
    if not isinstance(body, dict):
        raise _fail("body", "the request body must be a JSON object")
    unknown = sorted(set(body) - _FIELDS)
    if unknown:
        raise _fail(unknown[0], f"unknown field `{unknown[0]}` for /v1/responses")
    for field, (allowed, why) in _ONLY.items():
        if body.get(field) not in allowed:
            raise _fail(field, why)
    reasoning = body.get("reasoning")
    if reasoning is not None and not isinstance(reasoning, dict):
        raise _fail("reasoning", "must be an object")
    if reasoning and reasoning.get("effort") is not None:
        raise _fail("reasoning", "the served model does not reason: leave `reasoning` out")
    calls = body.get("max_tool_calls")
    if calls is not None and (type(calls) is not int or calls < 1):
        raise _fail("max_tool_calls", "must be a positive integer")
    check_metadata(body.get("metadata"))
    previous = body.get("previous_response_id")
    if previous is not None and not isinstance(previous, str):
        raise _fail("previous_response_id", "must be a response's id")
    if body.get("store") not in (None, True, False):
        raise _fail("store", "must be true or false")
    for field in ("safety_identifier", "user"):  # (checked here: chat knows both as `user`)
        _check_identifier(body, field)
    return body


def _check_identifier(body: Mapping[str, Any], field: str) -> None:
    value = body.get(field)
    if value is not None and (not isinstance(value, str) or len(value) > MAX_USER_CHARS):
        raise _fail(field, f"`{field}` must be a string of at most {MAX_USER_CHARS} characters")


def chat_body(body: Any, earlier: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The chat completions body that serves this Responses body, after the chat messages of
    the conversation it continues (`earlier`, those of its `previous_response_id`; None where
    no responses are kept). ApiError 400 naming the field for what the Responses API does not
    allow, or this server does not serve."""
    body = check_body(body)
    if body.get("previous_response_id") is not None and earlier is None:
        raise _fail("previous_response_id", _STATELESS)
    messages = _instructions(body) + list(earlier or []) + input_messages(body)
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    chat.update(_tools(body))
    format_ = _response_format(body.get("text"))
    if format_ is not None:
        chat["response_format"] = format_
    for ours, theirs in (("max_output_tokens", "max_completion_tokens"),
                         ("temperature", "temperature"), ("top_p", "top_p"),
                         ("parallel_tool_calls", "parallel_tool_calls")):  # fmt: skip
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    user = body.get("safety_identifier") or body.get("user")
    if user is not None:
        chat["user"] = user
    if body.get("stream") is not None:
        chat["stream"] = body["stream"]
        if body["stream"] is True:
            chat["stream_options"] = {"include_usage": True}  # `response.completed` has it
    return chat


def _instructions(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    instructions = body.get("instructions")
    if instructions is None:
        return []
    if not isinstance(instructions, str):
        raise _fail("instructions", "must be a string")
    return [{"role": "system", "content": instructions}]


def input_messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The chat messages of the body's `input` (what a stored turn keeps of it)."""
    given = body.get("input")
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not isinstance(given, list) or not given:
        raise _fail("input", "must be a string or a non-empty list of input items")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(given):
        _add_item(messages, item, f"input[{i}]")
    return messages


def _add_item(messages: list[dict[str, Any]], item: Any, where: str) -> None:
    """Appends the chat message of one input item; function calls join the assistant message
    before them (its text, and the calls before them), and so does an assistant message right
    after its calls (a stream sends text written after a call as an item after the call's), as
    the answer that wrote them is one assistant message (so a conversation echoed back as items
    is the one a stored response continues: `answer_messages`)."""
    if not isinstance(item, dict):
        raise _fail(where, "must be an object")
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # (a set lookup: hashable first)
            raise _fail(f"{where}.role", f"must be one of {sorted(_ROLES)}")
        content = _text(item.get("content"), where)
        last = messages[-1] if messages else None
        if role == "assistant" and last is not None and last.get("tool_calls"):
            # (No call's output between them: the same answer. Its texts join as one, as
            # `answer_messages` joins an answer's.)
            messages[-1] = {**last, "content": _plain(last["content"]) + _plain(content)}
        else:
            messages.append({"role": role, "content": content})
    elif kind == "function_call":
        call = _function_call(item, where)
        last = messages[-1] if messages else None
        if last is not None and last["role"] == "assistant":
            messages[-1] = {**last, "tool_calls": [*(last.get("tool_calls") or []), call]}
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
    elif kind == "function_call_output":
        call_id, output = item.get("call_id"), item.get("output")
        if not isinstance(call_id, str) or not call_id:
            raise _fail(f"{where}.call_id", "must be a non-empty string")
        output = _text(output, where, "output") if isinstance(output, list) else output
        if not isinstance(output, str | list):
            raise _fail(f"{where}.output", "must be a string or a list of text parts")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
    elif kind == "item_reference":
        raise _fail(f"{where}.type", _NOT_REFERENCED)
    else:
        raise _fail(f"{where}.type", f"input items of type {kind!r} are not served")


def _text(content: Any, where: str, field: str = "content") -> str | list[dict[str, str]]:
    """A message's content (or a function's output, `field`) as the chat API takes it: a
    string, or its text parts (which the chat parser joins as it joins chat's own)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _fail(f"{where}.{field}", "must be a string or a list of content parts")
    parts = []
    for i, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # (looked up in a set: a list fails)
        if kind == "refusal" and isinstance(part.get("refusal"), str):
            parts.append({"type": "text", "text": part["refusal"]})
        elif kind in _TEXT_PARTS and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            raise _fail(f"{where}.{field}[{i}]", f"content parts of type {kind!r} are not served")
    return parts


def _plain(content: str | list[dict[str, str]] | None) -> str:
    """A message's content (`_text`'s, or None beside calls) as one text."""
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(part["text"] for part in content)


def input_items(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The body's `input` (checked: `input_messages` took it) as the items
    `GET /v1/responses/{id}/input_items` lists, of OpenAI's ResponseItem types: a string is one
    user message; a message's text is typed parts (`input_text`, an assistant's `output_text`);
    an item keeps the id it was given, or gets one (stored with it: the same on each read)."""
    given = body["input"]
    if isinstance(given, str):
        given = [{"role": "user", "content": given}]
    return [_input_item(item) for item in given]


def _input_item(item: Mapping[str, Any]) -> dict[str, Any]:
    kind = item.get("type", "message")
    status = item.get("status")  # (unchecked by `input_messages`: any other value lists so)
    status = status if isinstance(status, str) and status in _ITEM_STATUSES else "completed"
    if kind == "message":
        assistant = item["role"] == "assistant"
        content = item["content"]
        parts = [{"type": "text", "text": content}] if isinstance(content, str) else content
        return {
            "id": _given_id(item, "msg"),
            "type": "message",
            "role": item["role"],
            "content": [_typed_part(part, assistant) for part in parts],
            "status": status,
        }
    if kind == "function_call":
        fields = {field: item[field] for field in ("call_id", "name", "arguments")}
        return {"id": _given_id(item, "fc"), "type": kind, **fields, "status": status}
    output = item["output"]  # (a function_call_output: the only other kind served)
    if isinstance(output, list):
        output = [_typed_part(part, assistant=False) for part in output]
    return {
        "id": _given_id(item, "fco"),
        "type": kind,
        "call_id": item["call_id"],
        "output": output,
        "status": status,
    }


def _given_id(item: Mapping[str, Any], prefix: str) -> str:
    given = item.get("id")
    return given if isinstance(given, str) and given else _new_id(prefix)


def _typed_part(part: Mapping[str, Any], assistant: bool) -> dict[str, Any]:
    """A text part as an input item lists it: an assistant's `output_text` (or its `refusal`),
    anyone else's `input_text` (a refusal is text the model read, as `_text` has it)."""
    if assistant and part["type"] == "refusal":
        return {"type": "refusal", "refusal": part["refusal"]}
    text = part["refusal"] if part["type"] == "refusal" else part["text"]
    if assistant:
        return {"type": "output_text", "text": text, "annotations": []}
    return {"type": "input_text", "text": text}


def _function_call(item: Mapping[str, Any], where: str) -> dict[str, Any]:
    for field in ("call_id", "name", "arguments"):
        if not isinstance(item.get(field), str):
            raise _fail(f"{where}.{field}", "must be a string")
    if not item["call_id"]:  # (the chat call's id, which its output names)
        raise _fail(f"{where}.call_id", "must be a non-empty string")
    function = {"name": item["name"], "arguments": item["arguments"]}
    return {"id": item["call_id"], "type": "function", "function": function}


def _tools(body: Mapping[str, Any]) -> dict[str, Any]:
    chat: dict[str, Any] = {}
    tools = body.get("tools")
    if tools is not None:
        if not isinstance(tools, list):
            raise _fail("tools", "must be a list of tools")
        chat["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    choice = body.get("tool_choice")
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise _fail("tool_choice", 'must be "none", "auto", "required" or a function')
        choice = {"type": "function", "function": {"name": choice["name"]}}
    if choice is not None:
        chat["tool_choice"] = choice
    return chat


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function":
        kind = tool.get("type") if isinstance(tool, dict) else None
        raise _fail(f"{where}.type", f"only function tools are served, not {kind!r}")
    function = {k: v for k, v in tool.items() if k != "type" and v is not None}
    return {"type": "function", "function": function}


def _response_format(text: Any) -> dict[str, Any] | None:
    if text is None:
        return None
    if not isinstance(text, dict) or set(text) - {"format", "verbosity"}:
        raise _fail("text", 'must be {"format": {...}}')
    if text.get("verbosity") not in _VERBOSITIES:
        raise _fail("text.verbosity", 'must be "low", "medium" or "high"')
    format_ = text.get("format")
    if format_ is None:  # (`verbosity` alone, as the Agents SDK sends it: plain text)
        return None
    if not isinstance(format_, dict):
        raise _fail("text.format", "must be an object")
    kind = format_.get("type")
    if kind in ("text", "json_object"):
        return {"type": kind}
    if kind != "json_schema":
        raise _fail("text.format.type", 'must be "text", "json_object" or "json_schema"')
    schema = {k: format_[k] for k in ("name", "schema", "strict", "description") if k in format_}
    return {"type": "json_schema", "json_schema": schema}


# The chat fields a refusal of the translated body may name, and the Responses fields they are.
_CHAT_PARAMS = (
    ("messages", "input"),
    ("max_completion_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)


def in_responses_terms(error: ApiError) -> ApiError:
    """A refusal of the chat body a Responses body became, naming the field as the client
    wrote it (`responses_param`)."""
    if error.param:
        error.param = responses_param(error.param)
    return error


def responses_param(param: str) -> str:
    """The Responses field a chat field of the translated body stands for (`input`, not
    `messages`; `tools[0].parameters`, not `tools[0].function.parameters`)."""
    for chat, ours in _CHAT_PARAMS:
        if param == chat or param.startswith((f"{chat}.", f"{chat}[")):
            param = "input" if chat == "messages" else ours + param[len(chat) :]
            break
    if param.startswith("tools["):
        param = param.replace(".function.", ".", 1).replace(".function", "", 1)
    return param


# -- a stored response's input items ----------------------------------------------------------


def input_item_page(items: list[dict[str, Any]], query: Mapping[str, str]) -> dict[str, Any]:
    """One page of a response's input items (first to last, as the store lists them), as
    `GET /v1/responses/{id}/input_items` answers it: `order` (`desc`, newest first, by
    default), the items after the one whose id is `after`, at most `limit` (1 to 100, 20 by
    default) of them. `include` is taken and ignored: what it adds (images, files, search
    results) is never in an input served here. ApiError 400 naming a bad value."""
    limit = _page_limit(query.get("limit"))
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise _fail("order", '`order` must be "asc" or "desc"')
    ordered = items if order == "asc" else items[::-1]
    start = _after(ordered, query.get("after"))
    data = ordered[start : start + limit]
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": start + limit < len(ordered),
    }


def _page_limit(given: str | None) -> int:
    if given is None:
        return DEFAULT_ITEMS_PAGE
    if not (given.isascii() and given.isdigit()) or not 1 <= int(given) <= MAX_ITEMS_PAGE:
        raise _fail("limit", f"`limit` must be an integer from 1 to {MAX_ITEMS_PAGE}")
    return int(given)


def _after(ordered: list[dict[str, Any]], after: str | None) -> int:
    """Where the page after the item `after` begins (its first occurrence: a client may have
    given two items one id)."""
    if after is None:
        return 0
    for at, item in enumerate(ordered):
        if item["id"] == after:
            return at + 1
    raise _fail("after", f"no input item {after!r} is in this response's input")


# -- the answer -------------------------------------------------------------------------------


def response_object(body: Mapping[str, Any], chat: Mapping[str, Any]) -> dict[str, Any]:
    """The Response of a chat completion answer (one choice)."""
    choice = chat["choices"][0]
    message = choice["message"]
    output = []
    status, reason = _FINISH_STATUS.get(choice["finish_reason"], ("completed", None))
    if message.get("content"):  # (cut: the text was, or a call written after it; see `end`)
        output.append(_message_item(_new_id("msg"), message["content"], status))
    for call in message.get("tool_calls") or []:
        output.append(_call_item(call, "completed"))
    return _envelope(body, _new_id("resp"), status, reason, output, _usage(chat.get("usage")))


def _envelope(
    body: Mapping[str, Any],
    response_id: str,
    status: str,
    incomplete_reason: str | None,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    created_at: int | None = None,
) -> dict[str, Any]:
    """A Response object: the request's settings echoed, as OpenAI's are."""
    return {
        "id": response_id,
        "object": "response",
        "created_at": int(time.time()) if created_at is None else created_at,
        "status": status,
        "error": None,
        "incomplete_details": None if incomplete_reason is None else {"reason": incomplete_reason},
        "instructions": body.get("instructions"),
        "max_output_tokens": body.get("max_output_tokens"),
        "model": body.get("model"),
        "output": output,
        "parallel_tool_calls": body.get("parallel_tool_calls", True),
        "previous_response_id": body.get("previous_response_id"),
        "reasoning": {"effort": None, "summary": None},
        "store": False,  # (true once stored: `ResponseKeeper`)
        "temperature": body.get("temperature"),
        "text": body.get("text") or {"format": {"type": "text"}},
        "tool_choice": body.get("tool_choice", "auto"),
        "tools": body.get("tools") or [],
        "top_p": body.get("top_p"),
        "truncation": "disabled",
        "usage": usage,
        "user": body.get("user"),
        "metadata": body.get("metadata") or {},
    }


def answer_messages(output: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The chat message a Response's output items make (what a stored turn keeps of them): one
    assistant message with the text and the calls."""
    text = "".join(
        part["text"]
        for item in output
        if item["type"] == "message"
        for part in item["content"]
        if part["type"] == "output_text"
    )
    calls = [_function_call(item, "output") for item in output if item["type"] == "function_call"]
    message: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        message["tool_calls"] = calls
    return [message] if text or calls else []


class ResponseKeeper:
    """Stores a request's Response once answered, with the chat messages its turn added (its
    input and its answer) and its input items, after the turn it continued
    (`previous_response_id`, whose conversation's messages were `earlier` and its items
    `earlier_items` when the request began)."""

    def __init__(
        self,
        store: ResponseStore,
        tenant: str,
        body: Mapping[str, Any],
        earlier: list[dict[str, Any]] | None = None,
        earlier_items: list[dict[str, Any]] | None = None,
    ) -> None:
        self.store, self.tenant, self.body = store, tenant, body
        self.earlier, self.earlier_items = earlier, earlier_items

    def keep(self, response: dict[str, Any]) -> None:
        if response["status"] not in ("completed", "incomplete"):
            return
        messages = input_messages(self.body) + answer_messages(response["output"])
        previous = self.body.get("previous_response_id")
        response["store"] = True  # as the kept copy reads
        response["store"] = self.store.put(
            self.tenant,
            response,
            previous,
            messages,
            self.earlier,
            items=input_items(self.body),
            earlier_items=self.earlier_items,
        )


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": []}
    return {
        "id": item_id,
        "type": "message",
        "role": "assistant",
        "status": status,
        "content": [] if status == "in_progress" else [part],
    }


def _call_item(call: Mapping[str, Any], status: str, item_id: str | None = None) -> dict:
    function = call["function"]
    return {
        "id": item_id or _new_id("fc"),
        "type": "function_call",
        "call_id": call["id"],
        "name": function["name"],
        "arguments": function["arguments"] if status == "completed" else "",
        "status": status,
    }


def _usage(usage: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if usage is None:
        return None
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# -- the stream -------------------------------------------------------------------------------


class ResponseEvents:
    """A chat stream's chunks as a Response's events: `response.created` first, the text as
    `response.output_text.delta`s of one message item, each call as a function_call item (its
    arguments whole, as the chat stream sends a call once it parses), and `response.completed`
    (or `response.incomplete`) with the whole Response and its usage last."""

    def __init__(self, body: Mapping[str, Any], keeper: ResponseKeeper | None = None) -> None:
        self.body = body
        self.keeper = keeper  # stores the Response before the last event carries it
        self.response_id = _new_id("resp")
        self.created_at = int(time.time())  # (every event's Response says the same)
        self._sequence = 0
        self._output: list[dict[str, Any]] = []
        self._message: dict[str, Any] | None = None  # the text item while it streams
        self._text: list[str] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] | None = None

    def start(self) -> Iterator[dict[str, Any]]:
        response = _envelope(
            self.body, self.response_id, "in_progress", None, [], None, self.created_at
        )
        response["store"] = self.keeper is not None  # (to be stored: `end`)
        yield self._event("response.created", response=response)
        yield self._event("response.in_progress", response=response)

    def chunk(self, chunk: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The events of one chat chunk."""
        if chunk.get("usage"):
            self._usage = _usage(chunk["usage"])
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                yield from self._text_delta(delta["content"])
            for call in delta.get("tool_calls") or []:
                yield from self._close_message()
                yield from self._call(call)
            if choice.get("finish_reason") is not None:
                self._finish = choice["finish_reason"]

    def end(self) -> Iterator[dict[str, Any]]:
        status, reason = _FINISH_STATUS.get(self._finish or "stop", ("completed", None))
        # A message still open when the answer was cut is an incomplete one (OpenAI's: it
        # said `completed`, its text cut short by max_output_tokens).
        yield from self._close_message(status)
        response = _envelope(
            self.body, self.response_id, status, reason, self._output, self._usage, self.created_at
        )
        if self.keeper is not None:
            self.keeper.keep(response)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        yield self._event(kind, response=response)

    def error(self, body: Mapping[str, Any]) -> dict[str, Any]:
        """An `error` event of a chat error body (`{"error": {...}}`)."""
        error = body.get("error") or {}
        return self._event(
            "error", code=error.get("code"), message=error.get("message"), param=error.get("param")
        )

    def failed(self, body: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        """The end of a stream that failed midway (a chat error body): the `error` event, the
        text item so far done as incomplete, and `response.failed` with the Response, as
        OpenAI ends one. (Until 2026-12-07 the `error` event alone: an item added was never
        done, and the stream had no final event.) A failed Response is not stored."""
        yield self.error(body)
        yield from self._close_message("incomplete")
        error = body.get("error") or {}
        response = _envelope(
            self.body, self.response_id, "failed", None, self._output, self._usage, self.created_at
        )
        code = error.get("code") or error.get("type") or "server_error"
        response["error"] = {"code": code, "message": error.get("message") or ""}
        yield self._event("response.failed", response=response)

    def _text_delta(self, text: str) -> Iterator[dict[str, Any]]:
        if self._message is None:
            self._message = _message_item(_new_id("msg"), "", "in_progress")
            index = len(self._output)
            yield self._event("response.output_item.added", output_index=index, item=self._message)
            yield self._event(
                "response.content_part.added",
                item_id=self._message["id"],
                output_index=index,
                content_index=0,
                part={"type": "output_text", "text": "", "annotations": []},
            )
        self._text.append(text)
        yield self._event(
            "response.output_text.delta",
            item_id=self._message["id"],
            output_index=len(self._output),
            content_index=0,
            delta=text,
            logprobs=[],
        )

    def _close_message(self, status: str = "completed") -> Iterator[dict[str, Any]]:
        if self._message is None:
            return
        text, item_id, index = "".join(self._text), self._message["id"], len(self._output)
        part = {"type": "output_text", "text": text, "annotations": []}
        where = {"item_id": item_id, "output_index": index, "content_index": 0}
        yield self._event("response.output_text.done", **where, text=text, logprobs=[])
        yield self._event("response.content_part.done", **where, part=part)
        item = _message_item(item_id, text, status)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)
        self._message, self._text = None, []

    def _call(self, call: Mapping[str, Any]) -> Iterator[dict[str, Any]]:
        index, item_id = len(self._output), _new_id("fc")
        added = _call_item(call, "in_progress", item_id)
        yield self._event("response.output_item.added", output_index=index, item=added)
        arguments = call["function"]["arguments"]
        where = {"item_id": item_id, "output_index": index}
        yield self._event("response.function_call_arguments.delta", **where, delta=arguments)
        yield self._event("response.function_call_arguments.done", **where, arguments=arguments)
        item = _call_item(call, "completed", item_id)
        yield self._event("response.output_item.done", output_index=index, item=item)
        self._output.append(item)

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._sequence += 1
        return {"type": kind, "sequence_number": self._sequence - 1, **fields}


def sse(event: Mapping[str, Any]) -> bytes:
    """One Server-Sent Event of the Responses stream: named by its type (no `[DONE]` ends it)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n".encode()
