"""Checking a batch's input file before anything runs, as OpenAI does in `validating`.

The file is read line by line from disk (never whole). Each line must be a JSON object with a
non-empty string `custom_id`, `method` POST, a `url` equal to the batch's endpoint and a `body`
object whose `model` the cluster serves; `custom_id`s must be unique in the file (the `lines`
table's UNIQUE key finds duplicates without a set in memory); every string in it must be
Unicode (JSON lets `\ud83d` stand alone, and neither SQLite nor the cluster takes it). Every
offending line is reported, numbered from 1, in OpenAI's `errors.data` shape, quoting at most
QUOTE_CHARS of the line's own values (1,000 errors are kept: the batch object that carries them
must stay small enough to send); one bad line fails the whole batch. A line
that passes is recorded with its byte offset, so the runner can read it again later by seeking,
and with its prefix key (`prefix_key`), the order the runner feeds lines in. Blank lines are
skipped, as OpenAI does, up to MAX_BLANK_LINES: a create waits for its count, and a 200 MB file
of newlines is 200 million lines to skip (about 30 s, as long as the gateway waits for an
answer). Both the count and `validate` run in worker threads, off the service's loop (a 200 MB
file takes seconds to validate, in which the loop answered no call). A thread does not take a
line's parsing off the loop, though (json holds the GIL): a line longer than LONG_LINE_BYTES is
parsed in a child process instead (`_LongLines`).
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import re
import signal
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from services.batch.ceding import ceding
from services.batch.store import Store
from shared.wire_base import MAX_JSON_LEN

PAGE_LINES = 1000  # lines recorded per transaction
# Characters of a prompt's start that order the feed (~120 tokens: several 16-token KV blocks).
PREFIX_KEY_CHARS = 512
MAX_ERRORS = 1000  # errors.data entries kept (the count of the rest is in the last one)
QUOTE_CHARS = 100  # of a value an error message quotes
MAX_BLANK_LINES = 100_000  # skipped in one file (~20 ms); past them the file is refused
# A longer line is parsed in a child process: in the validation's thread, json held the loop
# too, about 1 s per 100 MB of text and 3 s for 140 MB of token ids. (Such a line is answered
# 413 unread when its job runs: no RPC call carries it. Shorter ones take 100 ms at most.)
LONG_LINE_BYTES = MAX_JSON_LEN
# Where a lone surrogate can come from in a UTF-8 line: a \uD800-\uDFFF escape, or the bytes
# that encode one (json.loads decodes bytes with surrogatepass).
_SURROGATE_SOURCE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]")


def error(code: str, message: str, line: int | None = None, param: str | None = None) -> dict:
    return {"code": code, "message": message, "param": param, "line": line}


class ValidationStopped(Exception):
    """The validation was asked to stop (its batch cancelled, or the service stopping)."""


class TooManyBlankLines(ValueError):
    def __init__(self) -> None:
        super().__init__(f"the input file has more than {MAX_BLANK_LINES} blank lines")


def raw_lines(path: Path) -> Iterator[tuple[int, int, bytes]]:
    """(line number from 1, byte offset, bytes without the newline) of each non-blank line;
    TooManyBlankLines once more than MAX_BLANK_LINES were skipped."""
    offset = num_blank = 0
    with open(path, "rb") as file:
        for line_no, raw in enumerate(ceding(file), 1):  # (read in a worker thread)
            text = raw.rstrip(b"\r\n")
            if text.strip():
                yield line_no, offset, text
            else:
                num_blank += 1
                if num_blank > MAX_BLANK_LINES:
                    raise TooManyBlankLines
            offset += len(raw)


def num_requests(path: Path, at_most: int) -> int:
    """The file's non-blank lines, counted no further than `at_most` (a file past a limit is
    refused without reading the rest of it); TooManyBlankLines as `raw_lines`."""
    return sum(1 for _ in itertools.islice(raw_lines(path), at_most))


def prefix_key(body: dict[str, Any]) -> str:
    """The first PREFIX_KEY_CHARS characters of the line's prompt, as it gives it: a chat's
    messages (role and text, in order; a Responses line's instructions and input items as
    such) or a completion's prompt (text, or token ids written out).
    Lines are fed in the order of these keys, so prompts that share a start (a system prompt,
    few-shot examples) sit next to each other and the prefix cache computes that start once per
    job rather than once per line; lines with equal keys keep their file order. Only the key's
    characters are written out (a prompt of a million token ids was written out whole, in
    seconds, to keep 512 characters of it)."""
    messages, prompt = body.get("messages"), body.get("prompt")
    if messages is None and "input" in body:  # a Responses line: its instructions, then input
        messages = _responses_messages(body)
    if isinstance(messages, list):
        text = "\x00".join(_up_to_the_key(messages, _message_text))
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        text = _text_of(prompt[0])  # several prompts in one line: the first leads
    else:
        text = _text_of(prompt)
    return text[:PREFIX_KEY_CHARS]


def _responses_messages(body: dict[str, Any]) -> list[Any]:
    given, instructions = body.get("input"), body.get("instructions")
    items = given if isinstance(given, list) else [{"role": "user", "content": given}]
    return [{"role": "system", "content": instructions}, *items] if instructions else items


def _message_text(message: Any) -> str:
    if not isinstance(message, dict):
        return ""
    return f"{message.get('role')}\x00{_text_of(message.get('content'))}"


def _up_to_the_key(items: list, text_of: Callable[[Any], str]) -> Iterator[str]:
    """The texts of `items` in order, no further than the one that brings their length to
    PREFIX_KEY_CHARS (the rest cannot reach the key)."""
    size = 0
    for item in items:
        text = text_of(item)
        if text:
            yield text
        size += len(text)
        if size >= PREFIX_KEY_CHARS:
            return


def _text_of(content: Any) -> str:
    """The content's text, or at least its first PREFIX_KEY_CHARS characters."""
    if isinstance(content, str):
        return content[:PREFIX_KEY_CHARS]
    if isinstance(content, list):  # chat content parts, or token ids
        return "".join(_up_to_the_key(content, _part_text))
    return ""


def _part_text(part: Any) -> str:
    if isinstance(part, dict):  # a content part: its text, when it is one (else the parser's 400)
        text = part.get("text")
        return text[:PREFIX_KEY_CHARS] if isinstance(text, str) else ""
    return f"{part},"


def quoted(value: Any) -> str:
    """`value` as an error message quotes it: its repr, cut at QUOTE_CHARS characters (then an
    ellipsis), or only its kind when it is an array or object."""
    if isinstance(value, list | dict):  # (its repr may be huge, or nested past the stack)
        return "an array" if isinstance(value, list) else "an object"
    text = repr(value)
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "…"


def has_lone_surrogate(value: Any) -> bool:
    """Whether a string anywhere in `value` (a key too) is not Unicode: a lone surrogate
    escape, which json.loads accepts and UTF-8 cannot encode. Walked without recursion (the
    line may nest as deep as json.loads allows)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode()
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack += item.keys()
            stack += item.values()
        elif isinstance(item, list):
            stack += item
    return False


def may_hold_a_surrogate(text: bytes) -> bool:
    """Whether the line's JSON can decode to a lone surrogate (else has_lone_surrogate need not
    walk it: a line of thousands of token ids took milliseconds to walk)."""
    if not json.detect_encoding(text).startswith("utf-8"):  # (UTF-16 or 32: no shortcut)
        return True
    return _SURROGATE_SOURCE.search(text) is not None


def check_line(text: bytes, endpoint: str, models: list[str]) -> tuple[str | None, str, list[dict]]:
    """(the line's custom_id if it has one, its prefix key, the problems found), without line
    numbers."""
    try:
        line = json.loads(text)
    except (ValueError, RecursionError) as e:  # (an int over 4,300 digits, deep nesting too)
        return None, "", [error("invalid_json", f"the line is not valid JSON: {e}")]
    if not isinstance(line, dict):
        return None, "", [error("invalid_json", "the line must be a JSON object")]
    # (nothing of such a line is recorded: SQLite cannot store it)
    if may_hold_a_surrogate(text) and has_lone_surrogate(line):
        message = "the line holds a string that is not Unicode (a lone surrogate such as \\ud83d)"
        return None, "", [error("invalid_json", message)]
    problems = []
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > 512:
        # (A given one that is no such string is an invalid value, not a missing one.)
        code = "missing_required_parameter" if custom_id in (None, "") else "invalid_value"
        message = "custom_id must be a non-empty string of at most 512 characters"
        problems.append(error(code, message, param="custom_id"))
        custom_id = None
    if line.get("method") != "POST":
        problems.append(error("invalid_value", "method must be POST", param="method"))
    if line.get("url") != endpoint:
        problems.append(
            error(
                "mismatched_url",
                f"url must be the batch's endpoint {endpoint}, got {quoted(line.get('url'))}",
                param="url",
            )
        )
    body = line.get("body")
    key = prefix_key(body) if isinstance(body, dict) else ""
    if not isinstance(body, dict):
        problems.append(error("invalid_value", "body must be a JSON object", param="body"))
    elif body.get("model") is None:  # ("the model None is not served here" said it)
        message = "body.model is required (served: " + ", ".join(models) + ")"
        problems.append(error("missing_required_parameter", message, param="body.model"))
    elif body.get("model") not in models:
        served = ", ".join(models)
        problems.append(
            error(
                "model_not_found",
                f"the model {quoted(body.get('model'))} is not served here (served: {served})",
                param="body.model",
            )
        )
    return custom_id, key, problems


def _check_line_at(
    path: Path, offset: int, length: int, endpoint: str, models: list[str]
) -> tuple[str | None, str, list[dict]]:
    """`check_line` of the line at `offset`, read here (in the child process: the line's bytes
    never cross the pipe)."""
    with open(path, "rb") as file:
        file.seek(offset)
        return check_line(file.read(length), endpoint, models)


class _LongLines:
    """Checks lines longer than LONG_LINE_BYTES in a child process, started (spawned: the
    service's threads are not forked) for the first such line and stopped with the validation.
    The child ignores SIGINT: else a Ctrl-C meant for the service would break the pool first
    and fail the batch as the service stops (a stopped validation runs again at the restart)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    def check(
        self, path: Path, offset: int, length: int, endpoint: str, models: list[str]
    ) -> tuple[str | None, str, list[dict]]:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(
                max_workers=1,
                mp_context=context,
                initializer=signal.signal,
                initargs=(signal.SIGINT, signal.SIG_IGN),
            )
        return self._pool.submit(_check_line_at, path, offset, length, endpoint, models).result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)


def validate(
    store: Store, batch: dict[str, Any], models: list[str], stop: threading.Event | None = None
) -> tuple[int, list[dict]]:
    """Records the lines of `batch`'s input file; (number of lines, errors). Errors mean the
    batch fails and its recorded lines are dropped. Runs in a thread of its own (a 200 MB file
    takes seconds), with a connection of its own (`store`); `stop` set, it drops the lines
    recorded and raises ValidationStopped at the next line."""
    store.drop_lines(batch["id"])  # a validation cut short by a kill starts again
    errors: list[dict] = []
    num_errors = num_lines = 0
    page: list[tuple[int, str, int, int, str]] = []

    def flush() -> None:
        for line_no in store.add_lines(batch["id"], page):
            found(
                error(
                    "duplicate_custom_id",
                    "this custom_id appears on an earlier line",
                    line_no,
                    "custom_id",
                )
            )
        page.clear()

    def found(problem: dict) -> None:
        nonlocal num_errors
        num_errors += 1
        if len(errors) < MAX_ERRORS:
            errors.append(problem)

    path = store.path_of(batch["input_file_id"])
    long_lines = _LongLines()
    try:
        for line_no, offset, text in raw_lines(path):
            if stop is not None and stop.is_set():
                store.drop_lines(batch["id"])
                raise ValidationStopped
            num_lines += 1
            if len(text) > LONG_LINE_BYTES:
                checked = long_lines.check(path, offset, len(text), batch["endpoint"], models)
            else:
                checked = check_line(text, batch["endpoint"], models)
            custom_id, key, problems = checked
            for problem in problems:
                found({**problem, "line": line_no})
            if custom_id is not None:
                page.append((line_no, custom_id, offset, len(text), key))
            if len(page) >= PAGE_LINES:
                flush()
    except TooManyBlankLines as refused:  # (batch_create refuses such a file first)
        found(error("too_many_blank_lines", str(refused)))
    finally:
        long_lines.close()
    flush()
    if num_lines == 0 and not num_errors:
        found(error("empty_file", "the input file has no requests"))
    if num_errors > len(errors):
        errors.append(error("too_many_errors", f"{num_errors - len(errors)} more errors"))
    if errors:
        store.drop_lines(batch["id"])
    errors.sort(key=lambda e: (e["line"] is None, e["line"] or 0))
    return num_lines, errors
