"""Tool calls cut out of a chat choice's text, as it streams or all at once (one parser for both,
so a streamed answer and a non-streamed one carry the same content and the same calls).

The fallback format (services.gateway.tools): with `auto`, a call is a tagged
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` anywhere in the text; with a forced
choice the whole text is one call's JSON, constrained by its schema.

- A call is sent only once it is complete and parses as a call of a known tool: a client never
  gets part of a call that turns out malformed. So a streamed call arrives as one delta with its
  id, name and whole arguments (OpenAI's streaming shape; clients concatenate deltas by `index`).
- Text that could still be the start of a tag is held back until it is not (as stop strings are).
- A tagged block that does not parse, or names an unknown tool, stays in the content verbatim, as
  does an unclosed tag when the choice ends (`length`), and a forced call that is incomplete.
- Content is trimmed of surrounding whitespace (the newlines models put around calls): a
  whitespace run is held until text follows it, and dropped at the start and the end.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from services.gateway.tools import ToolSetup

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"


@dataclass
class ToolOutput:
    """What one push (or the finish) adds to a choice: content text and complete calls."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """One choice's text in, content and calls out. push() as text arrives, finish() once."""

    def __init__(self, setup: ToolSetup) -> None:
        self.setup = setup
        self._names = frozenset(f["name"] for f in setup.functions)
        self._pending = ""  # text not yet classified (a possible tag start, or a call's body)
        self._in_call = False
        self._held_space = ""  # whitespace sent only if content follows it
        self._content_started = False
        self.num_calls = 0

    def push(self, text: str) -> ToolOutput:
        if self.setup.choice == "none":
            return ToolOutput(text)
        self._pending += text
        if self.setup.forced:  # the whole text is one call: judged at the end
            return ToolOutput()
        out = ToolOutput()
        while self._step(out):
            pass
        return out

    def finish(self) -> ToolOutput:
        """The rest: a forced call, or the held-back text of an unfinished tag, as content."""
        out = ToolOutput()
        if self.setup.choice == "none":
            return out
        rest, self._pending = self._pending, ""
        if self.setup.forced:
            call = self._call(rest)
            if call is not None:
                out.calls.append(call)
            else:
                out.content = rest  # an incomplete forced call is shown as it is, never trimmed
            return out
        self._add_content(out, OPEN_TAG + rest if self._in_call else rest, final=True)
        return out

    def _step(self, out: ToolOutput) -> bool:
        """Classifies what it can of the pending text; True when it should be called again."""
        if self._in_call:
            end = self._pending.find(CLOSE_TAG)
            if end < 0:
                return False
            body, self._pending = self._pending[:end], self._pending[end + len(CLOSE_TAG) :]
            self._in_call = False
            call = self._call(body)
            if call is None:
                self._add_content(out, OPEN_TAG + body + CLOSE_TAG)
            else:  # the whitespace held before it joins the text after it, if any
                out.calls.append(call)
            return True
        start = self._pending.find(OPEN_TAG)
        if start >= 0:
            self._add_content(out, self._pending[:start])
            self._pending = self._pending[start + len(OPEN_TAG) :]
            self._in_call = True
            return True
        keep = _partial_tag_length(self._pending)
        cut = len(self._pending) - keep
        self._add_content(out, self._pending[:cut])
        self._pending = self._pending[cut:]
        return False

    def _add_content(self, out: ToolOutput, text: str, final: bool = False) -> None:
        text = self._held_space + text
        if not self._content_started:
            text = text.lstrip()
        shown = text.rstrip()
        self._held_space = "" if final else text[len(shown) :]
        if shown:
            self._content_started = True
            out.content += shown

    def _call(self, raw: str) -> dict[str, Any] | None:
        try:
            call = json.loads(raw)
        except json.JSONDecodeError:
            return None
        if not isinstance(call, dict) or call.get("name") not in self._names:
            return None
        arguments = call.get("arguments", {})
        self.num_calls += 1
        return {
            "index": self.num_calls - 1,
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "type": "function",
            "function": {"name": call["name"], "arguments": json.dumps(arguments)},
        }


def _partial_tag_length(text: str) -> int:
    """The length of the longest end of `text` that begins the open tag (kept back)."""
    for length in range(min(len(OPEN_TAG) - 1, len(text)), 0, -1):
        if OPEN_TAG.startswith(text[-length:]):
            return length
    return 0


def extract_tool_calls(setup: ToolSetup, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished choice's whole text, as a stream would give
    them; content None when calls leave none. The calls have the non-streamed shape (no `index`)."""
    parser = ToolCallParser(setup)
    pushed, finished = parser.push(text), parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in pushed.calls + finished.calls]
    content = pushed.content + finished.content
    return (content or None) if calls else content, calls
