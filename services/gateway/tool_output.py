"""Tool calls cut out of a chat choice's text, as it streams or all at once (one parser for both,
so a streamed answer and a non-streamed one carry the same content and the same calls).

With `auto`, calls are the blocks of the generation's format (services.gateway.tool_formats:
tagged `<tool_call>...</tool_call>` blocks anywhere, Mistral's `[TOOL_CALLS]` to the end, Llama
3's bare JSON answer); with a forced choice the whole text is one call's JSON, constrained by its
schema, whatever the format.

- A call is sent only once its block is complete and parses as calls of known tools: a client
  never gets part of a call that turns out malformed. So a streamed call arrives as one delta with
  its id, name and whole arguments (OpenAI's streaming shape; clients concatenate deltas by
  `index`). A block that runs to the end of the text is judged when the choice finishes.
- Text that could still be the start of an opener is held back until it is not (as stop strings
  are).
- With `parallel_tool_calls: false` the first call alone is kept: later blocks that parse as
  calls are dropped, neither calls nor content, and so is a block the choice's end cuts after
  it (`length`: a second call being written, which would be dropped whole).
- A block that does not parse, or names an unknown tool, stays in the content verbatim, as does
  an unclosed tagged block when the choice ends (`length`), and a forced call that is incomplete.
- Content is the text as written, but for the whitespace that calls leave (the newlines models
  put around them): a whitespace run is held until text follows it, and dropped when there is
  nothing but calls between it and the start or the end of the text. So without calls the
  content is the whole text, as a non-streamed response gives it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from services.gateway.tool_formats import TAGGED, Call, ToolFormat
from services.gateway.tools import ToolSetup, json_text


@dataclass
class ToolOutput:
    """What one push (or the finish) adds to a choice: content text and complete calls."""

    content: str = ""
    calls: list[dict[str, Any]] = field(default_factory=list)


class ToolCallParser:
    """One choice's text in, content and calls out. push() as text arrives, finish() once."""

    def __init__(self, setup: ToolSetup, tool_format: ToolFormat = TAGGED) -> None:
        self.setup = setup
        self.format = tool_format
        self._names = frozenset(f["name"] for f in setup.functions)
        self._pending = ""  # text not yet classified (a possible opener, or a block's body)
        self._opener: str | None = None  # the opener of the block being read, if any
        self._closer_from = 0  # where in the block's text a closer may still begin (`_block_end`)
        self._held_space = ""  # whitespace sent only if content follows it
        self._content_started = False
        self._after_call = False  # a call was cut out since the last content
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
        """The rest: a forced call, a block that runs to the end, or held-back text as content."""
        out = ToolOutput()
        if self.setup.choice == "none":
            return out
        rest, self._pending = self._pending, ""
        if self.setup.forced:
            calls = self._calls(TAGGED.decode(rest))
            if calls is not None:
                out.calls += calls
            else:
                out.content = rest  # an incomplete forced call is shown as it is, never trimmed
            return out
        if self._opener is not None:
            block = self._opener + rest
            calls = self._calls(self.format.calls(block)) if self.format.closer is None else None
            if calls is not None:
                out.calls += calls
                block, self._after_call = "", True
            elif self._only_call_made():  # cut inside a second call, which goes whole
                block = ""
            rest = block
        self._add_content(out, rest, final=True)
        return out

    def _step(self, out: ToolOutput) -> bool:
        """Classifies what it can of the pending text; True when it should be called again."""
        if self._opener is not None:
            return self._close_block(out)
        start, opener = self._find_opener()
        if opener is not None:
            self._add_content(out, self._pending[:start])
            self._pending = self._pending[start + len(opener) :]
            self._opener, self._closer_from = opener, 0
            return True
        cut = len(self._pending) - self._undecided_length()
        self._add_content(out, self._pending[:cut])
        self._pending = self._pending[cut:]
        return False

    def _close_block(self, out: ToolOutput) -> bool:
        end = self._block_end()
        if end < 0:  # the block goes on (or runs to the end of the text)
            return False
        block, self._pending = self._opener + self._pending[:end], self._pending[end:]
        self._opener = None
        calls = self._calls(self.format.calls(block))
        if calls is None:
            self._add_content(out, block)
        else:  # the whitespace held before it joins the text after it, if any
            out.calls += calls
            self._after_call = True
        return True

    def _block_end(self) -> int:
        """Where the block's closer ends in the pending text; -1 while none has come. A closer
        inside one of the block's JSON strings (`"Pa</tool_call>ris"`: a call's grammar allows
        it) is the string's text, not the block's end."""
        closer = self.format.closer
        at = -1 if closer is None else self._pending.find(closer, self._closer_from)
        while at >= 0 and _inside_json_string(self._pending, at):
            at = self._pending.find(closer, at + 1)  # type: ignore[arg-type]
        if at < 0 or closer is None:
            # (Not searched again, nor its strings walked, on the next push: a long string
            # holding a closer cost a walk of the whole block a push.)
            self._closer_from = max(0, len(self._pending) - len(closer or "") + 1)
            return -1
        return at + len(closer)

    def _find_opener(self) -> tuple[int, str | None]:
        """Where the first opener in the pending text starts, and which; (-1, None) if none."""
        if self.format.only_at_start:
            if self._content_started:
                return -1, None
            text = self._pending.lstrip()
            at = len(self._pending) - len(text)
            return next(((at, o) for o in self.format.openers if text.startswith(o)), (-1, None))
        found = [(self._pending.find(o), o) for o in self.format.openers]
        return min(((at, o) for at, o in found if at >= 0), default=(-1, None))

    def _undecided_length(self) -> int:
        """How much of the pending text's end could still grow into an opener (kept back)."""
        if self.format.only_at_start:
            text = self._pending.lstrip()
            could_open = any(o.startswith(text) for o in self.format.openers)
            return len(self._pending) if could_open and not self._content_started else 0
        text = self._pending
        for length in range(min(len(text), max(map(len, self.format.openers)) - 1), 0, -1):
            if any(o.startswith(text[-length:]) for o in self.format.openers):
                return length
        return 0

    def _add_content(self, out: ToolOutput, text: str, final: bool = False) -> None:
        text = self._held_space + text
        if self._after_call and not self._content_started:
            text = text.lstrip()  # only calls before it
        shown = text.rstrip()
        if shown:
            self._content_started, self._after_call = True, False
        if final and not self._after_call:
            shown = text  # the content's own trailing whitespace: no call follows it
        self._held_space = "" if final else text[len(shown) :]
        out.content += shown

    def _only_call_made(self) -> bool:
        """The choice holds the one call `parallel_tool_calls: false` allows."""
        return not self.setup.parallel and self.num_calls > 0

    def _calls(self, found: list[Call] | None) -> list[dict[str, Any]] | None:
        """Found calls in OpenAI's streamed shape; None if there are none or one names an
        unknown tool (the block is then content)."""
        if not found or any(name not in self._names for name, _ in found):
            return None
        if not self.setup.parallel:  # one call a choice: the first is kept, later ones dropped
            found = found[: max(0, 1 - self.num_calls)]
        calls = []
        for name, arguments in found:
            calls.append({
                "index": self.num_calls,
                "id": self.format.new_call_id(),
                "type": "function",
                "function": {"name": name, "arguments": json_text(arguments)},
            })  # fmt: skip
            self.num_calls += 1
        return calls


def _inside_json_string(text: str, end: int) -> bool:
    """Whether `text[end]` falls inside a JSON string of `text` (quotes counted, escapes
    skipped)."""
    inside = escaped = False
    for char in text[:end]:
        if escaped:
            escaped = False
        elif char == "\\" and inside:
            escaped = True
        elif char == '"':
            inside = not inside
    return inside


def extract_tool_calls(
    setup: ToolSetup, text: str, tool_format: ToolFormat = TAGGED
) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, OpenAI tool_calls) of a finished choice's whole text, as a stream would give
    them; content None when calls leave none. The calls have the non-streamed shape (no `index`)."""
    parser = ToolCallParser(setup, tool_format)
    pushed, finished = parser.push(text), parser.finish()
    calls = [{k: v for k, v in c.items() if k != "index"} for c in pushed.calls + finished.calls]
    content = pushed.content + finished.content
    return (content or None) if calls else content, calls
