"""Tests of incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE: emoji and
CJK characters split over tokens), and of the stop-string matcher on hand-made streams and, with
hypothesis, against a plain reference."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.detokenizer import IncrementalDetokenizer, StopStringMatcher, token_bytes

TEXTS = {
    "ascii": "The quick brown fox jumps over the lazy dog. It was 42 degrees!\n\nNext line.",
    "code": 'def f(x: int) -> int:\n    """Twice x."""\n    return {"a": [x * 2]}["a"][0]\n',
    "french": "Le garçon a mangé une crème brûlée à Noël, déjà très âgé.",
    "cjk": "你好，世界！今日はいい天気ですね。한국어도 있어요.",
    "emoji": "Party 🎉🎉 time 👩‍👩‍👧 with flags 🇫🇷 and 🤖✨.",
    "mixed": "naïve café ☕ 東京 🚀 — “quotes” … ½ ≠ ∞",
}


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    directory, _ = resolve_model_dir()
    return AutoTokenizer.from_pretrained(directory)


def chunked(ids: list[int], rng: random.Random, max_size: int) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_size)
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def detokenize(tokenizer, chunks, skip_special_tokens: bool = True) -> list[str]:
    """Every piece emitted, the flush last."""
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    pieces = [detokenizer.push(chunk) for chunk in chunks] + [detokenizer.flush()]
    assert detokenizer.text == "".join(pieces)
    return pieces


# --- incremental detokenization ----------------------------------------------------------------


@pytest.mark.parametrize("name", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    pieces = detokenize(tokenizer, [[i] for i in ids])
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True) == TEXTS[name]
    assert pieces[-1] == ""  # nothing was held back at the end: the text is complete
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("name", TEXTS)
def test_random_chunks_equal_full_decode(tokenizer, name):
    ids = tokenizer.encode(TEXTS[name])
    rng = random.Random(name)
    for max_size in (2, 3, 7):
        pieces = detokenize(tokenizer, chunked(ids, rng, max_size))
        assert "".join(pieces) == TEXTS[name]
        assert not any("\ufffd" in piece for piece in pieces)


def test_split_characters_are_held_back_until_complete(tokenizer):
    ids = tokenizer.encode("🎉")
    assert len(ids) > 1  # byte-level BPE splits it, which is the point of this test
    detokenizer = IncrementalDetokenizer(tokenizer)
    assert [detokenizer.push([i]) for i in ids[:-1]] == [""] * (len(ids) - 1)
    assert detokenizer.push(ids[-1:]) == "🎉"


def test_flush_releases_a_partial_character(tokenizer):
    ids = tokenizer.encode("ok 🎉")
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = detokenizer.push(ids[:-1])
    assert "\ufffd" not in emitted
    rest = detokenizer.flush()
    assert rest.endswith("\ufffd") and emitted + rest == tokenizer.decode(ids[:-1])
    assert detokenizer.flush() == ""


def test_special_tokens_skipped_or_kept(tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode("Hi there") + [eos] + tokenizer.encode(" 世界") + [eos]
    for skip in (True, False):
        pieces = detokenize(tokenizer, [[i] for i in ids], skip_special_tokens=skip)
        assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.eos_token in "".join(pieces)


def test_kept_special_tokens_are_shown_and_the_others_skipped(tokenizer):
    """A tool-call marker that is a special token reaches the parser; EOS stays hidden."""
    from services.gateway.tool_formats import MISTRAL, special_marker_ids

    marked = copy.deepcopy(tokenizer)
    marked.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    kept = special_marker_ids(marked, MISTRAL)
    assert kept == {marked.convert_tokens_to_ids("[TOOL_CALLS]")}
    assert special_marker_ids(tokenizer, MISTRAL) == frozenset()  # plain text there
    text = 'Sure.[TOOL_CALLS][{"name": "now"}] 世界'
    ids = marked.encode(text) + [marked.eos_token_id]
    assert kept <= set(ids)
    detokenizer = IncrementalDetokenizer(marked, keep_special_ids=kept)
    pieces = [detokenizer.push([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == text
    assert "[TOOL_CALLS]" not in "".join(detokenize(marked, [ids]))  # skipped by default


def test_output_of_only_special_tokens_is_empty(tokenizer):
    eos = tokenizer.eos_token_id
    assert detokenize(tokenizer, [[eos], [eos]]) == ["", "", ""]


def test_a_long_output_decodes_small_windows(tokenizer):
    """Cost per step stays bounded: no step decodes more than a few tokens, however long the
    output, and the result is still the full decode."""
    text = " ".join(TEXTS.values()) * 8
    ids = tokenizer.encode(text)
    assert len(ids) > 1000
    window_sizes = []

    class CountingTokenizer:
        def decode(self, token_ids, **kwargs):
            window_sizes.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    pieces = detokenize(CountingTokenizer(), [[i] for i in ids])
    assert "".join(pieces) == text
    assert max(window_sizes) <= 8


def test_token_bytes_are_the_tokens_own_bytes(tokenizer):
    for text in TEXTS.values():
        ids = tokenizer.encode(text)
        assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()
    emoji = tokenizer.encode("🎉")
    assert all(len(token_bytes(tokenizer, i)) < 4 for i in emoji)
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


# --- stop strings ------------------------------------------------------------------------------


def run_matcher(stops, pieces) -> tuple[list[str], bool, str]:
    """(emitted pieces, stopped, flushed)."""
    matcher = StopStringMatcher(stops)
    emitted, stopped = [], False
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
    return emitted, stopped, matcher.flush()


def test_no_stops_pass_everything():
    assert run_matcher([], ["a", "b"]) == (["a", "b"], False, "")


def test_stop_inside_one_piece():
    assert run_matcher(["STOP"], ["abcSTOPdef"]) == (["abc"], True, "")


def test_stop_split_across_pieces():
    emitted, stopped, _ = run_matcher(["</answer>"], ["The answer is 4</", "ans", "wer> more"])
    assert emitted == ["The answer is 4", "", ""] and stopped


def test_text_that_only_looked_like_a_stop_is_released():
    emitted, stopped, flushed = run_matcher(["\n\n"], ["one\n", "two\n", "three"])
    assert emitted == ["one", "\ntwo", "\nthree"] and not stopped and flushed == ""


def test_held_back_text_is_released_by_flush():
    emitted, stopped, flushed = run_matcher(["END"], ["the E", "N"])
    assert emitted == ["the ", ""] and not stopped and flushed == "EN"


def test_stop_at_the_very_start():
    assert run_matcher(["Hello"], ["Hel", "lo world"]) == (["", ""], True, "")
    assert run_matcher(["x"], ["x"]) == ([""], True, "")


def test_two_stops_the_first_completed_wins():
    assert run_matcher(["bar", "foo"], ["a foo b bar"])[0] == ["a "]
    # "c" completes before "abcd" could: generation would have stopped there.
    assert run_matcher(["abcd", "c"], ["xab", "cd"])[0] == ["x", "ab"]
    assert run_matcher(["abcd", "c"], ["xabcd"])[0] == ["xab"]
    # Two ending together: the longer one, starting first, is cut.
    assert run_matcher(["bc", "abc"], ["xabc"])[0] == ["x"]


def test_nothing_after_a_stop():
    matcher = StopStringMatcher(["."])
    assert matcher.feed("Done. More") == ("Done", True)
    assert matcher.feed("text") == ("", True) and matcher.stopped and matcher.flush() == ""


def test_empty_stop_is_refused():
    with pytest.raises(ValueError):
        StopStringMatcher(["ok", ""])


def reference_stop(text: str, stops: list[str]) -> str:
    """The text cut before the stop string whose first occurrence ends first."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(hits)[1]] if hits else text


ALPHABET = "ab\n"


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=40),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_stop_matcher_equals_reference(text, stops, cuts):
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    pieces = [text[i:j] for i, j in zip(bounds, bounds[1:], strict=False)]
    matcher, fed, emitted, stopped = StopStringMatcher(stops), "", "", False
    for piece in pieces:
        out, stopped = matcher.feed(piece)
        fed, emitted = fed + piece, emitted + out
        if not stopped:
            # Held back only while it could still grow into a stop string.
            held = fed[len(emitted) :]
            assert fed.startswith(emitted)
            assert held == "" or any(s.startswith(held) and s != held for s in stops)
    flushed = matcher.flush()
    assert emitted + flushed == reference_stop(text, stops)
    assert stopped == any(s in text for s in stops)
    assert flushed == "" or not stopped


def choice_text(tokenizer, stops: list[str], min_tokens: int):
    from services.gateway.generation import ChoiceText

    return ChoiceText(IncrementalDetokenizer(tokenizer), StopStringMatcher(stops), min_tokens)


@pytest.mark.parametrize("chunk_size", [1, 3, 100])
def test_stop_strings_count_only_after_min_tokens(tokenizer, chunk_size):
    """vLLM's meaning: the first `min_tokens` tokens' text is never searched for a stop string.
    Tokens of "A. B. C.": a stop at "." inside the first min_tokens is passed over."""
    ids = tokenizer("A. B. C.").input_ids
    first_dot = next(i for i, t in enumerate(ids) if "." in tokenizer.decode([t]))
    pieces = [ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)]

    def run(min_tokens: int) -> tuple[str, bool]:
        choice, text = choice_text(tokenizer, ["."], min_tokens), ""
        for piece in pieces:
            new, stopped = choice.push(piece)
            text += new
            if stopped:
                return text, True
        tail, stopped = choice.flush()
        return text + tail, stopped

    assert run(0) == ("A", True)
    assert run(first_dot + 1) == ("A. B", True)
    assert run(len(ids)) == ("A. B. C.", False)
