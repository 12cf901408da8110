"""Turning generated token ids into text as they arrive, and cutting the text at stop strings.

Incremental detokenization (vLLM's prefix/read offsets): the tokens are split by two offsets,
`prefix_offset <= read_offset`. Everything before `read_offset` has been emitted; the tokens in
[prefix_offset, read_offset) are the last emitted piece, decoded again as context. Each step
decodes only the window from `prefix_offset` to the end and emits what it adds to the context's
text, so a step costs the size of the window, not of the whole output. The context matters for
tokenizers whose decoding of a token depends on its neighbours (SentencePiece drops a leading
space at the start of a text); for byte-level BPE it is simply a clean boundary.

As in vLLM, the first context is the prompt's last few tokens (decoded, never emitted), so the
output's text is what it adds to the prompt's: a SentencePiece model's first token `▁Paris`
after "The capital of France is" gives " Paris", not "Paris". A prompt may end inside a
character (token ids sent as they are): the context's text then ends in U+FFFD, and the output
token that completes the character emits all of it.

A byte-level token may hold part of a UTF-8 character (an emoji or a CJK character is often two
or three tokens); decoding such a tail gives U+FFFD. While the window's text ends in U+FFFD its
new text is held back and the window grows, until the character is complete; `flush()` emits
whatever is left at the end. Invariant: the emitted pieces, concatenated, equal the decoding of
all tokens at once (after the prompt's text, with a prompt), and `prefix_offset` always sits on a
character boundary (it is only moved to a `read_offset` whose text did not end in a partial
character), but for the prompt's context, which may begin inside one: its stray bytes decode to
the same U+FFFD in the context and the window.

The window grows only while it must: a character is at most 4 bytes, so a text still ending in
U+FFFD after `_MAX_HELD_TOKENS` more tokens is almost surely bytes no character continues (0x80
alone, which a client's `logit_bias` can force); it is then emitted as it stands, and the window
moves on. (Were a character completed after all, its first bytes would show as one U+FFFD more
than the whole decode has.) Tokens that add no text at all (skipped special tokens, one after
another) are dropped from the window once they are that many. Without both, such a run made
every step decode all of it: 4,000 tokens cost the gateway's event loop 2 to 6 s, every stream
on it waiting.

Stop strings are matched on the emitted text. The matcher holds back the longest tail that could
still grow into a stop string, and cuts the text before the first stop string to be completed.
Text fed with `may_stop=False` (a choice's first `min_tokens` tokens) is searched all the same,
but no stop string may end inside it: one that begins there and ends later still counts.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from collections.abc import Sequence
from typing import Any

from tokenizers.decoders import ByteLevel

_PARTIAL = "\ufffd"  # what decoding gives for an incomplete UTF-8 sequence
_BYTE_FALLBACK_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's name of a byte
# Prompt tokens decoded as the first context (vLLM starts its prefix offset five tokens back).
_NUM_PROMPT_CONTEXT_TOKENS = 6
# Tokens held back (a character still incomplete, or no new text) before a step at which the
# window stops growing; far more than a character's split over tokens takes (at most 4).
_MAX_HELD_TOKENS = 16
# The most tokens one character can be split over: UTF-8 writes a character in 4 bytes at most.
MAX_CHARACTER_TOKENS = 4


class IncrementalDetokenizer:
    """Decodes one sequence's output tokens as they come; see the module docstring."""

    def __init__(
        self,
        tokenizer: Any,
        skip_special_tokens: bool = True,
        keep_special_ids: frozenset[int] = frozenset(),
        prompt_token_ids: Sequence[int] = (),
    ):
        """`keep_special_ids`: special tokens shown all the same (tool-call markers a parser
        must see) while the others are skipped. `prompt_token_ids`: the prompt the output
        continues; its last tokens are the first context."""
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._dropped_ids: frozenset[int] | None = None  # skipped by hand, to keep some
        if skip_special_tokens and keep_special_ids:
            self._dropped_ids = _special_ids(tokenizer) - keep_special_ids
        self._token_ids = list(prompt_token_ids[-_NUM_PROMPT_CONTEXT_TOKENS:])
        self._num_context_tokens = len(self._token_ids)  # the prompt's, at the front
        self._prefix_offset = 0  # start of the decode window, on a character boundary
        self._read_offset = self._num_context_tokens  # tokens before it have been emitted
        self._num_dropped = 0  # tokens that showed nothing, dropped from `_token_ids`
        self._pieces: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return "".join(self._pieces)

    @property
    def num_tokens(self) -> int:
        """Output tokens pushed (the prompt's context not counted)."""
        return len(self._token_ids) - self._num_context_tokens + self._num_dropped

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text that `token_ids` complete; "" while they end inside a character."""
        overdue = len(self._token_ids) - self._read_offset >= _MAX_HELD_TOKENS
        self._token_ids.extend(token_ids)
        return self._advance(final=False, overdue=overdue)

    def flush(self) -> str:
        """Whatever is held back; call it at the end. But a character the output cut off (its
        last bytes never came: `max_tokens` ended it mid-emoji), which decoding shows as U+FFFD,
        is dropped, as vLLM drops it: it ended chat, completions and stored Responses in a "�"
        their tokens' texts did not add up to. (A U+FFFD the model wrote whole stays.)"""
        held = self._token_ids[self._read_offset :]
        text = self._advance(final=True)
        if text.endswith(_PARTIAL) and _ends_inside_a_character(self._tokenizer, held):
            text = text[:-1]
            if text:
                self._pieces[-1] = text
            else:
                self._pieces.pop()
        return text

    def _decode(self, start: int, end: int) -> str:
        window = self._token_ids[start:end]  # (no negative id: the cluster link refuses one)
        if self._dropped_ids is not None:
            window = [t for t in window if t not in self._dropped_ids]
            return self._tokenizer.decode(window, skip_special_tokens=False)
        return self._tokenizer.decode(window, skip_special_tokens=self._skip_special_tokens)

    def _advance(self, final: bool, overdue: bool = False) -> str:
        """`overdue`: the tokens held back before this step were `_MAX_HELD_TOKENS` or more."""
        context = self._decode(self._prefix_offset, self._read_offset)
        window = self._decode(self._prefix_offset, len(self._token_ids))
        if context.endswith(_PARTIAL) and not window.startswith(context):
            # A prompt ending inside a character (or a piece emitted overdue): the output
            # completed it, and shows it. Only the U+FFFD the window no longer has is dropped
            # from the context: those before it are stray bytes' (shown, or the prompt's).
            context = context[: _common_prefix_len(context, window)]
        if overdue and window == context:  # a run of tokens that show nothing: let it go
            self._num_dropped += len(self._token_ids) - self._read_offset
            del self._token_ids[self._read_offset :]
            return ""
        # Nothing new (e.g. only skipped special tokens), or a character not yet complete.
        if len(window) <= len(context) or (window.endswith(_PARTIAL) and not (final or overdue)):
            return ""
        new_text = window[len(context) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        self._pieces.append(new_text)
        return new_text


def _ends_inside_a_character(tokenizer: Any, token_ids: Sequence[int]) -> bool:
    """Whether the tokens' bytes end with an incomplete UTF-8 sequence (bytes a character
    began with, the rest never written); stray bytes before it do not matter."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    decoder.decode(b"".join(token_bytes(tokenizer, token_id) for token_id in token_ids))
    return bool(decoder.getstate()[0])  # (the bytes it holds for the character's rest)


def _common_prefix_len(context: str, window: str) -> int:
    """How much of `context` the window keeps: their common prefix, but never less than the
    context without its trailing U+FFFD (only those can be a partial character now complete)."""
    common = len(os.path.commonprefix([context, window]))
    return max(common, len(context.rstrip(_PARTIAL)))


def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Every id decoding with skip_special_tokens drops: the named special tokens and the added
    tokens flagged special."""
    added = tokenizer.added_tokens_decoder.items()
    return frozenset(tokenizer.all_special_ids) | {i for i, t in added if t.special}


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the printable characters byte-level BPE writes tokens in to bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    others = [b for b in range(256) if b not in printable]
    alphabet = {chr(b): b for b in printable}
    alphabet.update({chr(256 + i): b for i, b in enumerate(others)})
    return alphabet


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer decodes with byte-level BPE's decoder: then a token's text is the
    same alone as after any other tokens (but for a character split over tokens)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    return isinstance(getattr(backend, "decoder", None), ByteLevel)


def token_bytes(
    tokenizer: Any, token_id: int, context: Sequence[int] = (), text: str | None = None
) -> bytes:
    """The bytes one token stands for: with byte-level BPE, exactly its bytes, even when they
    are part of a character; a SentencePiece byte-fallback token (`<0xE2>`), its byte;
    otherwise the UTF-8 of its text after `context` (`token_text`, or `text` when the caller
    has it: `▁Paris` after a word is " Paris"). An id past the tokenizer's vocabulary (a
    model's embedding padded beyond it) has none, as it has no text; nor has a negative one
    (no token's: the tokenizer raised OverflowError for it)."""
    if token_id < 0:
        return b""
    piece = tokenizer.convert_ids_to_tokens(token_id)  # (None past the vocabulary)
    if piece is not None and _is_byte_level(tokenizer):
        alphabet = _byte_level_alphabet()
        if all(char in alphabet for char in piece):  # special tokens may hold other characters
            return bytes(alphabet[char] for char in piece)
    byte = _BYTE_FALLBACK_PIECE.fullmatch(piece) if piece is not None else None
    if byte is not None and tokenizer.decode([token_id]) != piece:
        return bytes([int(byte.group(1), 16)])  # (a decoder without byte fallback shows its name)
    return (token_text(tokenizer, token_id, context) if text is None else text).encode()


def token_text(tokenizer: Any, token_id: int, context: Sequence[int] = ()) -> str:
    """The text one token shows in logprobs, after `context` (the tokens before it in the
    output or the prompt, oldest first; the last `MAX_CHARACTER_TOKENS` are enough): its own
    decoding, unless that holds part of a character (U+FFFD). Then the characters it completes,
    the bytes before them in earlier tokens included, as incremental detokenization shows them:
    SmolLM2's tokens of " 😀" (bytes 20 F0 9F 98, then 80), each U+FFFD decoded alone, read " "
    and "😀". So a sequence's token texts add up to its text (a character cut off at its end
    shows in neither: `IncrementalDetokenizer.flush`), and completions' `text_offset`s point
    where each token's text is. (vLLM's
    `_correct_decoded_token` reads "" and " 😀" there.) A tokenizer whose decoding of a token
    depends on its neighbours (SentencePiece drops a text's leading space) reads every token
    after its context: `▁Paris` after "is" reads " Paris", as the text shows it, not "Paris"."""
    text = tokenizer.decode([token_id])
    if _PARTIAL not in text and (not context or _is_byte_level(tokenizer)):
        return text
    before = list(context[-MAX_CHARACTER_TOKENS:])
    # As the incremental detokenizer takes a window from its context: the text this token adds
    # to the context's, less a character it leaves incomplete (a later token's to show). The
    # context may begin inside a character: both decodings begin with the same U+FFFDs.
    shown = tokenizer.decode(before) if before else ""
    whole = tokenizer.decode([*before, token_id]).rstrip(_PARTIAL)
    return whole[_common_prefix_len(shown, whole) :]


class StopStringMatcher:
    """Cuts a stream of text before the first stop string to be completed.

    Feeding the same text in any pieces gives the same output: the text up to the stop string
    whose end comes first (on a tie, the one that starts first) past the text fed with
    `may_stop=False`, or all of it."""

    def __init__(self, stops: Sequence[str]):
        if any(not stop for stop in stops):
            raise ValueError("stop strings must not be empty")
        self._stops = tuple(dict.fromkeys(stops))
        self._held = ""  # the longest tail that is a proper prefix of some stop string
        self._num_unstoppable = 0  # chars at the front of `_held` that no stop may end in
        self._stopped = False

    @property
    def stopped(self) -> bool:
        return self._stopped

    def feed(self, new_text: str, may_stop: bool = True) -> tuple[str, bool]:
        """(text safe to emit now, stopped). After a stop, everything is dropped. With
        `may_stop` False no stop string may end in `new_text` (it may begin there)."""
        if self._stopped:
            return "", True
        text = self._held + new_text
        if not may_stop:
            self._num_unstoppable = len(text)
        cut = self._first_stop(text) if may_stop else None
        if cut is not None:
            self._stopped, self._held = True, ""
            return text[:cut], True
        num_safe = len(text) - self._partial_stop_len(text)
        self._held = text[num_safe:]
        self._num_unstoppable = max(self._num_unstoppable - num_safe, 0)
        return text[:num_safe], False

    def flush(self) -> str:
        """The held-back tail, at the end of generation: it never became a stop string."""
        held, self._held, self._num_unstoppable = self._held, "", 0
        return held

    def _first_stop(self, text: str) -> int | None:
        """Where the stop string completed first in `text` starts, of those ending past its
        first `_num_unstoppable` chars. A stop found here ends in the new text: one inside the
        held tail would have been found by an earlier feed, or may not end there."""
        best: tuple[int, int] | None = None  # (end, start)
        for stop in self._stops:
            start = text.find(stop, max(self._num_unstoppable - len(stop) + 1, 0))
            if start >= 0 and (best is None or (start + len(stop), start) < best):
                best = (start + len(stop), start)
        return None if best is None else best[1]

    def _partial_stop_len(self, text: str) -> int:
        """The length of the longest tail of `text` that a stop string starts with."""
        longest = 0
        for stop in self._stops:
            # Only tails shorter than the stop, and longer than the best so far, can matter.
            start = max(len(text) - len(stop) + 1, 0)
            start = text.find(stop[0], start)
            while 0 <= start < len(text) - longest:
                if stop.startswith(text[start:]):
                    longest = len(text) - start
                    break
                start = text.find(stop[0], start + 1)
        return longest
