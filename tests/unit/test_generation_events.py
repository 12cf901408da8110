"""The gateway's choice events against a played cluster (each choice's deltas queued ahead, as
the stream reader would have put them): what a choice's workers sent after a stop string ended
it, and best_of's ranking of echoed candidates. The tokenizer is the real model's."""

from __future__ import annotations

import asyncio

import pytest
from structlog.testing import capture_logs

from services.gateway.cluster import ClusterView, SubmitRefused
from services.gateway.generation import Generator
from services.gateway.openai_protocol import (
    ApiError,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.responses import StreamChunks, collect_response
from shared import wire
from shared.engine.model_files import resolve_model_dir
from shared.lifecycle import GatewayEvents
from shared.logs import get_logger

MODEL = "m"


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    directory, _ = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(directory)


class PlayedCluster:
    """Each choice's deltas (by its index) are in its queue when it is submitted."""

    view = ClusterView()  # (the gateway reads the largest decode pool from it)
    peer_id = "g"

    def __init__(self, deltas_by_choice: dict[int, list[wire.TokenDelta]]):
        self.deltas_by_choice = deltas_by_choice
        self.cancelled: list[str] = []

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        queue: asyncio.Queue = asyncio.Queue()
        for delta in self.deltas_by_choice[int(submit.request_id.rsplit("-", 1)[1])]:
            queue.put_nowait(delta)
        return queue

    async def cancel(self, request_id: str, reason: str) -> None:
        self.cancelled.append(request_id)

    def finished(self, request_id: str) -> None:
        pass


def delta(token_ids, finish=None, logprobs=None, cached=None) -> wire.TokenDelta:
    return wire.TokenDelta(
        request_id="x",
        token_ids=token_ids,
        finish_reason=finish,
        logprobs=logprobs,
        num_cached_tokens=cached,
    )


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False).input_ids


async def run(tokenizer, body: dict, deltas_by_choice, collect: bool):
    generator = Generator(
        PlayedCluster(deltas_by_choice), tokenizer, MODEL, 8192, GatewayEvents(get_logger())
    )
    parse = parse_chat_request if "messages" in body else parse_completion_request
    request = parse({"model": MODEL, **body}, MODEL, 8192)
    generation = generator.prepare(request, "cmpl")
    events = generator.events(generation, "t")
    if collect:
        return await collect_response(generation, events)
    chunks = StreamChunks(generation)
    return [chunk async for event in events for chunk in chunks.chunks(event)]


def test_what_workers_sent_after_a_stop_string_ended_a_choice_is_not_output(tokenizer):
    """A stop string ends choice 0 at its second delta; its third, sent before the workers heard
    the cancel, made a second finish for index 0 and counted in the usage."""
    one, stop, more = ids(tokenizer, " one"), ids(tokenizer, "."), ids(tokenizer, " two")
    deltas = {
        0: [delta(one), delta(stop), delta(more)],
        1: [delta(ids(tokenizer, " three"), finish="length")],
    }
    body = {"prompt": "Count:", "n": 2, "stop": ["."], "max_tokens": 8, "stream": True}
    chunks = asyncio.run(run(tokenizer, body, deltas, collect=False))
    finishes = [c["choices"][0] for c in chunks if c["choices"][0]["finish_reason"]]
    assert sorted((c["index"], c["finish_reason"]) for c in finishes) == [
        (0, "stop"),
        (1, "length"),
    ]
    whole = asyncio.run(run(tokenizer, {**body, "stream": False}, deltas, collect=True))
    assert whole["choices"][0]["text"] == " one"
    expected = len(one) + len(stop) + len(ids(tokenizer, " three"))
    assert whole["usage"]["completion_tokens"] == expected


def test_echoed_candidates_are_ranked_by_their_own_tokens_logprobs(tokenizer):
    """With `echo` and no `logprobs`, the first event's logprobs (asked for the ranking) were
    dropped, and the ranking read the wrong tokens' (a negative slice)."""
    best, worse = ids(tokenizer, " a b c"), ids(tokenizer, " x y z")
    assert len(best) == len(worse) == 3
    deltas = {  # candidate 1 is best (mean -1.07); candidate 0's last token is, and ties rank it
        0: [delta(worse, finish="length", logprobs=[-2.0, -2.0, -1.0])],
        1: [delta(best, finish="length", logprobs=[-0.1, -0.1, -3.0])],
    }
    body = {"prompt": "Say:", "echo": True, "best_of": 2, "n": 1, "max_tokens": 3}
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    (choice,) = whole["choices"]
    assert choice["text"] == "Say: a b c" and choice["logprobs"] is None
    assert whole["usage"]["completion_tokens"] == 6  # both candidates are billed


def test_a_default_max_tokens_is_capped_to_the_largest_decode_pool(tokenizer):
    """Chat's default (1,024, capped by the context) was not capped by the decode workers' KV
    caches: on a cluster of small caches every chat without `max_tokens` was a 400 naming a
    max_tokens the client never sent. Now the status's largest pool caps it; an explicit
    max_tokens stays the client's (and the scheduler's 400 its answer)."""
    cluster = PlayedCluster({})
    cluster.view = ClusterView(max_decode_pool_tokens=100)
    generator = Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi"}]}
    generation = generator.prepare(parse_chat_request(body, MODEL, 8192), "chatcmpl")
    num_prompt_tokens = len(generation.prompt_token_ids)
    assert generation.params.max_tokens == 100 - num_prompt_tokens
    asked = parse_chat_request({**body, "max_tokens": 500}, MODEL, 8192)
    assert generator.prepare(asked, "chatcmpl").params.max_tokens == 500
    cluster.view = ClusterView()  # (no status yet: the context's room and the default alone)
    generation = generator.prepare(parse_chat_request(body, MODEL, 8192), "chatcmpl")
    assert generation.params.max_tokens == 1024


def test_a_prompt_past_the_largest_decode_pool_without_max_tokens_is_named_alone(tokenizer):
    """Without `max_tokens`, a prompt that fills the largest decode worker's KV cache was the
    scheduler's 400 "prompt plus max_tokens (2625 tokens)", the chat default the client never
    sent counted in; the prompt alone is named now. With `max_tokens` the scheduler's answer
    stands (the sum is what was asked)."""
    cluster = PlayedCluster({})
    generator = Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Say hi " * 20}]}
    num_prompt_tokens = len(
        generator.prepare(parse_chat_request(body, MODEL, 8192), "c").prompt_token_ids
    )
    cluster.view = ClusterView(max_decode_pool_tokens=num_prompt_tokens)
    with pytest.raises(ApiError) as refused:
        generator.prepare(parse_chat_request(body, MODEL, 8192), "chatcmpl")
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert f"the prompt is {num_prompt_tokens} tokens" in refused.value.message
    assert f"KV cache ({num_prompt_tokens} tokens)" in refused.value.message
    asked = parse_chat_request({**body, "max_tokens": 5}, MODEL, 8192)
    assert generator.prepare(asked, "chatcmpl").params.max_tokens == 5


def test_cached_tokens_in_the_usage_never_exceed_the_prompt(tokenizer):
    """A resumed attempt's prefill counts the cached part of its prompt and the output it was
    given: usage reported more cached prompt tokens than the prompt had."""
    deltas = {0: [delta(ids(tokenizer, " yes"), finish="length", cached=288)]}
    body = {"prompt": "Say yes.", "max_tokens": 1}
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    usage = whole["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"]


def test_a_sentencepiece_choice_continues_the_prompts_text():
    """Each choice's detokenizer starts from the prompt's last tokens, in completions, chat and
    every one of `n` choices: a first token `▁Paris` lost its space ("...isParis.")."""
    from tests.unit.test_detokenizer import sentencepiece_tokenizer

    tokenizer = sentencepiece_tokenizer(llama_decoder=True)
    tokenizer.chat_template = "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
    output = tokenizer.convert_tokens_to_ids(["▁Paris", ".", "</s>"])
    deltas = {i: [delta(output[:1]), delta(output[1:], finish="stop")] for i in range(2)}
    body = {"prompt": "The capital of France is", "max_tokens": 8, "echo": True}
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    assert whole["choices"][0]["text"] == "The capital of France is Paris."
    whole = asyncio.run(run(tokenizer, {**body, "echo": False, "n": 2}, deltas, collect=True))
    assert [c["text"] for c in whole["choices"]] == [" Paris.", " Paris."]
    chat = {"messages": [{"role": "user", "content": "The capital of France is"}], "n": 2}
    whole = asyncio.run(run(tokenizer, chat, deltas, collect=True))
    assert [c["message"]["content"] for c in whole["choices"]] == [" Paris.", " Paris."]


def test_a_stop_token_ends_the_text_but_stays_in_the_tokens(tokenizer):
    """A `stop_token_ids` token that ended the choice is not in its text (vLLM), though its id
    and logprob are still returned; 198 is "\n" in SmolLM2."""
    hello = ids(tokenizer, " Hello")
    deltas = {0: [delta(hello, logprobs=[-0.5]), delta([198], "stop", logprobs=[-0.25])]}
    body = {"prompt": "Say:", "max_tokens": 8, "logprobs": 1, "stop_token_ids": [198]}
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" Hello", "stop")
    assert choice["logprobs"]["tokens"] == [" Hello", "\n"]
    assert whole["usage"]["completion_tokens"] == 2
    chunks = asyncio.run(run(tokenizer, {**body, "stream": True}, deltas, collect=False))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == " Hello"
    body.pop("stop_token_ids")  # (an EOS-like finish on a token the request did not name)
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    assert whole["choices"][0]["text"] == " Hello\n"


def test_a_top_logprob_past_the_tokenizers_vocabulary_is_answered(tokenizer):
    """A padded embedding's id (past the tokenizer, as the engine ranks the model's whole
    vocabulary) among the top logprobs failed the answer with a 500; it has no text."""
    hello, past = ids(tokenizer, " Hello"), len(tokenizer) + 3
    top = [[(hello[0], -0.5), (past, -0.75)]]
    finish = wire.TokenDelta(request_id="x", token_ids=hello, finish_reason="length",
                             logprobs=[-0.5], top_logprobs=top)  # fmt: skip
    body = {"prompt": "Say:", "max_tokens": 1, "logprobs": 2}
    whole = asyncio.run(run(tokenizer, body, {0: [finish]}, collect=True))
    assert whole["choices"][0]["logprobs"]["top_logprobs"] == [{" Hello": -0.5, "": -0.75}]
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "logprobs": True,
            "top_logprobs": 2, "stream": True}  # fmt: skip
    chunks = asyncio.run(run(tokenizer, chat, {0: [finish]}, collect=False))
    (content,) = [c["choices"][0]["logprobs"]["content"] for c in chunks if c["choices"]]
    assert content[0]["top_logprobs"][1] == {"token": "", "logprob": -0.75, "bytes": []}


def test_the_arrival_is_logged_with_the_tenant_the_key_gives_not_the_user_field(tokenizer):
    """A keyed client's request saying `user: mallory` was logged as mallory's."""
    body = {"prompt": "Hi", "max_tokens": 1, "user": "mallory"}
    with capture_logs() as logs:
        asyncio.run(run(tokenizer, body, {0: [delta([5], finish="length")]}, collect=True))
    (arrived,) = [line for line in logs if line["event"] == "request arrived"]
    assert arrived["tenant"] == "t" and arrived["prompt_tokens"] > 0


def test_with_include_usage_every_chunk_says_usage_null_until_the_last(tokenizer):
    """OpenAI's stream asked with include_usage has `"usage": null` on every chunk but the last
    (clients that read `chunk.usage` on each find the key); without it, no such key."""
    for body in (
        {"prompt": "Hi", "max_tokens": 2},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    ):
        deltas = {0: [delta(ids(tokenizer, " a")), delta(ids(tokenizer, " b"), finish="length")]}
        asked = {**body, "stream": True, "stream_options": {"include_usage": True}}
        chunks = asyncio.run(run(tokenizer, asked, deltas, collect=False))
        assert chunks and all("usage" in c and c["usage"] is None for c in chunks)
        plain = asyncio.run(run(tokenizer, {**body, "stream": True}, deltas, collect=False))
        assert all("usage" not in c for c in plain)


def with_logprobs(token_ids: list[int], finish=None, **fields) -> wire.TokenDelta:
    """A delta whose tokens each have logprob -0.5 and themselves as their top alternative."""
    logprobs, tops = [-0.5] * len(token_ids), [[(t, -0.5)] for t in token_ids]
    return wire.TokenDelta(request_id="x", token_ids=token_ids, finish_reason=finish,
                           logprobs=logprobs, top_logprobs=tops, **fields)  # fmt: skip


def test_token_texts_of_a_character_split_over_tokens_add_up_to_the_text(tokenizer):
    """An emoji is two byte tokens in SmolLM2, each U+FFFD decoded alone: the tokens read
    " \ufffd", "\ufffd" where the text has " 😀", and every `text_offset` after them pointed one
    character too far. Now each token reads the characters it completes (read after the tokens
    before it, an earlier delta's or the prompt's), so the tokens' texts add up to the text;
    `bytes` stay each token's own."""
    output = ids(tokenizer, " I 😀 you.")
    assert [tokenizer.decode([t]) for t in output][1:3] == [" \ufffd", "\ufffd"]
    deltas = {0: [with_logprobs(output[:2]), with_logprobs(output[2:], finish="length")]}
    body = {"prompt": "Say:", "max_tokens": 8, "logprobs": 1}
    choice = asyncio.run(run(tokenizer, body, deltas, collect=True))["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"] == " I 😀 you."
    assert logprobs["tokens"][1:3] == [" ", "😀"] and logprobs["top_logprobs"][2] == {"😀": -0.5}
    assert logprobs["text_offset"] == [0, 2, 3, 4, 8]
    chunks = asyncio.run(run(tokenizer, {**body, "stream": True}, deltas, collect=False))
    streamed = [c["choices"][0]["logprobs"] for c in chunks]
    assert [o for lp in streamed for o in lp["text_offset"]] == logprobs["text_offset"]
    chat = {"messages": [{"role": "user", "content": "Say:"}], "max_tokens": 8,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip
    message = asyncio.run(run(tokenizer, chat, deltas, collect=True))["choices"][0]
    content = message["logprobs"]["content"]
    assert "".join(t["token"] for t in content) == message["message"]["content"]
    assert b"".join(bytes(t["bytes"]) for t in content) == " I 😀 you.".encode()
    assert content[2]["top_logprobs"][0]["token"] == "😀"
    prompt = ids(tokenizer, "Hi 😀")
    prompt_tops = [[(t, -1.0)] for t in prompt[1:]]
    scored = with_logprobs(output[:1], finish="length", prompt_logprobs=[-1.0] * len(prompt_tops),
                           prompt_top_logprobs=prompt_tops)  # fmt: skip
    echo = {"prompt": prompt, "echo": True, "max_tokens": 0, "logprobs": 1}
    choice = asyncio.run(run(tokenizer, echo, {0: [scored]}, collect=True))["choices"][0]
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"] == "Hi 😀"


def test_tokens_after_the_one_completing_a_stop_string_are_not_output(tokenizer):
    """A delta may hold two tokens (the decode worker's first, which repeats the prefill's
    token, when it arrives first); a stop string completed by the first ended the text there,
    but the second still counted in the usage and showed in the logprobs, past the text."""
    one, two = ids(tokenizer, " one."), ids(tokenizer, " two")
    deltas = {0: [with_logprobs(one + two), with_logprobs(ids(tokenizer, " x"), finish="length")]}
    body = {"prompt": "Count:", "stop": ["."], "max_tokens": 8, "logprobs": 1}
    whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (" one", "stop")
    assert choice["logprobs"]["tokens"] == [" one", "."]
    assert whole["usage"]["completion_tokens"] == len(one)
    chunks = asyncio.run(run(tokenizer, {**body, "stream": True}, deltas, collect=False))
    assert [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]] == [" one", "."]


def test_sentencepiece_logprob_tokens_keep_the_space_before_their_word():
    """A SentencePiece token `▁Paris` decoded alone reads "Paris" (the decoder drops a text's
    leading space), so the logprobs of a Llama or Mistral model read "Paris", "Hi" where the
    text has " Paris", " Hi": the tokens did not add up to the text, every `text_offset` after
    them was off, and chat's `bytes` could not rebuild the text. Each token now reads what it
    adds after the tokens before it, as the text's own detokenization does."""
    from tests.unit.test_detokenizer import sentencepiece_tokenizer

    for llama_decoder in (False, True):
        tokenizer = sentencepiece_tokenizer(llama_decoder=llama_decoder)
        tokenizer.chat_template = (
            "{% for m in messages %}[INST] {{ m['content'] }} [/INST]{% endfor %}"
        )
        output = tokenizer.convert_tokens_to_ids(["▁Paris", ".", "▁Hi"])
        deltas = {0: [with_logprobs(output[:1]), with_logprobs(output[1:], finish="length")]}
        body = {"prompt": "The capital of France is", "max_tokens": 8, "logprobs": 1}
        choice = asyncio.run(run(tokenizer, body, deltas, collect=True))["choices"][0]
        assert choice["text"] == " Paris. Hi"
        assert choice["logprobs"]["tokens"] == [" Paris", ".", " Hi"]
        assert choice["logprobs"]["text_offset"] == [0, 6, 7]
        echo = {**body, "echo": True}
        choice = asyncio.run(run(tokenizer, echo, deltas, collect=True))["choices"][0]
        assert "".join(choice["logprobs"]["tokens"]) == choice["text"]
        chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8,
                "logprobs": True, "top_logprobs": 1}  # fmt: skip
        message = asyncio.run(run(tokenizer, chat, deltas, collect=True))["choices"][0]
        content = message["logprobs"]["content"]
        assert [t["token"] for t in content] == [" Paris", ".", " Hi"]
        assert b"".join(bytes(t["bytes"]) for t in content) == b" Paris. Hi"
        assert content[0]["top_logprobs"][0]["token"] == " Paris"


def test_tokens_counted_in_the_metrics_are_those_the_usage_counts(tokenizer):
    """The metrics counted a delta's tokens before a stop string cut it: the generation tokens
    and the "request finished" line said more than `usage.completion_tokens`."""
    one, two = ids(tokenizer, " one."), ids(tokenizer, " two")
    telemetry = GatewayEvents(get_logger())
    generator = Generator(PlayedCluster({0: [delta(one + two)]}), tokenizer, MODEL, 8192, telemetry)
    body = {"model": MODEL, "prompt": "Count:", "stop": ["."], "max_tokens": 8}
    generation = generator.prepare(parse_completion_request(body, MODEL, 8192), "cmpl")
    whole = asyncio.run(collect_response(generation, generator.events(generation, "t")))
    assert whole["usage"]["completion_tokens"] == len(one)
    assert telemetry.generation_tokens._value.get() == len(one)


class SilentScheduler(PlayedCluster):
    """A scheduler that never answers a SUBMIT: the link gives up after `timeout_s`."""

    def __init__(self) -> None:
        super().__init__({})
        self.waits: list[float] = []

    async def submit(self, submit: wire.Submit, timeout_s: float = 10.0) -> asyncio.Queue:
        self.waits.append(timeout_s)
        await asyncio.sleep(timeout_s)
        raise SubmitRefused(503, "the scheduler did not answer", 1.0, answered=False)


@pytest.mark.parametrize("first_token_s, status", [(0.2, 504), (30.0, 503)])
def test_a_silent_scheduler_is_waited_for_no_longer_than_the_first_token_limit(
    tokenizer, first_token_s, status, monkeypatch
):
    """The answer was waited for 10 s whatever the request's limit: with
    `--first-token-timeout-s 0.2`, a 503 after 10 s, not the 504 at its limit."""
    from services.gateway import generation as module

    monkeypatch.setattr(module, "SUBMIT_ANSWER_S", 0.5)  # (the test's 10 s)
    cluster = SilentScheduler()
    timeouts = module.Timeouts(first_token_s=first_token_s)
    generator = Generator(cluster, tokenizer, MODEL, 8192, GatewayEvents(get_logger()), timeouts)
    body = {"model": MODEL, "prompt": "Hi", "max_tokens": 2}
    generation = generator.prepare(parse_completion_request(body, MODEL, 8192), "cmpl")
    with pytest.raises(ApiError) as info:
        asyncio.run(collect_response(generation, generator.events(generation, "t")))
    assert info.value.status == status
    assert cluster.waits[0] <= min(first_token_s, 0.5)
    if status == 504:
        assert "first_token_timeout_s" in info.value.message


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "strict": True,  # (the SDK parses a strict function's arguments)
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}


def test_an_answer_cut_after_a_call_finishes_length_not_tool_calls(tokenizer):
    """`max_tokens` cut the answer while a second call was being written: the choice said
    "tool_calls", as if whole, the half call left in its content with nothing to say it was
    cut. It says "length", its whole calls kept; an answer that ended says "tool_calls"."""
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    cut = ids(tokenizer, call + '\n<tool_call>\n{"name": "get_we')
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [WEATHER_TOOL],
            "max_tokens": len(cut)}  # fmt: skip
    for finish, expected in (("length", "length"), ("stop", "tool_calls")):
        deltas = {0: [delta(cut if finish == "length" else ids(tokenizer, call), finish=finish)]}
        whole = asyncio.run(run(tokenizer, body, deltas, collect=True))
        choice = whole["choices"][0]
        assert choice["finish_reason"] == expected
        assert [c["function"]["name"] for c in choice["message"]["tool_calls"]] == ["get_weather"]
        chunks = asyncio.run(run(tokenizer, {**body, "stream": True}, deltas, collect=False))
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert [f for f in finishes if f] == [expected]


FORCED_CALL = '{"name": "get_weather", "arguments": {"city": "Paris"}}'  # the whole output


@pytest.mark.parametrize("whole_call_in_one_delta", [True, False])
@pytest.mark.parametrize(
    "tool_choice,text",
    [("required", FORCED_CALL), ("auto", f"<tool_call>{FORCED_CALL}</tool_call>")],
)
def test_a_streamed_call_ends_in_a_chunk_of_its_own_as_the_sdks_stream_helper_reads(
    tokenizer, tool_choice, text, whole_call_in_one_delta
):
    """A forced call (the model's output constrained to it) came whole in the choice's last
    chunk, its finish reason beside it; the openai SDK's stream helper reads a chunk's finish
    reason before its tool calls, so its `tool_calls.function.arguments.done` event (which
    carries the parsed arguments) never came. OpenAI ends a choice with a chunk of its own."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    token_ids = ids(tokenizer, text)
    pieces = [token_ids] if whole_call_in_one_delta else [token_ids[:3], token_ids[3:]]
    deltas = {0: [delta(piece) for piece in pieces[:-1]] + [delta(pieces[-1], finish="stop")]}
    body = {
        "messages": [{"role": "user", "content": "Weather in Paris?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": tool_choice,
        "stream": True,
    }
    chunks = asyncio.run(run(tokenizer, body, deltas, collect=False))
    last = chunks[-1]["choices"][0]
    assert last["finish_reason"] == "tool_calls" and last["delta"] == {}
    assert all(c["choices"][0]["finish_reason"] is None for c in chunks[:-1])
    state = ChatCompletionStreamState(input_tools=[WEATHER_TOOL])
    events = [e for c in chunks for e in state.handle_chunk(ChatCompletionChunk(**c))]
    done = [e for e in events if e.type == "tool_calls.function.arguments.done"]
    assert [(e.name, e.parsed_arguments) for e in done] == [("get_weather", {"city": "Paris"})]
