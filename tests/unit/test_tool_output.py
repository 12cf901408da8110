"""Tool calls cut out of a choice's text, in each format: the same content and calls however the
text is split into streamed pieces, held-back opener starts, malformed and unfinished calls kept
as content."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from services.gateway.openai_protocol import parse_chat_request
from services.gateway.tool_formats import LLAMA3_JSON, MISTRAL, TAGGED
from services.gateway.tool_output import ToolCallParser, extract_tool_calls

MODEL = "smollm2"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NOW = {"type": "function", "function": {"name": "now"}}  # parameterless
OSLO = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
TEXTS = [
    "Sure.\n" + OSLO + '<tool_call>{"name": "now", "arguments": {}}</tool_call>',
    "No tools needed.",
    "  padded answer \n",
    'Before <tool_call>{"name": "rm"}</tool_call> after',  # unknown tool: stays content
    "a < b and <tool_ca is not a tag" + OSLO + " done",
    "<tool_call>not json</tool_call>\n" + OSLO,
    "unfinished " + OSLO[:30],  # the choice ended (length) inside a call
    "ends on a tag start <tool_",
]
MISTRAL_CALLS = '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "now"}]'
MISTRAL_TEXTS = [
    "Sure. [TOOL_CALLS]" + MISTRAL_CALLS,
    '[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}[TOOL_CALLS]now[ARGS]{}',  # the newer form
    "No [TOOL but no call",
    '[TOOL_CALLS][{"name": "rm", "arguments": {}}]',  # unknown tool: content
    '[TOOL_CALLS][{"name": "get_weather", "arguments": {"ci',  # cut by max_tokens
]
LLAMA3_TEXTS = [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '\n<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}; {"name": "now"}',
    'The call would be {"name": "now", "parameters": {}}',  # not at the start: content
    '{"answer": 42}',  # JSON, but no call
    '{"name": "get_weather", "parameters": {"city": "Os',
]
FORMAT_TEXTS = {TAGGED: TEXTS, MISTRAL: MISTRAL_TEXTS, LLAMA3_JSON: LLAMA3_TEXTS}


def setup(**fields):
    messages = [{"role": "user", "content": "Hi"}]
    body = {"model": MODEL, "messages": messages, "tools": [WEATHER, NOW]}
    return parse_chat_request({**body, **fields}, MODEL, 2048).tools


def streamed(tools, pieces: list[str], tool_format=TAGGED) -> tuple[str, list[dict]]:
    parser = ToolCallParser(tools, tool_format)
    content, calls = "", []
    for piece in pieces:
        out = parser.push(piece)
        content, calls = content + out.content, calls + out.calls
    out = parser.finish()
    return content + out.content, calls + out.calls


def names_and_arguments(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_calls_are_cut_out_of_the_whole_text():
    auto = setup()
    content, calls = extract_tool_calls(auto, TEXTS[0])
    assert content == "Sure."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    assert calls[1]["function"]["arguments"] == "{}"  # a parameterless tool keeps its {}
    assert calls[0]["id"] != calls[1]["id"] and calls[0]["type"] == "function"
    assert "index" not in calls[0]  # the non-streamed shape
    assert extract_tool_calls(auto, "No tools needed.") == ("No tools needed.", [])
    assert extract_tool_calls(auto, TEXTS[3]) == (TEXTS[3], [])
    content, calls = extract_tool_calls(auto, TEXTS[4])
    assert content == "a < b and <tool_ca is not a tag done" and len(calls) == 1
    content, calls = extract_tool_calls(auto, TEXTS[5])
    assert content == "<tool_call>not json</tool_call>" and len(calls) == 1
    assert extract_tool_calls(auto, TEXTS[6]) == (TEXTS[6], [])  # an unfinished call: content
    assert extract_tool_calls(auto, TEXTS[7]) == (TEXTS[7], [])


def test_mistral_calls_run_from_the_marker_to_the_end():
    auto = setup()
    content, calls = extract_tool_calls(auto, MISTRAL_TEXTS[0], MISTRAL)
    assert content == "Sure."
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    # Mistral's templates take back only ids of nine letters or digits.
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls)
    content, calls = extract_tool_calls(auto, MISTRAL_TEXTS[1], MISTRAL)
    assert content is None
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    for text in MISTRAL_TEXTS[2:]:
        assert extract_tool_calls(auto, text, MISTRAL) == (text, [])
    forced = extract_tool_calls(setup(tool_choice="required"), '{"name": "now"}', MISTRAL)
    assert forced[1][0]["function"] == {"name": "now", "arguments": "{}"}
    assert len(forced[1][0]["id"]) == 9


def test_llama3_calls_are_an_answer_that_begins_as_json():
    auto = setup()
    content, calls = extract_tool_calls(auto, LLAMA3_TEXTS[0], LLAMA3_JSON)
    assert content is None and names_and_arguments(calls) == [("get_weather", {"city": "Oslo"})]
    assert calls[0]["id"].startswith("call_")
    content, calls = extract_tool_calls(auto, LLAMA3_TEXTS[1], LLAMA3_JSON)
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]
    for text in LLAMA3_TEXTS[2:]:
        assert extract_tool_calls(auto, text, LLAMA3_JSON) == (text, [])


@pytest.mark.parametrize("tool_format", FORMAT_TEXTS, ids=lambda f: f.name)
@given(data=st.data())
def test_without_parallel_calls_a_choice_keeps_its_first_call_alone(tool_format, data):
    """However the text is streamed: the first call, the same content as with parallel calls
    (the calls dropped are not content either)."""
    text = data.draw(st.sampled_from(FORMAT_TEXTS[tool_format]))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    content, calls = streamed(setup(parallel_tool_calls=False), pieces, tool_format)
    parallel_content, parallel_calls = extract_tool_calls(setup(), text, tool_format)
    assert content == (parallel_content or "")
    assert names_and_arguments(calls) == names_and_arguments(parallel_calls[:1])
    assert [c["index"] for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("cut", [len("<tool_call>"), 30, len(OSLO) - 1])
def test_without_parallel_calls_a_second_call_cut_by_the_end_is_dropped(cut):
    """`length` inside a second call: it would have been dropped whole, so its start is not
    left in the content either (with parallel calls an unclosed block stays content)."""
    text = "Sure. " + OSLO + "\n" + OSLO[:cut]
    pieces = [text[:10], text[10:40], text[40:]]
    content, calls = streamed(setup(parallel_tool_calls=False), pieces)
    assert content == "Sure." and names_and_arguments(calls) == [("get_weather", {"city": "Oslo"})]
    assert extract_tool_calls(setup(parallel_tool_calls=False), text)[0] == "Sure."
    assert extract_tool_calls(setup(), text)[0] == "Sure. \n" + OSLO[:cut]


def test_parallel_calls_are_the_default():
    assert setup().parallel and setup(parallel_tool_calls=True).parallel
    assert not setup(parallel_tool_calls=False).parallel
    content, calls = extract_tool_calls(setup(parallel_tool_calls=False), TEXTS[0])
    assert content == "Sure." and names_and_arguments(calls) == [("get_weather", {"city": "Oslo"})]


def test_a_tagged_call_is_only_content_in_another_format():
    assert extract_tool_calls(setup(), OSLO, MISTRAL) == (OSLO, [])
    assert extract_tool_calls(setup(), "[TOOL_CALLS]" + MISTRAL_CALLS, TAGGED)[1] == []


@pytest.mark.parametrize("tool_format", FORMAT_TEXTS, ids=lambda f: f.name)
@given(data=st.data())
def test_any_split_into_pieces_gives_the_same_content_and_calls(tool_format, data):
    text = data.draw(st.sampled_from(FORMAT_TEXTS[tool_format]))
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=12))
    cuts = sorted(set(cuts))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    auto = setup()
    content, calls = streamed(auto, pieces, tool_format)
    whole_content, whole_calls = extract_tool_calls(auto, text, tool_format)
    assert content == (whole_content or "")
    assert names_and_arguments(calls) == names_and_arguments(whole_calls)
    assert [c["index"] for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("tool_format", FORMAT_TEXTS, ids=lambda f: f.name)
@given(data=st.data())
def test_without_calls_the_content_is_the_whole_text(tool_format, data):
    """As a non-streamed response gives it: the stream trimmed the whitespace around an answer
    with no calls (" padded answer \\n" came out "padded answer")."""
    auto = setup()
    texts = [*FORMAT_TEXTS[tool_format], " \n", "\n\n  Hi  \n"]
    texts = [t for t in texts if not extract_tool_calls(auto, t, tool_format)[1]]
    text = data.draw(st.sampled_from(texts))
    cuts = sorted(set(data.draw(st.lists(st.integers(0, len(text)), max_size=12))))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    assert streamed(auto, pieces, tool_format) == (text, [])
    assert extract_tool_calls(auto, text, tool_format) == (text, [])


def test_only_whitespace_next_to_calls_is_dropped():
    auto = setup()
    text = "\n " + OSLO + "\n\nIt is sunny.\n" + OSLO + "\n"
    assert extract_tool_calls(auto, text)[0] == "It is sunny."
    assert extract_tool_calls(auto, "  Sure:\n" + OSLO + "\nDone. ")[0] == "  Sure:\n\nDone. "
    assert extract_tool_calls(auto, OSLO + "\n" + OSLO)[0] is None


def test_a_possible_tag_start_is_held_until_it_is_not_one():
    parser = ToolCallParser(setup())
    assert parser.push("It is <tool").content == "It is"
    assert parser.push("box, not a call").content == " <toolbox, not a call"
    out = parser.push("\n<tool_call>" + OSLO[11:])
    assert out.content == "" and out.calls[0]["function"]["name"] == "get_weather"
    assert parser.push("\n").content == ""  # trailing whitespace is held, then dropped
    assert parser.finish().content == ""


def test_content_streams_until_a_marker_and_the_calls_come_at_the_end():
    mistral = ToolCallParser(setup(), MISTRAL)
    assert mistral.push("Let me check. [TOOL").content == "Let me check."
    assert mistral.push("_CALLS]" + MISTRAL_CALLS[:30]).content == ""
    out = mistral.push(MISTRAL_CALLS[30:])
    assert out.content == "" and out.calls == []  # a block to the end is judged at the end
    assert [c["index"] for c in mistral.finish().calls] == [0, 1]
    llama = ToolCallParser(setup(), LLAMA3_JSON)
    assert llama.push(" <|python").content == ""  # could still open a call
    assert llama.push("_tag|>" + LLAMA3_TEXTS[0]).content == ""
    assert len(llama.finish().calls) == 1
    prose = ToolCallParser(setup(), LLAMA3_JSON)
    assert prose.push("It is").content == "It is"  # content from its first word
    assert prose.push(' {"name": "now"}').content == ' {"name": "now"}'
    assert prose.finish().calls == []


def test_a_forced_call_is_judged_whole_at_the_end():
    forced = setup(tool_choice="required")
    parser = ToolCallParser(forced)
    call = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
    assert parser.push(call[:20]).calls == [] and parser.push(call[20:]).content == ""
    (made,) = parser.finish().calls
    assert made["index"] == 0 and json.loads(made["function"]["arguments"]) == {"city": "Rome"}
    assert extract_tool_calls(forced, call)[0] is None
    # Cut off by max_tokens: shown as it is, no call (finish_reason stays "length").
    assert extract_tool_calls(forced, call[:25]) == (call[:25], [])


def test_tool_choice_none_passes_text_through():
    parser = ToolCallParser(setup(tool_choice="none"))
    assert parser.push(" " + OSLO).content == " " + OSLO
    assert parser.finish().calls == []


DEEP = 3000  # brackets: past Python's recursion limit (the default model writes `[[` as a token)


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        (TAGGED, "<tool_call>" + "[" * DEEP + "</tool_call>"),
        (TAGGED, '<tool_call>{"name": "now", "arguments": ' + '{"a": ' * DEEP + "</tool_call>"),
        (MISTRAL, "[TOOL_CALLS]" + "[" * DEEP),
        (MISTRAL, "[TOOL_CALLS]now[ARGS]" + '{"a": ' * DEEP),
        (LLAMA3_JSON, '{"name": "now", "parameters": ' + "[" * DEEP),
    ],
    ids=["tagged", "tagged-arguments", "mistral", "mistral-args", "llama3"],
)
def test_a_call_block_nested_past_the_recursion_limit_is_content(tool_format, text):
    """A degenerate answer (brackets until max_tokens) made the JSON decoder raise
    RecursionError: the whole response failed with a 500 (a stream, with an error event)."""
    assert extract_tool_calls(setup(), text, tool_format) == (text, [])
    forced = ToolCallParser(setup(tool_choice="required"), tool_format)
    forced.push("[" * DEEP)
    assert forced.finish().content == "[" * DEEP


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from shared.engine.model_files import resolve_model_dir

    directory, _ = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(directory)


def test_a_tagged_call_whose_tags_are_special_tokens_is_a_call(tokenizer):
    """Some models hold both `<tool_call>` and `</tool_call>` as special tokens: only the opener
    was kept by detokenization, so the block never closed and the call came back as content."""
    import copy

    from services.gateway.detokenizer import IncrementalDetokenizer
    from services.gateway.tool_formats import special_marker_ids

    marked = copy.deepcopy(tokenizer)
    marked.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]})
    kept = special_marker_ids(marked, TAGGED)
    ids = marked.encode("Sure. " + OSLO) + [marked.eos_token_id]
    detokenizer = IncrementalDetokenizer(marked, keep_special_ids=kept)
    text = "".join([detokenizer.push([i]) for i in ids] + [detokenizer.flush()])
    content, calls = extract_tool_calls(setup(), text, TAGGED)
    assert content == "Sure." and names_and_arguments(calls) == [("get_weather", {"city": "Oslo"})]


def test_a_mistral_call_whose_args_marker_is_a_special_token_is_a_call(tokenizer):
    """Mistral's newer tokenizers write `[TOOL_CALLS]name[ARGS]{...}` with both markers special
    tokens: `[ARGS]` was dropped by detokenization, and the call came back as content."""
    import copy

    from services.gateway.detokenizer import IncrementalDetokenizer
    from services.gateway.tool_formats import special_marker_ids

    marked = copy.deepcopy(tokenizer)
    marked.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    kept = special_marker_ids(marked, MISTRAL)
    ids = marked.encode(MISTRAL_TEXTS[1]) + [marked.eos_token_id]
    detokenizer = IncrementalDetokenizer(marked, keep_special_ids=kept)
    text = "".join([detokenizer.push([i]) for i in ids] + [detokenizer.flush()])
    content, calls = extract_tool_calls(setup(), text, MISTRAL)
    assert content is None
    assert names_and_arguments(calls) == [("get_weather", {"city": "Oslo"}), ("now", {})]


def test_call_arguments_keep_the_models_characters():
    """Arguments came back as ASCII JSON (`"Z\\u00fcrich"`), where OpenAI and vLLM give the
    text as written; a lone surrogate, no character, stays escaped so the response encodes."""
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Zürich"}}</tool_call>'
    (call,) = extract_tool_calls(setup(), text)[1]
    assert call["function"]["arguments"] == '{"city": "Zürich"}'
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "\\ud800"}}</tool_call>'
    (call,) = extract_tool_calls(setup(), text)[1]
    assert call["function"]["arguments"] == '{"city": "\\ud800"}'


MARKED_CALL = '{"name": "get_weather", "arguments": {"city": "%s"}}'
TAGGED_IN_STRING = r"Pa</tool_call>ris \" \\"  # (escapes too: a quote, a backslash)
MISTRAL_IN_STRING = "a[ARGS]b[TOOL_CALLS]c"


@pytest.mark.parametrize(
    ("tool_format", "text"),
    [
        (TAGGED, "<tool_call>" + MARKED_CALL % TAGGED_IN_STRING + "</tool_call>"),
        (MISTRAL, "[TOOL_CALLS][" + MARKED_CALL % MISTRAL_IN_STRING + "]"),
    ],
)
def test_a_call_marker_inside_a_calls_string_is_the_strings_text(tool_format, text):
    """The grammar of a response format beside tools lets a call's string hold its format's
    markers: the parser cut the block there, and the call came back as content."""
    tools = setup(tools=[WEATHER])
    content, calls = extract_tool_calls(tools, text, tool_format)
    city = json.loads(text[text.index("{") :].removesuffix("</tool_call>").removesuffix("]"))
    assert content is None and names_and_arguments(calls) == [("get_weather", city["arguments"])]
    content, streamed_calls = streamed(tools, list(text), tool_format)  # a character a push
    assert content == "" and names_and_arguments(streamed_calls) == names_and_arguments(calls)


def test_a_llama3_answer_holding_a_tools_name_is_content():
    """Beside a response format, Llama's answer begins as JSON too: an object with a `"name"`
    that is a tool's and other keys was read as a call with no arguments."""
    tools = setup(tools=[WEATHER])
    answer = '{"name": "get_weather", "summary": "sunny"}'
    assert extract_tool_calls(tools, answer, LLAMA3_JSON) == (answer, [])
    call = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
    assert names_and_arguments(extract_tool_calls(tools, call, LLAMA3_JSON)[1]) == [
        ("get_weather", {"city": "Oslo"})
    ]


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    ("tool_format", "call"),
    [
        (TAGGED, '<tool_call>{"name": "get_weather", "arguments": {"x": %s}}</tool_call>'),
        (MISTRAL, '[TOOL_CALLS][{"name": "get_weather", "arguments": {"x": %s}}]'),
        (MISTRAL, '[TOOL_CALLS]get_weather[ARGS]{"x": %s}'),
        (LLAMA3_JSON, '{"name": "get_weather", "parameters": {"x": %s}}'),
    ],
)
def test_a_call_holding_nan_or_infinity_is_content(tool_format, call, constant):
    """Python's JSON decoder takes `NaN` and `Infinity`, which JSON has not: such a call came
    back with them in its `arguments`, text no JSON parser of a client reads."""
    text = call % constant
    assert extract_tool_calls(setup(), text, tool_format) == (text, [])
