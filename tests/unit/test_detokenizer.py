"""Tests of incremental detokenization with the real SmolLM2 tokenizer (byte-level BPE: emoji and
CJK characters split over tokens) and a hand-built SentencePiece-style one (its decoder drops the
leading space of a text), and of the stop-string matcher on hand-made streams and, with
hypothesis, against a plain reference."""

from __future__ import annotations

import copy
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.detokenizer import (
    MAX_CHARACTER_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    token_bytes,
    token_text,
)

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


SENTENCEPIECE_WORDS = ["▁The", "▁capital", "▁of", "▁France", "▁is", "▁Paris", ".", "▁Hi"]
SENTENCEPIECE_BYTES = ["<0xE2>", "<0x82>", "<0xAC>"]  # byte fallback: "€" is E2 82 AC


def sentencepiece_tokenizer(llama_decoder: bool = False):
    """A tiny SentencePiece-style tokenizer, built offline: Metaspace pre-tokenizer and decoder
    (or Llama's Replace/ByteFallback/Fuse/Strip decoder), `<s>`, `</s>` and `[INST]` markers as
    special tokens. Either decoder drops the space before a text's first word."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>", *SENTENCEPIECE_WORDS, *SENTENCEPIECE_BYTES]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    if llama_decoder:
        steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
        backend.decoder = decoders.Sequence([*steps, decoders.Strip(" ", 1, 0)])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    tokenizer.add_special_tokens({"additional_special_tokens": ["[INST]", "[/INST]"]})
    return tokenizer


@pytest.fixture(scope="module", params=["metaspace", "llama"])
def sp_tokenizer(request):
    return sentencepiece_tokenizer(llama_decoder=request.param == "llama")


def chunked(ids: list[int], rng: random.Random, max_size: int) -> list[list[int]]:
    chunks, start = [], 0
    while start < len(ids):
        size = rng.randint(1, max_size)
        chunks.append(ids[start : start + size])
        start += size
    return chunks


def detokenize(
    tokenizer, chunks, skip_special_tokens: bool = True, prompt_token_ids=()
) -> list[str]:
    """Every piece emitted, the flush last."""
    detokenizer = IncrementalDetokenizer(
        tokenizer, skip_special_tokens, prompt_token_ids=prompt_token_ids
    )
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


def test_flush_drops_a_character_the_output_cut_off(tokenizer):
    """`max_tokens` ending the output mid-emoji: its bytes so far showed as a final "�" (in
    chat, completions and stored Responses) that no token's text held. Dropped, as vLLM does."""
    ids = tokenizer.encode("ok 🎉")
    detokenizer = IncrementalDetokenizer(tokenizer)
    emitted = detokenizer.push(ids[:-1])
    assert "\ufffd" not in emitted
    rest = detokenizer.flush()
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")
    assert emitted + rest == tokenizer.decode(ids[:-1]).removesuffix("\ufffd") == "ok "
    assert detokenizer.text == "ok " and detokenizer.flush() == ""


def test_flush_keeps_a_replacement_character_the_model_wrote_whole(tokenizer):
    ids = tokenizer.encode("ok \ufffd")
    detokenizer = IncrementalDetokenizer(tokenizer)
    text = "".join(detokenizer.push([i]) for i in ids) + detokenizer.flush()
    assert text == detokenizer.text == "ok \ufffd"


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


def byte_token(tokenizer, byte: int) -> int:
    """The byte-level token of that one byte."""
    return next(i for i in range(1000) if token_bytes(tokenizer, i) == bytes([byte]))


@pytest.mark.parametrize("run", ["stray bytes", "skipped special tokens"])
def test_a_long_run_of_tokens_that_show_nothing_yet_decodes_small_windows(tokenizer, run):
    """A byte no character can complete (0x80 alone: a client's logit_bias can force it) ends
    the text in U+FFFD at every step, and a skipped special token adds nothing: either way the
    window was held and grew, every step decoding the whole run (4,000 tokens cost the gateway's
    event loop 2 to 6 s, every stream on it waiting). The result is still the full decode."""
    filler = byte_token(tokenizer, 0x80) if run == "stray bytes" else tokenizer.eos_token_id
    word = tokenizer.encode(" Paris")
    ids = [*word, *[filler] * 3000, *word]
    window_sizes = []

    class CountingTokenizer:
        def decode(self, token_ids, **kwargs):
            window_sizes.append(len(token_ids))
            return tokenizer.decode(token_ids, **kwargs)

    detokenizer = IncrementalDetokenizer(CountingTokenizer())
    pieces = [detokenizer.push([i]) for i in ids] + [detokenizer.flush()]
    assert "".join(pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert max(window_sizes) <= 40 and detokenizer.num_tokens == len(ids)


@pytest.mark.parametrize("num_stray", [14, 15, 16, 17, 30, 33])
def test_a_character_completed_after_a_long_run_of_stray_bytes_is_shown_once(tokenizer, num_stray):
    """Stray bytes emitted as U+FFFD once held too long, then a character split over tokens (a
    "€" of three): the text that completes it must not show the stray bytes' U+FFFD again (a
    context ending in U+FFFD was stripped of all of them, as a prompt's). At worst the
    character's first byte, emitted with the run, shows as one U+FFFD more."""
    euro = [byte_token(tokenizer, b) for b in "€".encode()]
    ids = [*tokenizer.encode(" Paris"), *[byte_token(tokenizer, 0x80)] * num_stray, *euro]
    pieces = detokenize(tokenizer, [[i] for i in ids])
    text, whole = "".join(pieces), tokenizer.decode(ids)
    assert text.replace("\ufffd", "") == whole.replace("\ufffd", "") == " Paris€"
    assert text.count("\ufffd") - whole.count("\ufffd") in (0, 1)


# --- the prompt as the first context ------------------------------------------------------------


def test_a_sentencepiece_first_token_keeps_its_space_after_the_prompt(sp_tokenizer):
    """`▁Paris` decoded alone is "Paris": the output read "The capital of France isParis."."""
    prompt = [sp_tokenizer.bos_token_id, *sp_tokenizer.encode("The capital of France is")]
    output = sp_tokenizer.convert_tokens_to_ids(["▁Paris", ".", "▁Hi", "</s>"])
    for chunk_size in (1, 2, 4):
        chunks = [output[i : i + chunk_size] for i in range(0, len(output), chunk_size)]
        pieces = detokenize(sp_tokenizer, chunks, prompt_token_ids=prompt)
        assert "".join(pieces) == " Paris. Hi"
        whole = sp_tokenizer.decode(prompt + output, skip_special_tokens=True)
        assert whole == sp_tokenizer.decode(prompt, skip_special_tokens=True) + " Paris. Hi"
    assert "".join(detokenize(sp_tokenizer, [output])) == "Paris. Hi"  # no prompt: a text's start


def test_special_tokens_in_the_prompt_are_context_only(sp_tokenizer, tokenizer):
    """Skipped special tokens at the prompt's end (a chat's turn markers) neither show nor keep
    the text from continuing the prompt's."""
    to_ids = sp_tokenizer.convert_tokens_to_ids
    prompt = [sp_tokenizer.bos_token_id, *to_ids(["[INST]", "▁Hi", "[/INST]"])]
    output = to_ids(["▁Paris", "."])
    assert "".join(detokenize(sp_tokenizer, [[i] for i in output], True, prompt)) == " Paris."
    kept = "".join(detokenize(sp_tokenizer, [output], False, prompt))
    assert kept == sp_tokenizer.decode(prompt + output)[len(sp_tokenizer.decode(prompt)) :]
    chat = tokenizer.encode("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    output = tokenizer.encode("Hello 🎉!") + [tokenizer.eos_token_id]
    assert "".join(detokenize(tokenizer, [[i] for i in output], True, chat)) == "Hello 🎉!"


@pytest.mark.parametrize("name", TEXTS)
def test_byte_level_output_is_the_same_after_any_prompt(tokenizer, name):
    """With byte-level BPE the prompt changes nothing; it is never part of the output, and a
    prompt beginning inside a character does not disturb the window."""
    ids = tokenizer.encode(TEXTS[name])
    for prompt_text in ("Say it:", "🎉🎉", TEXTS["cjk"], TEXTS[name]):
        prompt = tokenizer.encode(prompt_text)
        for start in range(len(prompt)):
            pieces = detokenize(tokenizer, [[i] for i in ids], prompt_token_ids=prompt[start:])
            assert "".join(pieces) == TEXTS[name]
            assert not any("\ufffd" in piece for piece in pieces)


def test_a_prompt_ending_inside_a_character(tokenizer, sp_tokenizer):
    """The output token completing the prompt's last character shows the whole character; an
    output that does not complete it shows only its own text."""
    ids = tokenizer.encode("ok 🎉 done")
    split = next(i for i in range(len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd"))
    prompt, output = ids[:split], ids[split:]
    assert tokenizer.decode(prompt) == "ok \ufffd"
    for chunks in ([[i] for i in output], [output]):
        assert "".join(detokenize(tokenizer, chunks, prompt_token_ids=prompt)) == "🎉 done"
    other = tokenizer.encode(" x")
    assert "".join(detokenize(tokenizer, [other], prompt_token_ids=prompt)) == " x"
    eos = [tokenizer.eos_token_id]
    assert detokenize(tokenizer, [eos], prompt_token_ids=prompt) == ["", ""]
    if sp_tokenizer.decode(sp_tokenizer.convert_tokens_to_ids(SENTENCEPIECE_BYTES)) == "€":
        to_ids = sp_tokenizer.convert_tokens_to_ids  # (the Llama decoder's byte fallback)
        prompt = to_ids(["▁Hi", "<0xE2>", "<0x82>"])
        output = to_ids(["<0xAC>", "▁Paris"])
        assert sp_tokenizer.decode(prompt) == "Hi\ufffd\ufffd"
        pieces = detokenize(sp_tokenizer, [[i] for i in output], prompt_token_ids=prompt)
        assert pieces == ["€", " Paris", ""]


def test_token_bytes_are_the_tokens_own_bytes(tokenizer):
    for text in TEXTS.values():
        ids = tokenizer.encode(text)
        assert b"".join(token_bytes(tokenizer, i) for i in ids) == text.encode()
    emoji = tokenizer.encode("🎉")
    assert all(len(token_bytes(tokenizer, i)) < 4 for i in emoji)
    assert token_bytes(tokenizer, tokenizer.eos_token_id) == tokenizer.eos_token.encode()


def test_token_texts_in_context_add_up_to_the_text(tokenizer, sp_tokenizer):
    """Logprobs' token texts: each token reads the characters it completes, so the texts add
    up to the decoded text; alone, a token reads its own complete characters."""
    for text in TEXTS.values():
        ids = tokenizer.encode(text)
        context = [ids[max(0, i - MAX_CHARACTER_TOKENS) : i] for i in range(len(ids))]
        texts = [token_text(tokenizer, t, before) for t, before in zip(ids, context, strict=True)]
        assert "".join(texts) == text and "\ufffd" not in "".join(texts)
    start, end = tokenizer.encode(" 😀")  # bytes 20 F0 9F 98, then 80
    assert (token_text(tokenizer, start), token_text(tokenizer, end)) == (" ", "")
    assert token_text(tokenizer, end, [start]) == "😀"
    euro = sp_tokenizer.convert_tokens_to_ids(["▁Paris", *SENTENCEPIECE_BYTES])
    if sp_tokenizer.decode(euro) == "Paris€":  # (the Llama decoder: byte fallback)
        texts = [token_text(sp_tokenizer, t, euro[:i]) for i, t in enumerate(euro)]
        assert texts == ["Paris", "", "", "€"]


def test_a_byte_fallback_tokens_bytes_are_its_byte(sp_tokenizer):
    """SentencePiece writes a character it has no piece for as byte tokens (`<0xE2>`, Llama's
    and Mistral's byte fallback). Their `bytes` were U+FFFD's, so a client could not put "€"
    back together from them, which is what OpenAI's `bytes` are for. A decoder without byte
    fallback shows such a token as its name: then those are its bytes."""
    ids = sp_tokenizer.convert_tokens_to_ids(SENTENCEPIECE_BYTES)
    pieces = [token_bytes(sp_tokenizer, i) for i in ids]
    if sp_tokenizer.decode(ids) == "€":  # (the Llama decoder: byte fallback)
        assert b"".join(pieces) == "€".encode()
    else:
        assert pieces == [name.encode() for name in SENTENCEPIECE_BYTES]
    paris = sp_tokenizer.convert_tokens_to_ids("▁Paris")
    assert token_bytes(sp_tokenizer, paris) == sp_tokenizer.decode([paris]).encode()


def test_a_token_past_the_tokenizers_vocabulary_has_no_text_and_no_bytes(tokenizer):
    """A model's embedding is often padded past its tokenizer (Qwen2.5: 151,936 rows for
    151,665 tokens), and the engine samples, and ranks top logprobs, over all of it. Such an
    id decodes to nothing; its bytes raised TypeError (the stream or answer failed with 500)."""
    past = len(tokenizer) + 7
    assert token_bytes(tokenizer, past) == b""
    assert detokenize(tokenizer, [[28], [past], [28]]) == [",", "", ",", ""]


@pytest.mark.parametrize("bad", [-1, -(2**31)])
def test_a_negative_token_id_has_no_bytes(tokenizer, sp_tokenizer, bad):
    """The wire carries int32 token ids, so a broken worker can send a negative one: no token
    has it, and its bytes raised OverflowError. (The gateway's cluster link fails such a request
    with a clear error before its text is decoded: test_gateway_stream_edges.)"""
    for tok in (tokenizer, sp_tokenizer):
        assert token_bytes(tok, bad) == b""


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


def choice_text(tokenizer, stops: list[str], min_tokens: int, stop_token_ids=()):
    from services.gateway.generation import ChoiceText

    stop_ids = frozenset(stop_token_ids)
    return ChoiceText(
        IncrementalDetokenizer(tokenizer), StopStringMatcher(stops), min_tokens, 0, stop_ids
    )


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


def test_a_stop_may_begin_but_not_end_in_unstoppable_text():
    matcher = StopStringMatcher(["User:", "ab"])
    assert matcher.feed("xab Us", may_stop=False) == ("xab ", False)  # "ab" ends inside
    assert matcher.feed("er: hi") == ("", True)  # "User:" began there, and ends past it
    matcher = StopStringMatcher(["abc", "b"])
    assert matcher.feed("ab", may_stop=False) == ("", False)  # holds "b", a stop ending there
    assert matcher.feed("c") == ("", True)  # not it, but "abc", which ends past the boundary


def reference_stop_after(text: str, stops: list[str], boundary: int) -> str:
    """The text cut before the stop string whose first occurrence ending past `boundary` ends
    first."""
    hits = []
    for stop in stops:
        start = text.find(stop, max(boundary - len(stop) + 1, 0))
        if start >= 0:
            hits.append((start + len(stop), start))
    return text[: min(hits)[1]] if hits else text


@settings(max_examples=300, deadline=None)
@given(
    text=st.text(ALPHABET, max_size=30),
    stops=st.lists(st.text(ALPHABET, min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=8),
    boundary=st.integers(0, 30),
)
def test_stop_matcher_with_unstoppable_text_equals_reference(text, stops, cuts, boundary):
    boundary = min(boundary, len(text))
    bounds = sorted({0, boundary, len(text), *(min(c, len(text)) for c in cuts)})
    matcher, emitted, stopped = StopStringMatcher(stops), "", False
    for i, j in zip(bounds, bounds[1:], strict=False):
        out, stopped = matcher.feed(text[i:j], may_stop=j > boundary)
        emitted += out
    flushed = matcher.flush()
    assert emitted + flushed == reference_stop_after(text, stops, boundary)
    assert flushed == "" or not stopped


def run_choice(tokenizer, pieces, stops, min_tokens, finish=None, stop_token_ids=()):
    """(text, stopped) of a choice fed `pieces`, the last with the engine's `finish`."""
    choice, text = choice_text(tokenizer, stops, min_tokens, stop_token_ids), ""
    for number, piece in enumerate(pieces, start=1):
        new, stopped = choice.push(piece, finish if number == len(pieces) else None)
        text += new
        if stopped:
            return text, True
    tail, stopped = choice.flush()
    return text + tail, stopped


@pytest.mark.parametrize("chunk_size", [1, 2, 3])
def test_a_stop_string_begun_inside_min_tokens_ends_the_choice_after_them(tokenizer, chunk_size):
    """Tokens 'User', ':', ' hi' with min_tokens 1: "User:" begins in the first token's text
    and ends after it, so it stops the choice (vLLM); it was never looked for."""
    ids = tokenizer("User: hi").input_ids
    assert [tokenizer.decode([i]) for i in ids] == ["User", ":", " hi"]
    pieces = [ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)]
    for min_tokens in (0, 1):
        assert run_choice(tokenizer, pieces, ["User:"], min_tokens) == ("", True)
    # Ending within the first min_tokens it does not count, and held-back text is released.
    assert run_choice(tokenizer, pieces, ["User:"], 2) == ("User: hi", False)
    assert run_choice(tokenizer, pieces, [" hi!"], 3) == ("User: hi", False)
    assert run_choice(tokenizer, pieces, [" hi!", ": h"], 2) == ("User", True)


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 9])
def test_min_tokens_text_held_with_a_partial_character_cannot_stop_it(tokenizer, chunk_size):
    """Tokens 'Hello', ' ', then 世 in two byte tokens: with min_tokens 3 the space is the first
    tokens' text, where no stop string may end. A delta carrying all three held "Hello " back
    with the partial 世, and the next delta showed it as text a stop could end in: " " and "o "
    stopped the choice at "Hello" and "Hell" (as vLLM, which decodes token by token, does not)."""
    ids = tokenizer("Hello 世界! I", add_special_tokens=False).input_ids
    assert [tokenizer.decode([i]) for i in ids[:2]] == ["Hello", " "]
    assert tokenizer.decode(ids[:3]).endswith("\ufffd") and tokenizer.decode(ids[:4]) == "Hello 世"
    pieces = [ids[i : i + chunk_size] for i in range(0, len(ids), chunk_size)]
    assert run_choice(tokenizer, pieces, [" "], 3) == ("Hello 世界!", True)
    assert run_choice(tokenizer, pieces, ["o "], 3) == ("Hello 世界! I", False)
    # 世 itself ends in the fourth token's text: a stop may end there.
    assert run_choice(tokenizer, pieces, ["o 世"], 3) == ("Hell", True)


def test_a_stop_token_that_ended_the_choice_is_not_shown(tokenizer):
    """vLLM drops the text of the stop_token_ids token that ended a sequence ("stop"); 198 is
    "\n" in SmolLM2."""
    ids = tokenizer.encode("Hello there")
    assert tokenizer.decode([198]) == "\n"
    for pieces in ([ids + [198]], [[i] for i in [*ids, 198]]):
        assert run_choice(tokenizer, pieces, [], 0, "stop", [198]) == ("Hello there", False)
        # Not a stop token, or the sequence ended otherwise: the text is shown.
        assert run_choice(tokenizer, pieces, [], 0, "stop") == ("Hello there\n", False)
        assert run_choice(tokenizer, pieces, [], 0, "length", [198]) == ("Hello there\n", False)
    tail = [tokenizer.encode("a\n\nb")[:-1], [198]]  # a stop string held back, then released
    assert run_choice(tokenizer, tail, ["\n\n\n"], 0, "stop", [198]) == ("a\n\n", False)


def test_tandem_generate_shows_the_text_the_gateway_would(tokenizer):
    """`tandem generate` runs the gateway's pipeline: the stop token that ended the output is
    not shown, and a stop string begun inside min_tokens still cuts."""
    from services.commands.generate import apply_stop_strings
    from shared.engine.engine import GenerationResult
    from shared.engine.sampling_params import SamplingParams

    prompt, output = tokenizer.encode("Say:"), tokenizer.encode(" Hello there") + [198]
    result = GenerationResult("r", prompt, output, [], "stop")
    params = SamplingParams(stop_token_ids=[198])
    assert apply_stop_strings(tokenizer, result, [], params) == (" Hello there", output, "stop")
    cut = SamplingParams(min_tokens=1)
    assert apply_stop_strings(tokenizer, result, [" Hello t"], cut)[0::2] == ("", "stop")
