"""Tests of the OpenAI wire format: every validation rule of both endpoints (each refusal a 400
naming the field, another model a 404), the mapping of valid requests to SamplingParams, and the
response builders checked against the `openai` package's own pydantic types."""

from __future__ import annotations

import json

import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from services.gateway.openai_protocol import (
    ApiError,
    GenerationRequest,
    bad_request,
    parse_chat_request,
    parse_completion_request,
)
from services.gateway.openai_shapes import (
    SSE_DONE,
    ChoiceResult,
    TokenLogprob,
    chat_chunk,
    chat_completion_id,
    chat_logprobs,
    chat_response,
    completion_chunk,
    completion_id,
    completion_logprobs,
    completion_response,
    sse_event,
    usage_chunk,
    usage_dict,
)
from shared.engine.sampling_params import SamplingParams

MODEL = "smollm2"
MAX_LEN = 2048
COMPLETION = {"model": MODEL, "prompt": "Hello"}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]}


def completion(**fields) -> GenerationRequest:
    return parse_completion_request({**COMPLETION, **fields}, MODEL, MAX_LEN)


def chat(**fields) -> GenerationRequest:
    return parse_chat_request({**CHAT, **fields}, MODEL, MAX_LEN)


def refused(parse, body, status: int = 400) -> ApiError:
    with pytest.raises(ApiError) as info:
        parse(body, MODEL, MAX_LEN)
    assert info.value.status == status
    assert info.value.body()["error"]["message"]
    return info.value


def assert_bad(parse, base: dict, fields: dict, param: str | None) -> ApiError:
    error = refused(parse, {**base, **fields})
    assert error.type == "invalid_request_error"
    assert error.param == param, error.message
    return error


# --- errors ------------------------------------------------------------------------------------


def test_error_body_has_openai_shape():
    error = bad_request("top_p", "must be in (0, 1]")
    assert error.status == 400
    assert error.body() == {
        "error": {
            "message": "must be in (0, 1]",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": None,
        }
    }


def test_error_type_must_be_known():
    assert ApiError(429, "slow down", "rate_limit_error").type == "rate_limit_error"
    with pytest.raises(AssertionError):
        ApiError(500, "?", "oops")


# --- the envelope: body, model, fields ---------------------------------------------------------


@pytest.mark.parametrize("parse", [parse_completion_request, parse_chat_request])
@pytest.mark.parametrize("body", [None, [], "x", 3, [COMPLETION]])
def test_body_must_be_an_object(parse, body):
    assert refused(parse, body).param is None


ENDPOINTS = [(parse_completion_request, COMPLETION), (parse_chat_request, CHAT)]


@pytest.mark.parametrize(("parse", "base"), ENDPOINTS)
class TestEnvelope:
    def test_model_is_required_and_a_string(self, parse, base):
        for model in (None, 3, True, "", ["smollm2"]):
            assert_bad(parse, base, {"model": model}, "model")
        assert refused(parse, {k: v for k, v in base.items() if k != "model"}).param == "model"

    def test_another_model_is_not_found(self, parse, base):
        error = refused(parse, {**base, "model": "gpt-4o"}, status=404)
        assert (error.type, error.param) == ("invalid_request_error", "model")  # OpenAI's
        assert error.code == "model_not_found"
        assert "gpt-4o" in error.message

    def test_unknown_field_is_named(self, parse, base):
        error = assert_bad(parse, base, {"temprature": 0.5}, "temprature")
        assert "unknown" in error.message

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("functions", [{"name": "f"}]),
            ("suffix", "end"),
        ],
    )
    def test_unsupported_field_is_refused(self, parse, base, field, value):
        error = assert_bad(parse, base, {field: value}, field)
        assert "not supported" in error.message

    @pytest.mark.parametrize(
        ("field", "value"),
        [
            ("tools", []),
            ("tool_choice", "none"),
            ("response_format", {"type": "text"}),
            ("best_of", 1),
            ("suffix", None),
        ],
    )
    def test_unsupported_field_asking_for_nothing_is_accepted(self, parse, base, field, value):
        parse({**base, field: value}, MODEL, MAX_LEN)

    def test_harmless_fields_are_ignored(self, parse, base):
        harmless = {
            "store": True,
            "metadata": {"k": "v"},
            "service_tier": "auto",
        }
        assert parse({**base, **harmless}, MODEL, MAX_LEN) == parse(base, MODEL, MAX_LEN)


def test_parallel_tool_calls_belongs_to_chat():
    """Read by chat's tools; completions, which have none, refuse it as OpenAI does (it was
    ignored there)."""
    fields = {"parallel_tool_calls": False}
    error = assert_bad(parse_completion_request, COMPLETION, fields, "parallel_tool_calls")
    assert "unknown" in error.message
    assert parse_chat_request({**CHAT, "parallel_tool_calls": False}, MODEL, MAX_LEN)

    @pytest.mark.parametrize(
        "metadata",
        [
            "tag",
            ["k", "v"],
            {"k": 1},
            {"k": None},
            {"k" * 65: "v"},
            {"k": "v" * 513},
            {f"k{i}": "v" for i in range(17)},
        ],
    )
    def test_metadata_outside_openais_bounds_is_refused(self, parse, base, metadata):
        """Ignored, it took any value: a client's wrong metadata went unseen until it sent the
        same to OpenAI (or to the Responses API here, which keeps it)."""
        error = assert_bad(parse, base, {"metadata": metadata}, "metadata")
        assert "`metadata`" in error.message
        bounds = {"k" * 64: "v" * 512} | {f"k{i}": "" for i in range(15)}
        assert parse({**base, "metadata": bounds}, MODEL, MAX_LEN) == parse(base, MODEL, MAX_LEN)


def _sdk_fields(parse) -> list[str]:
    """The request fields the `openai` package knows for the endpoint, but the required ones."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    module = chat_create_params if parse is parse_chat_request else completion_create_params
    fields = module.CompletionCreateParamsBase.__annotations__
    return sorted(set(fields) - {"model", "messages", "prompt"})


@pytest.mark.parametrize(("parse", "base"), ENDPOINTS)
def test_every_field_the_openai_package_knows_is_known(parse, base):
    """Each is implemented, ignored, or refused as unsupported unless it asks for nothing (null
    always does): `safety_identifier`, OpenAI's successor of `user`, was an "unknown field"."""
    for field in _sdk_fields(parse):
        parse({**base, field: None}, MODEL, MAX_LEN)


def test_fields_that_change_no_output_are_ignored_on_chat():
    harmless = {
        "safety_identifier": "user-1",
        "prompt_cache_retention": "24h",
        "prompt_cache_options": {"ttl": "30m"},
    }
    assert chat(**harmless) == chat()
    for field, value in (("verbosity", "low"), ("moderation", {"model": "m"})):
        error = assert_bad(parse_chat_request, CHAT, {field: value}, field)
        assert "not supported" in error.message


# --- fields both endpoints share ---------------------------------------------------------------

# (fields, the param the 400 names)
INVALID_COMMON = [
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": -3}, "max_tokens"),
    ({"max_tokens": 1.5}, "max_tokens"),
    ({"max_tokens": 16.0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"max_tokens": MAX_LEN}, "max_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": 2.5}, "temperature"),
    ({"temperature": True}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.01}, "top_p"),
    ({"top_p": False}, "top_p"),
    ({"seed": 1.5}, "seed"),
    ({"seed": True}, "seed"),
    ({"seed": -(2**63) - 1}, "seed"),
    ({"stop": ""}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop": 3}, "stop"),
    ({"stop": ["a", 3]}, "stop"),
    ({"stop": ["x" * 257]}, "stop"),
    ({"stop": [str(i) for i in range(17)]}, "stop"),
    ({"n": 0}, "n"),
    ({"n": 9}, "n"),
    ({"n": True}, "n"),
    ({"n": 2.0}, "n"),
    ({"user": 3}, "user"),
    ({"user": "u" * 257}, "user"),
    ({"stream": 1}, "stream"),
    ({"stream": "true"}, "stream"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": True, "stream_options": True}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": 1}}, "stream_options.include_usage"),
    ({"stream": True, "stream_options": {"usage": True}}, "stream_options.usage"),
    ({"top_k": 1.0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"top_k": True}, "top_k"),
    ({"top_k": 2**63}, "top_k"),  # int64 overflowed in the sampler's column, mid-step
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"ignore_eos": 1}, "ignore_eos"),
    ({"ignore_eos": "yes"}, "ignore_eos"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": True}, "min_tokens"),
    ({"max_tokens": 5, "min_tokens": 6}, "min_tokens"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"presence_penalty": -2.01}, "presence_penalty"),
    ({"frequency_penalty": 3}, "frequency_penalty"),
    ({"frequency_penalty": True}, "frequency_penalty"),
    ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
    ({"stop_token_ids": 5}, "stop_token_ids"),
    ({"logit_bias": [[5, 1]]}, "logit_bias"),  # OpenAI's is an object
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5.0": 1}}, "logit_bias"),
    ({"logit_bias": {" 5": 1}}, "logit_bias"),
    ({"logit_bias": {"-3": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 100.5}}, "logit_bias"),
    ({"logit_bias": {"5": "1"}}, "logit_bias"),
    ({"logit_bias": {"5": None}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": {"5": 1, "05": 2}}, "logit_bias"),  # the same token twice
    ({"logit_bias": {str(i): 1 for i in range(4097)}}, "logit_bias"),
    ({"priority": 1.5}, "priority"),
    ({"priority": True}, "priority"),
    ({"priority": 2**40}, "priority"),
]


@pytest.mark.parametrize(("fields", "param"), INVALID_COMMON)
def test_invalid_completion_field(fields, param):
    assert_bad(parse_completion_request, COMPLETION, fields, param)


@pytest.mark.parametrize(("fields", "param"), INVALID_COMMON)
def test_invalid_chat_field(fields, param):
    assert_bad(parse_chat_request, CHAT, fields, param)


def test_defaults():
    request = completion()
    assert (request.n, request.stream, request.include_usage) == (1, False, False)
    assert (request.stop, request.logprobs, request.user, request.priority) == ((), None, None, 0)
    assert request.max_tokens is None and not request.chat
    assert request.sampling_params(5, MAX_LEN) == SamplingParams(max_tokens=16)


def test_null_means_not_given():
    nulls = dict.fromkeys(["max_tokens", "temperature", "top_p", "seed", "stop", "n", "user"])
    nulls |= dict.fromkeys(["stream", "stream_options", "logprobs", "top_k", "priority"])
    assert completion(**nulls) == completion()


def test_a_negative_seed_is_taken_as_openais_int64_is():
    """OpenAI's (and vLLM's) seeds are int64s: -1 was a 400. Its 64 bits seed the engine, so
    distinct seeds stay distinct."""
    for seed, engine_seed in ((-1, 2**64 - 1), (-(2**63), 2**63), (5, 5)):
        assert completion(seed=seed).sampling_params(10, MAX_LEN).seed == engine_seed


def test_sampling_fields_reach_sampling_params():
    fields = {
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 40,
        "min_p": 0.05,
        "seed": 1234,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "ignore_eos": True,
        "min_tokens": 3,
        "stop_token_ids": [7, 8],
    }
    request = completion(max_tokens=50, **fields)
    expected = SamplingParams(max_tokens=50, **{**fields, "stop_token_ids": (7, 8)})
    assert request.sampling_params(10, MAX_LEN) == expected


@pytest.mark.parametrize("parse", [completion, chat])
def test_logit_bias_maps_token_ids_to_biases(parse):
    params = parse(logit_bias={"50256": -100, "7": 5, "0": 0.25}).sampling_params(1, MAX_LEN)
    assert params.logit_bias == ((0, 0.25), (7, 5.0), (50256, -100.0))
    for nothing in (None, {}):
        assert parse(logit_bias=nothing).sampling_params(1, MAX_LEN).logit_bias == ()


def test_ints_are_accepted_for_numbers():
    params = completion(temperature=1, top_p=1, min_p=0).sampling_params(1, MAX_LEN)
    assert (params.temperature, params.top_p, params.min_p) == (1.0, 1.0, 0.0)
    assert isinstance(params.temperature, float)


@pytest.mark.parametrize(
    "fields",
    [{"top_p": 10**309}, {"min_p": -(10**400)}, {"presence_penalty": 10**309},
     {"frequency_penalty": 10**309}, {"repetition_penalty": 10**309},
     {"logit_bias": {"1": 10**309}}],
)  # fmt: skip
def test_an_int_past_the_largest_float_is_a_400_naming_its_field(fields):
    """JSON's ints have no bound: one past a float's range raised OverflowError (a 500 in no
    OpenAI shape) where the number became a float."""
    (param,) = fields
    assert_bad(parse_completion_request, COMPLETION, fields, param)


@pytest.mark.parametrize("top_k", [-1, 0, 1, 50])
def test_top_k_off_or_positive(top_k):
    assert completion(top_k=top_k).sampling_params(1, MAX_LEN).top_k == top_k


def test_stop_string_or_list():
    assert completion(stop="\n").stop == ("\n",)
    assert completion(stop=["a", "bb"]).stop == ("a", "bb")
    assert completion(stop=[]).stop == ()
    assert completion(stop=["x" * 256] * 16).stop == ("x" * 256,) * 16


def test_n_user_priority_stream():
    request = completion(n=8, user="alice", priority=-3, stream=True)
    assert (request.n, request.user, request.priority, request.stream) == (8, "alice", -3, True)


def test_include_usage_needs_stream():
    assert completion(stream=True, stream_options={"include_usage": True}).include_usage
    assert not completion(stream=True, stream_options={"include_usage": False}).include_usage
    assert not completion(stream=True, stream_options={}).include_usage
    assert completion(stream=True, stream_options={"include_obfuscation": False}).stream


# --- max_tokens and the context ----------------------------------------------------------------


def test_default_max_tokens_fills_the_room_up_to_the_endpoint_default():
    assert completion().sampling_params(10, MAX_LEN).max_tokens == 16
    assert completion().sampling_params(MAX_LEN - 5, MAX_LEN).max_tokens == 5
    assert chat().sampling_params(10, MAX_LEN).max_tokens == 1024
    assert chat().sampling_params(1500, MAX_LEN).max_tokens == MAX_LEN - 1500


def test_explicit_max_tokens_must_fit_beside_the_prompt():
    request = completion(max_tokens=100)
    assert request.sampling_params(MAX_LEN - 100, MAX_LEN).max_tokens == 100
    with pytest.raises(ApiError) as info:
        request.sampling_params(MAX_LEN - 99, MAX_LEN)
    assert (info.value.status, info.value.param) == (400, "max_tokens")


@pytest.mark.parametrize(("parse", "param"), [(completion, "prompt"), (chat, "messages")])
def test_a_prompt_filling_the_context_is_refused(parse, param):
    with pytest.raises(ApiError) as info:
        parse().sampling_params(MAX_LEN, MAX_LEN)
    assert (info.value.status, info.value.param) == (400, param)


def test_min_tokens_above_the_default_is_refused_once_the_prompt_is_known():
    request = completion(min_tokens=20)
    with pytest.raises(ApiError) as info:
        request.sampling_params(10, MAX_LEN)
    assert info.value.param == "min_tokens"
    assert completion(min_tokens=20, max_tokens=20).sampling_params(10, MAX_LEN).min_tokens == 20


def test_max_completion_tokens_wins_and_is_named():
    request = chat(max_tokens=10, max_completion_tokens=20)
    assert (request.max_tokens, request.max_tokens_param) == (20, "max_completion_tokens")
    assert chat(max_tokens=10).max_tokens_param == "max_tokens"
    with pytest.raises(ApiError) as info:
        request.sampling_params(MAX_LEN - 19, MAX_LEN)
    assert info.value.param == "max_completion_tokens"
    name = "max_completion_tokens"
    for value in (0, True, 2.0):
        assert_bad(parse_chat_request, CHAT, {name: value}, name)
    # Both are checked, even when the other one wins.
    assert_bad(parse_chat_request, CHAT, {"max_tokens": True, name: 5}, "max_tokens")


# --- completions only ----------------------------------------------------------------------------


def test_prompt_forms():
    assert completion(prompt="Hi").prompt_text == "Hi"
    assert completion(prompt=["Hi"]).prompt_text == "Hi"
    request = completion(prompt=[1, 2, 3])
    assert (request.prompt_text, request.prompt_token_ids) == (None, [1, 2, 3])
    assert completion(prompt=[[1, 2, 3]]).prompt_token_ids == [1, 2, 3]  # a batch of one
    assert completion(prompt="Hi").prompt_token_ids is None and request.messages is None


@pytest.mark.parametrize(
    "prompt",
    [None, "", [], [""], ["a", "b"], [1, "a"], [1, True], [True], [1.0], [[1, 2], [3]], [-1], 3]
    + [{"a": 1}, [[]], [[-1]], [[1, "a"]], [[[1]]], [["a"]]],
)
def test_invalid_prompt(prompt):
    assert_bad(parse_completion_request, COMPLETION, {"prompt": prompt}, "prompt")


def test_missing_prompt():
    assert refused(parse_completion_request, {"model": MODEL}).param == "prompt"


def test_token_prompt_must_leave_room():
    assert_bad(parse_completion_request, COMPLETION, {"prompt": [1] * MAX_LEN}, "prompt")


@pytest.mark.parametrize("logprobs", [0, 1, 5, 20])
def test_completion_logprobs_mapping(logprobs):
    request = completion(logprobs=logprobs)
    assert request.logprobs == logprobs
    assert request.sampling_params(1, MAX_LEN).logprobs == logprobs


def test_echo_asks_for_the_prompts_logprobs_with_the_outputs():
    plain = completion()
    assert not plain.echo and plain.sampling_params(1, MAX_LEN).prompt_logprobs is None
    request = completion(echo=True, logprobs=2)
    assert request.echo and request.sampling_params(1, MAX_LEN).prompt_logprobs == 2
    assert completion(echo=True).sampling_params(1, MAX_LEN).prompt_logprobs is None
    assert completion(echo=False, logprobs=2).sampling_params(1, MAX_LEN).prompt_logprobs is None


def test_echoed_logprobs_are_bounded_by_what_one_answer_carries():
    from services.gateway.openai_protocol import MAX_PROMPT_LOGPROB_ENTRIES

    big = 10**6
    fits = MAX_PROMPT_LOGPROB_ENTRIES // 21
    completion(echo=True, logprobs=20).sampling_params(fits, big)
    with pytest.raises(ApiError) as raised:
        completion(echo=True, logprobs=20).sampling_params(fits + 1, big)
    assert raised.value.param == "logprobs" and "fewer" in raised.value.message
    completion(echo=True).sampling_params(fits + 1, big)  # no logprobs: only text
    completion(logprobs=20).sampling_params(fits + 1, big)  # no echo: the output's alone


def test_echo_alone_computes_one_token_and_fits_a_full_context():
    request = completion(echo=True, max_tokens=0, logprobs=0)
    assert request.max_tokens == 0
    assert request.sampling_params(MAX_LEN - 1, MAX_LEN).max_tokens == 1
    with pytest.raises(ApiError) as raised:  # the one token needs its place
        request.sampling_params(MAX_LEN, MAX_LEN)
    assert raised.value.param == "prompt"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 0, "echo": False}, "max_tokens"),
        ({"max_tokens": -1, "echo": True}, "max_tokens"),
        ({"echo": "yes"}, "echo"),
        ({"echo": 1}, "echo"),
    ],
)
def test_invalid_echo(fields, param):
    assert_bad(parse_completion_request, COMPLETION, fields, param)


def test_best_of_runs_candidates_ranked_by_their_logprobs():
    request = completion(best_of=3)
    assert (request.n, request.best_of, request.num_candidates) == (1, 3, 3)
    assert request.logprobs is None and request.sampling_params(1, MAX_LEN).logprobs == 0
    assert completion(best_of=3, logprobs=2).sampling_params(1, MAX_LEN).logprobs == 2
    assert completion(n=2, best_of=2, stream=True).num_candidates == 2  # none to drop: streams
    assert completion(n=3).num_candidates == 3 and completion().best_of is None


@pytest.mark.parametrize(
    "fields",
    [
        {"best_of": 1, "n": 2},
        {"best_of": 3, "stream": True},
        {"best_of": 0},
        {"best_of": 9},
        {"best_of": True},
        {"best_of": 2.0},
    ],
)
def test_invalid_best_of(fields):
    assert_bad(parse_completion_request, COMPLETION, fields, "best_of")


def test_best_of_is_not_a_chat_field():
    error = assert_bad(parse_chat_request, CHAT, {"best_of": 2}, "best_of")
    assert "not supported" in error.message
    assert parse_chat_request({**CHAT, "best_of": 1}, MODEL, MAX_LEN).num_candidates == 1


def test_echo_is_not_a_chat_field():
    error = assert_bad(parse_chat_request, CHAT, {"echo": True}, "echo")
    assert "not supported" in error.message
    parse_chat_request({**CHAT, "echo": False}, MODEL, MAX_LEN)


@pytest.mark.parametrize("logprobs", [-1, 21, True, False, 1.0, "5"])
def test_invalid_completion_logprobs(logprobs):
    assert_bad(parse_completion_request, COMPLETION, {"logprobs": logprobs}, "logprobs")


@pytest.mark.parametrize("field", ["messages", "max_completion_tokens", "top_logprobs"])
def test_chat_fields_are_unknown_to_completions(field):
    assert "unknown" in assert_bad(parse_completion_request, COMPLETION, {field: 1}, field).message


# --- chat only ---------------------------------------------------------------------------------


def test_messages_are_normalized():
    messages = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "ok", "name": "bot"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        {"role": "system", "content": ""},
    ]
    request = chat(messages=messages)
    assert request.chat and request.prompt_text is None and request.prompt_token_ids is None
    assert request.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42"},
        {"role": "system", "content": ""},
    ]


@pytest.mark.parametrize(
    ("messages", "param"),
    [
        (None, "messages"),
        ([], "messages"),
        ("Hi", "messages"),
        ({"role": "user", "content": "Hi"}, "messages"),
        (["Hi"], "messages[0]"),
        ([{"content": "Hi"}], "messages[0].role"),
        ([{"role": "robot", "content": "Hi"}], "messages[0].role"),
        ([{"role": 1, "content": "Hi"}], "messages[0].role"),
        ([{"role": ["user"], "content": "Hi"}], "messages[0].role"),  # unhashable: was a 500
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": None}], "messages[0].content"),
        ([{"role": "user", "content": 3}], "messages[0].content"),
        ([{"role": "user", "content": []}], "messages[0].content"),
        ([{"role": "user", "content": ["Hi"]}], "messages[0].content[0]"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
        ([{"role": "user", "content": [{"type": "text", "text": 3}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0]"),
        ([{"role": "user", "content": "Hi", "mood": "happy"}], "messages[0].mood"),
        ([{"role": "user", "content": "Hi", "name": 3}], "messages[0].name"),
        (
            [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]},
            ],
            "messages[1].tool_calls[0]",
        ),
    ],
)
def test_invalid_messages(messages, param):
    assert_bad(parse_chat_request, CHAT, {"messages": messages}, param)


def test_an_assistant_refusal_part_is_taken_as_its_text():
    """OpenAI's assistant content may hold `{"type": "refusal"}` parts beside text parts; vLLM
    renders their text. They were a 400 (only text parts), so such a history could not be
    sent back."""
    parts = [{"type": "text", "text": "Well."}, {"type": "refusal", "refusal": "I can't."}]
    request = chat(messages=[{"role": "assistant", "content": parts}, CHAT["messages"][0]])
    assert request.messages[0] == {"role": "assistant", "content": "Well.\nI can't."}
    user_refusal = {"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}
    assert_bad(parse_chat_request, CHAT, {"messages": [user_refusal]}, "messages[0].content[0]")


@pytest.mark.parametrize(
    "part",
    [{"type": "image_url", "image_url": {"url": "https://x/cat.png"}},
     {"type": "input_audio", "input_audio": {"data": "UklG", "format": "wav"}},
     {"type": "file", "file": {"file_id": "file-1"}}],
)  # fmt: skip
def test_a_part_the_model_cannot_read_is_refused_by_its_type(part):
    content = [{"type": "text", "text": "What is this?"}, part]
    messages = [{"role": "user", "content": content}]
    error = assert_bad(parse_chat_request, CHAT, {"messages": messages}, "messages[0].content[1]")
    assert f"`{part['type']}` parts are not supported" in error.message


def test_a_dumped_sdk_message_is_taken_back():
    """An agent loop appends `response.choices[0].message.model_dump()` to its history: the
    `openai` package fills every field of its ChatCompletionMessage, so the answer's own message
    came back with `refusal`, `audio`, `function_call`, `annotations` null and was a 400
    (unknown field `refusal`)."""
    answer = chat_response("chatcmpl-1", MODEL, 1, [ChoiceResult(0, "Hello", "stop", [1])],
                           usage_dict(1, 1))  # fmt: skip
    dumped = ChatCompletion.model_validate(answer).choices[0].message.model_dump()
    assert dumped["refusal"] is None and "audio" in dumped and "annotations" in dumped
    follow_up = {"role": "user", "content": "And then?"}
    request = chat(messages=[CHAT["messages"][0], dumped, follow_up])
    assert request.messages[1] == {"role": "assistant", "content": "Hello"}
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    answer["choices"][0]["message"].update(content=None, tool_calls=[call])
    dumped = ChatCompletion.model_validate(answer).choices[0].message.model_dump()
    result = {"role": "tool", "tool_call_id": "call_1", "content": "done"}
    request = chat(messages=[CHAT["messages"][0], dumped, result])
    assert request.template_messages[1]["tool_calls"][0]["function"] == {
        "name": "f",
        "arguments": {},
    }


@pytest.mark.parametrize(
    "fields",
    [{"refusal": "I can't"}, {"audio": {"id": "a1"}}, {"annotations": [{"type": "url"}]},
     {"function_call": {"name": "f", "arguments": "{}"}}],
)  # fmt: skip
def test_message_fields_tandem_does_not_implement_are_refused_unless_empty(fields):
    message = {"role": "assistant", "content": "ok", **fields}
    (param,) = fields
    assert_bad(parse_chat_request, CHAT, {"messages": [message]}, f"messages[0].{param}")


def test_missing_messages():
    assert refused(parse_chat_request, {"model": MODEL}).param == "messages"


def test_prompt_is_unknown_to_chat():
    assert_bad(parse_chat_request, CHAT, {"prompt": "Hi"}, "prompt")


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
        ({"logprobs": True, "top_logprobs": 20}, 20),
        ({"logprobs": None, "top_logprobs": None}, None),
    ],
)
def test_chat_logprobs_mapping(fields, expected):
    request = chat(**fields)
    assert request.logprobs == expected
    assert request.sampling_params(1, MAX_LEN).logprobs == expected


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logprobs": 1}, "logprobs"),
        ({"logprobs": 5}, "logprobs"),
        ({"logprobs": "true"}, "logprobs"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs"),
    ],
)
def test_invalid_chat_logprobs(fields, param):
    assert_bad(parse_chat_request, CHAT, fields, param)


# --- responses ---------------------------------------------------------------------------------


def token(text: str, logprob: float, top=()) -> TokenLogprob:
    return TokenLogprob(text, text.encode(), logprob, tuple(top))


HELLO = [
    token("Hello", -0.5, [token("Hello", -0.5), token("Hi", -1.5)]),
    token(" world", -0.25, [token(" world", -0.25), token(" there", -2.0)]),
]


def choices(logprobs=None) -> list[ChoiceResult]:
    return [
        ChoiceResult(0, "Hello world", "stop", [1, 2], logprobs),
        ChoiceResult(1, "Hi", "length", [3], logprobs and logprobs[:1]),
    ]


def test_usage():
    assert usage_dict(7, 3, cached_tokens=4) == {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    assert usage_dict(7, 3)["prompt_tokens_details"] == {"cached_tokens": 0}


def test_completion_logprobs_shape():
    assert completion_logprobs(HELLO, text_offset=4) == {
        "tokens": ["Hello", " world"],
        "token_logprobs": [-0.5, -0.25],
        "top_logprobs": [{"Hello": -0.5, "Hi": -1.5}, {" world": -0.25, " there": -2.0}],
        "text_offset": [4, 9],
    }


def test_each_positions_top_logprobs_hold_its_own_token_as_openais_do():
    """OpenAI: "the API will always return the logprob of the sampled token, so there may be up
    to logprobs+1 elements"; vLLM likewise. A token drawn outside the top n (sampling), or with
    `logprobs: 0`, was missing, and `top_logprobs[i][tokens[i]]` raised KeyError."""
    drawn = token(" there", -2.0, [token(" world", -0.25)])
    assert completion_logprobs([drawn])["top_logprobs"] == [{" world": -0.25, " there": -2.0}]
    alone = token(" there", -2.0, [])
    assert completion_logprobs([alone])["top_logprobs"] == [{" there": -2.0}]


def test_an_echoed_prompts_first_token_has_null_logprobs():
    first = TokenLogprob("Hello", b"Hello", None)
    result = completion_logprobs([first, *HELLO[1:]])
    assert result["token_logprobs"] == [None, -0.25]
    assert result["top_logprobs"] == [None, {" world": -0.25, " there": -2.0}]


def test_completion_logprobs_clamp_infinity():
    result = completion_logprobs([TokenLogprob("a", b"a", float("-inf"))])
    assert result["token_logprobs"] == [-9999.0] and result["top_logprobs"] == [{"a": -9999.0}]


def test_alternatives_sharing_a_text_are_keyed_by_their_bytes_and_the_sampled_one_by_its_own():
    """Tokens holding part of a character read "" (they complete none yet): the halves of
    different characters met under one key, the best kept, so `top_logprobs[i][tokens[i]]` read
    another token's logprob and fewer than n alternatives came. The sampled token keeps its
    text; the others sharing it go by OpenAI's `bytes:` keys (as OpenAI's own answers do)."""
    halves = (TokenLogprob("", b"\xe4\xbd", -0.5), TokenLogprob("", b"\xe6", -1.0))
    whole = TokenLogprob(" a", b" a", -2.0)
    drawn = TokenLogprob("", b"\xe6", -1.0, (*halves, whole))
    assert completion_logprobs([drawn])["top_logprobs"] == [
        {"bytes:\\xe4\\xbd": -0.5, "": -1.0, " a": -2.0}
    ]
    outside = TokenLogprob("", b"\xf0\x9f", -3.0, (*halves, whole))  # drawn outside the top
    top = completion_logprobs([outside])["top_logprobs"][0]
    assert top == {"bytes:\\xe4\\xbd": -0.5, "bytes:\\xe6": -1.0, " a": -2.0, "": -3.0}
    assert list(top.values()) == sorted(top.values(), reverse=True)


def test_chat_logprobs_shape():
    content = chat_logprobs(HELLO[:1])["content"]
    assert content == [
        {
            "token": "Hello",
            "logprob": -0.5,
            "bytes": list(b"Hello"),
            "top_logprobs": [
                {"token": "Hello", "logprob": -0.5, "bytes": list(b"Hello")},
                {"token": "Hi", "logprob": -1.5, "bytes": list(b"Hi")},
            ],
        }
    ]


@pytest.mark.parametrize("logprobs", [None, HELLO])
def test_completion_response_is_an_openai_completion(logprobs):
    body = completion_response("cmpl-1", MODEL, 1700000000, choices(logprobs), usage_dict(4, 3))
    parsed = Completion.model_validate(body)
    assert parsed.object == "text_completion" and parsed.usage.total_tokens == 7
    assert [c.text for c in parsed.choices] == ["Hello world", "Hi"]
    assert [c.finish_reason for c in parsed.choices] == ["stop", "length"]
    if logprobs:
        assert parsed.choices[0].logprobs.text_offset == [0, 5]
    assert json.loads(json.dumps(body)) == body


@pytest.mark.parametrize("logprobs", [None, HELLO])
def test_chat_response_is_an_openai_chat_completion(logprobs):
    body = chat_response("chatcmpl-1", MODEL, 1700000000, choices(logprobs), usage_dict(4, 3))
    parsed = ChatCompletion.model_validate(body)
    assert parsed.object == "chat.completion"
    assert parsed.choices[0].message.role == "assistant"
    assert parsed.choices[0].message.content == "Hello world"
    if logprobs:
        assert parsed.choices[0].logprobs.content[1].top_logprobs[1].token == " there"
    else:
        assert parsed.choices[0].logprobs is None


def test_completion_chunks_are_openai_completions():
    logprobs = completion_logprobs(HELLO[1:], text_offset=5)
    last = completion_chunk("cmpl-1", MODEL, 1, 0, " world", "stop", logprobs)
    assert Completion.model_validate(last).choices[0].logprobs.text_offset == [5]
    middle = completion_chunk("cmpl-1", MODEL, 1, 0, "Hello", None, None)
    # The openai package types finish_reason as required, yet OpenAI streams null until the end.
    assert middle["choices"][0]["finish_reason"] is None
    finished = {**middle["choices"][0], "finish_reason": "stop"}
    Completion.model_validate({**middle, "choices": [finished]})
    usage = usage_chunk("cmpl-1", MODEL, 1, usage_dict(1, 2), chat=False)
    assert Completion.model_validate(usage).usage.total_tokens == 3


def test_chat_chunks_are_openai_chat_completion_chunks():
    first = ChatCompletionChunk.model_validate(
        chat_chunk("chatcmpl-1", MODEL, 1, 0, "", None, None, role_first=True)
    )
    assert (first.choices[0].delta.role, first.choices[0].delta.content) == ("assistant", "")
    middle = chat_chunk("chatcmpl-1", MODEL, 1, 0, "Hello", None, chat_logprobs(HELLO[:1]))
    parsed = ChatCompletionChunk.model_validate(middle)
    assert parsed.choices[0].delta.role is None and parsed.choices[0].finish_reason is None
    assert parsed.choices[0].logprobs.content[0].token == "Hello"
    last = chat_chunk("chatcmpl-1", MODEL, 1, 0, None, "length", None)
    assert last["choices"][0]["delta"] == {}
    assert ChatCompletionChunk.model_validate(last).choices[0].finish_reason == "length"
    usage = usage_chunk("chatcmpl-1", MODEL, 1, usage_dict(1, 2), chat=True)
    usage = ChatCompletionChunk.model_validate(usage)
    assert usage.choices == [] and usage.usage.completion_tokens == 2


def test_ids_are_unique_and_prefixed():
    assert completion_id().startswith("cmpl-") and chat_completion_id().startswith("chatcmpl-")
    assert completion_id() != completion_id()


def test_sse_events():
    event = sse_event({"text": "héllo\nworld"})
    assert event.startswith(b"data: ") and event.endswith(b"\n\n") and event.count(b"\n") == 2
    assert json.loads(event[len(b"data: ") :]) == {"text": "héllo\nworld"}
    assert sse_event("[DONE]") == SSE_DONE == b"data: [DONE]\n\n"
    assert sse_event("a\nb") == b"data: a\ndata: b\n\n"
    with pytest.raises(ValueError):
        sse_event({"logprob": float("-inf")})
