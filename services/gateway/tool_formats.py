"""The ways chat templates teach a model to write tool calls, told apart by the template's text.

- `tagged` (Hermes, Qwen2.5 and their family; also the fallback format of services.gateway.tools
  for templates that know no tools): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text.
- `mistral`: the marker `[TOOL_CALLS]` (a special token) followed by a JSON list of
  `{"name", "arguments"}` objects, to the end of the text; newer Mistral tokenizers write
  `[TOOL_CALLS]name[ARGS]{...}` once a call. Their templates require call ids of nine letters
  and digits, so calls in this format get such ids.
- `llama3_json` (Llama 3.1 to 3.3): an answer that *begins* with a JSON object
  `{"name": ..., "parameters": {...}}` (optionally after the special token `<|python_tag|>`) is
  a call; several are separated by `;`. Text that begins otherwise is content.

A call block is judged whole: `calls()` gives the (name, arguments) pairs of a block, markers
included, or None when it is not a well-formed block of this format.
"""

from __future__ import annotations

import json
import secrets
import string
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

Call = tuple[str, Any]  # a function's name and its arguments, parsed JSON

_TAG = "<tool_call>"
MISTRAL_MARKER = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_PYTHON_TAG = "<|python_tag|>"
_ID_ALPHABET = string.ascii_letters + string.digits
# What a block that is no JSON raises: a degenerate answer (brackets until max_tokens) nests
# past the decoder's recursion limit, and is content like any other malformed block.
_NOT_JSON = (json.JSONDecodeError, RecursionError)


def _no_constant(name: str) -> Any:
    """`NaN`, `Infinity` and `-Infinity`, which Python's decoder takes and JSON has not: a call
    holding one came back with them in its `arguments`, text no client's JSON parser reads."""
    raise json.JSONDecodeError(f"{name} is not JSON", name, 0)


_DECODER = json.JSONDecoder(parse_constant=_no_constant)


@dataclass(frozen=True)
class ToolFormat:
    name: str
    openers: tuple[str, ...]  # texts that open a call block
    closer: str | None  # closes a block; None: a block runs to the end of the text
    only_at_start: bool  # a block opens only before any content
    decode: Callable[[str], list[Call] | None]  # a block's text from its opener, closer cut
    new_call_id: Callable[[], str]
    inner_markers: tuple[str, ...] = ()  # texts inside a block that `decode` reads

    def calls(self, block: str) -> list[Call] | None:
        """The calls of a whole block (from its opener to its closer or the end), or None."""
        if not block.startswith(self.openers):
            return None
        if self.closer is not None:
            if not block.endswith(self.closer):
                return None
            block = block[: -len(self.closer)]
        return self.decode(block)


def _openai_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _mistral_call_id() -> str:
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


def _call(obj: Any, arguments_keys: tuple[str, ...]) -> Call | None:
    """An object `{"name": str, <arguments key>: object}` as a call; None if it is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    keys = [k for k in arguments_keys if k in obj]
    arguments = obj[keys[0]] if keys else {}
    if not isinstance(arguments, dict):
        return None
    return obj["name"], arguments


def _tagged_calls(body: str) -> list[Call] | None:
    call = _call(_json_or_none(body.removeprefix(_TAG)), ("arguments",))
    return None if call is None else [call]


def _mistral_calls(body: str) -> list[Call] | None:
    # A list after one marker, read whole first: a marker inside one of its strings is text.
    whole = _json_or_none(body.removeprefix(MISTRAL_MARKER))
    if isinstance(whole, list) and whole:
        found = [_call(obj, ("arguments",)) for obj in whole]
        if None not in found:
            return found  # type: ignore[return-value]
    calls: list[Call] = []
    # The newer form repeats the marker once a call.
    for part in body.removeprefix(MISTRAL_MARKER).split(MISTRAL_MARKER):
        part = part.strip()
        if _MISTRAL_ARGS in part:
            name, _, arguments = part.partition(_MISTRAL_ARGS)
            part = json.dumps({"name": name.strip(), "arguments": _json_or_none(arguments)})
        objs = _json_or_none(part)
        objs = objs if isinstance(objs, list) else [objs]
        found = [_call(obj, ("arguments",)) for obj in objs]
        if not found or None in found:
            return None
        calls += found
    return calls


_LLAMA3_CALL_KEYS = frozenset({"name", "parameters", "arguments"})


def _llama3_calls(body: str) -> list[Call] | None:
    decoder, calls, at = _DECODER, [], 0
    body = body.strip().removeprefix(_PYTHON_TAG).strip()
    while at < len(body):
        try:
            obj, at = decoder.raw_decode(body, at)
        except _NOT_JSON:
            return None
        # Nothing but a name and its arguments: an answer that begins as JSON (a response
        # format's object holding a "name") is content, even if the name is a tool's.
        if not isinstance(obj, dict) or not set(obj) <= _LLAMA3_CALL_KEYS:
            return None
        call = _call(obj, ("parameters", "arguments"))
        if call is None:
            return None
        calls.append(call)
        at = len(body) - len(body[at:].lstrip().removeprefix(";").lstrip())
    return calls or None


def _json_or_none(text: str) -> Any:
    try:
        return _DECODER.decode(text)
    except _NOT_JSON:
        return None


TAGGED = ToolFormat("tagged", (_TAG,), "</tool_call>", False, _tagged_calls, _openai_call_id)
MISTRAL = ToolFormat(
    "mistral", (MISTRAL_MARKER,), None, False, _mistral_calls, _mistral_call_id, (_MISTRAL_ARGS,)
)
LLAMA3_JSON = ToolFormat(
    "llama3_json", (_PYTHON_TAG, "{"), None, True, _llama3_calls, _openai_call_id
)

# What in a template's text shows the call format it teaches; tried in this order.
_TEMPLATE_SIGNS = (
    (TAGGED, (_TAG,)),
    (MISTRAL, (MISTRAL_MARKER,)),
    (LLAMA3_JSON, ('"parameters": ', _PYTHON_TAG)),
)


def template_tool_format(tokenizer) -> ToolFormat | None:
    """The call format the tokenizer's chat template teaches when given `tools`; None when it
    takes no tools, or teaches a format not listed here (such templates get the fallback)."""
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: a chat with tools renders `tool_use`
        template = template.get("tool_use") or template.get("default")  # (as transformers)
    if not isinstance(template, str) or "tools" not in template:
        return None
    for tool_format, signs in _TEMPLATE_SIGNS:
        if any(sign in template for sign in signs):
            return tool_format
    return None


def special_marker_ids(tokenizer, tool_format: ToolFormat) -> frozenset[int]:
    """The ids of the format's markers (openers, closer, inner markers) that the tokenizer holds
    as special tokens: decoding must keep them (it drops special tokens), or the parser would
    never see a call begin, end, or its arguments start (some models hold both `<tool_call>`
    and `</tool_call>` as special, Mistral's newer ones `[TOOL_CALLS]` and `[ARGS]`)."""
    specials = {t.content: i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    closer = () if tool_format.closer is None else (tool_format.closer,)
    markers = (*tool_format.openers, *closer, *tool_format.inner_markers)
    return frozenset(specials[m] for m in markers if m in specials)
