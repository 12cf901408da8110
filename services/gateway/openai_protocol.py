"""OpenAI request bodies in, validated `GenerationRequest`s out (the response shapes are in
`openai_shapes`).

Parsing is strict, so that a client's mistake is answered at once with a 400 naming the field
(OpenAI's `param`) rather than silently changing the output. Every key of the body is one of:
a field tandem implements (checked for type and range), a known OpenAI field tandem does not
implement (refused unless its value asks for nothing, e.g. `echo: false`), a harmless field that
changes no output (accepted and ignored), or an unknown field (refused, so typos surface).
JSON null means "not given" for every optional field, as in OpenAI's API. Bools are never taken
for numbers, nor numbers for bools.

The default `max_tokens` depends on the prompt's length, known only after tokenization, so
parsing keeps the client's sampling fields as they came (already validated by building a
`SamplingParams` once) and `GenerationRequest.sampling_params()` builds the final parameters
when the caller knows the number of prompt tokens.

No sockets and no tokenizer here: the gateway's HTTP layer and detokenizer live elsewhere.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, NoReturn

from services.gateway.structured_outputs import check_parses, parse_constraint
from services.gateway.tools import ToolSetup, fallback_messages, parse_history_calls, parse_tools
from shared.engine.sampling_params import MAX_LOGPROBS, SamplingParams
from shared.errors import InvalidRequestError
from shared.openai_metadata import metadata_problem

ERROR_TYPES = frozenset(
    {
        "invalid_request_error",
        "rate_limit_error",
        "service_unavailable",
        "authentication_error",
        "server_error",
    }
)
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
CHAT_DEFAULT_MAX_TOKENS = 1024  # capped further by the room the context leaves
MAX_N = 8
MAX_STOPS = 16
MAX_STOP_CHARS = 256
MAX_USER_CHARS = 256
MAX_TEMPERATURE = 2.0  # OpenAI's range; SamplingParams alone would accept any temperature >= 0
# An echoed prompt's logprobs travel in one message header (at most 16 MiB): a logprob and its
# top n per token, ~11 bytes each (an 8,191-token prompt with 20 alternatives took 1.9 MB), so
# about 6 MiB at most.
MAX_PROMPT_LOGPROB_ENTRIES = 1 << 19

# Client fields handed to SamplingParams as they are; it checks their types and ranges.
_SAMPLING_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "stop_token_ids",
)
_COMMON_FIELDS = frozenset(
    {"model", "max_tokens", "stop", "n", "stream", "stream_options", "user", "logprobs"}
    | {"priority"}  # tandem's extension, as are top_k, min_p, ... in _SAMPLING_FIELDS
    | {"response_format", "structured_outputs"}  # see services.gateway.structured_outputs
    | {"logit_bias"}
    | set(_SAMPLING_FIELDS)
)
_COMPLETION_FIELDS = _COMMON_FIELDS | {"prompt", "echo", "best_of"}
_CHAT_FIELDS = _COMMON_FIELDS | {"messages", "max_completion_tokens", "top_logprobs"}
# (see services.gateway.tools; refused on completions, `parallel_tool_calls` as unknown there)
_CHAT_FIELDS |= {"tools", "tool_choice", "parallel_tool_calls"}
# Fields that change nothing tandem produces: accepted and ignored (`metadata` checked first).
_IGNORED_FIELDS = frozenset(
    {"store", "metadata", "service_tier", "safety_identifier"}
    | {"prompt_cache_key", "prompt_cache_options", "prompt_cache_retention"}
)
# Known OpenAI fields tandem does not implement, each with the values that ask for nothing
# (null always does); any other value is refused rather than silently ignored.
_UNSUPPORTED_FIELDS: Mapping[str, tuple[Any, ...]] = MappingProxyType(
    {
        "tools": ([],),
        "tool_choice": ("none",),
        "functions": ([],),
        "function_call": ("none",),
        "suffix": ("",),
        "best_of": (1,),
        "echo": (False,),
        "audio": (),
        "modalities": (["text"],),
        "prediction": (),
        "reasoning_effort": (),
        "web_search_options": (),
        "verbosity": (),
        "moderation": (),
    }
)
_ROLES = frozenset({"system", "user", "assistant", "tool", "developer"})
_MESSAGE_FIELDS = frozenset({"role", "content", "name", "tool_call_id", "tool_calls"})
# An answer's message fields tandem never fills, with the values that ask for nothing: the
# `openai` package's `message.model_dump()`, which agents append to their history, has them all.
_UNSUPPORTED_MESSAGE_FIELDS: Mapping[str, tuple[Any, ...]] = MappingProxyType(
    {"refusal": ("",), "audio": (), "function_call": (), "annotations": ([],)}
)
_STREAM_OPTIONS = frozenset({"include_usage", "include_obfuscation"})


# --- errors ------------------------------------------------------------------------------------


class ApiError(Exception):
    """An error answered to the client: HTTP `status` and OpenAI's error object."""

    def __init__(
        self,
        status: int,
        message: str,
        error_type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ):
        assert error_type in ERROR_TYPES, error_type
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = error_type
        self.param = param
        self.code = code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def unforeseen(error: Exception) -> ApiError:
    """An exception no code path meant (a bug), answered as a 500 in OpenAI's shape on either
    door, its details in the log only (the RPC door sent the exception's text, which may hold
    another request's data or the server's internals)."""
    message = f"the gateway failed on this request ({type(error).__name__}; its log has the "
    return ApiError(500, message + "traceback)", "server_error")


def bad_request(param: str | None, message: str) -> ApiError:
    return ApiError(400, message, "invalid_request_error", param)


def model_not_found(model: str, served_model: str) -> ApiError:
    """A 404 that names the model served: a client given a `--model` path named the path, or
    another model, and learnt nothing from OpenAI's words alone."""
    message = f"The model `{model}` does not exist; this server serves `{served_model}`."
    # (OpenAI's type for it; it was `not_found_error`, which OpenAI never sends)
    return ApiError(404, message, "invalid_request_error", "model", "model_not_found")


def from_invalid_request(error: InvalidRequestError) -> ApiError:
    return bad_request(error.param, error.message)


def _fail(param: str | None, message: str) -> NoReturn:
    raise bad_request(param, message)


# --- the parsed request ------------------------------------------------------------------------


@dataclass(frozen=True)
class GenerationRequest:
    """One validated completion or chat request. Exactly one of `prompt_text`,
    `prompt_token_ids` (completions) and `messages` (chat) is set."""

    model: str
    chat: bool
    prompt_text: str | None
    prompt_token_ids: list[int] | None
    messages: list[dict[str, str]] | None  # [{"role", "content"}] in the tools' fallback format
    max_tokens: int | None  # None: not given, the default depends on the prompt's length
    max_tokens_param: str  # the field it came from, named in errors: chat may use another
    sampling_kwargs: Mapping[str, Any]  # SamplingParams fields the client gave, but max_tokens
    stop: tuple[str, ...]
    n: int
    stream: bool
    include_usage: bool  # stream a last chunk with the usage (stream_options.include_usage)
    logprobs: int | None  # None: not asked; 0: the chosen token's only; k: also the top k
    user: str | None
    priority: int
    tools: ToolSetup | None = None  # chat with `tools`: calls are parsed from the output
    # The same conversation as chat templates that render tools take it (tool_calls parsed, no
    # tool text added); services.gateway.chat_prompt chooses between the two.
    template_messages: list[dict[str, Any]] | None = None
    # Completions' `echo`: each choice's text (and logprobs) start with the prompt's. With
    # `max_tokens` 0 (echo only) a choice is the prompt alone: one token is computed, not shown.
    echo: bool = False
    # Completions' `best_of`: this many candidates run, and the `n` of highest mean logprob per
    # token are answered (never streamed). None: n.
    best_of: int | None = None

    @property
    def num_candidates(self) -> int:
        """Choices generated: `best_of` of them when given, else `n`."""
        return max(self.n, self.best_of or 0)

    @property
    def prompt_param(self) -> str:
        return "messages" if self.chat else "prompt"

    def holds_more_text(self, limit: int) -> bool:
        """Whether the prompt holds more than `limit` characters: its text, or a chat's
        messages (and tools: the template renders them) before any template's own text."""
        if self.prompt_text is not None:
            return len(self.prompt_text) > limit
        if self.messages is None:
            return False  # token ids: no text
        functions = self.tools.functions if self.tools is not None else ()
        return _has_more_text([self.messages, self.template_messages, functions], limit)

    def sampling_params(
        self,
        num_prompt_tokens: int,
        max_model_len: int,
        defaults: Mapping[str, Any] | None = None,
        tool_format: str = "tagged",
        cache_room: int | None = None,
    ) -> SamplingParams:
        """The final parameters once the prompt is tokenized; the fields the client left unset
        take `defaults` (the served model's, see shared.engine.sampling_defaults). Without
        `max_tokens` the output may fill the context, up to the endpoint's default; an explicit
        one that does not fit beside the prompt is refused, as is a prompt that leaves no room
        at all. `tool_format` names how the model writes tool calls (`CALL_FORMATS`).
        `cache_room`: the output tokens the largest decode worker's KV cache holds after the
        prompt (None: not known); the default is capped to it too, where it leaves any (chat's
        1,024 made every chat without `max_tokens` a 400 on a cluster of small caches, naming a
        max_tokens the client never sent). An explicit max_tokens is the client's to lower."""
        room = max_model_len - num_prompt_tokens
        if self.echo and self.logprobs is not None:
            entries = num_prompt_tokens * (1 + self.logprobs)
            if entries > MAX_PROMPT_LOGPROB_ENTRIES:
                _fail(
                    "logprobs",
                    f"echoing {num_prompt_tokens} prompt tokens with {self.logprobs} logprobs "
                    f"each is more than one answer carries ({MAX_PROMPT_LOGPROB_ENTRIES} "
                    "logprobs in all): ask for fewer, or send a shorter prompt",
                )
        if room < 1:  # (an echo alone too: its logprobs come with one token computed)
            _fail(
                self.prompt_param,
                f"the prompt is {num_prompt_tokens} tokens, which leaves no room for output "
                f"in this model's context of {max_model_len} tokens",
            )
        if self.max_tokens == 0:  # echo only: the prompt's logprobs come with a first token
            return _sampling_params(self._kwargs(defaults, tool_format), 1)
        if self.max_tokens is None:
            default = CHAT_DEFAULT_MAX_TOKENS if self.chat else COMPLETION_DEFAULT_MAX_TOKENS
            max_tokens = min(default, room)
            if cache_room is not None and cache_room < 1:  # (named so: no max_tokens was sent)
                _fail(
                    self.prompt_param,
                    f"the prompt is {num_prompt_tokens} tokens, which leaves no room for output "
                    f"in the largest decode worker's KV cache ({num_prompt_tokens + cache_room} "
                    "tokens)",
                )
            if cache_room is not None:
                max_tokens = min(max_tokens, cache_room)
        elif self.max_tokens > room:
            _fail(
                self.max_tokens_param,
                f"this model's context is {max_model_len} tokens, but {num_prompt_tokens} "
                f"prompt tokens and {self.max_tokens} output tokens were asked for",
            )
        else:
            max_tokens = self.max_tokens
        return _sampling_params(self._kwargs(defaults, tool_format), max_tokens)

    def _kwargs(self, defaults: Mapping[str, Any] | None, tool_format: str) -> dict[str, Any]:
        """The sampling fields given, over `defaults`; a `response_format` beside tools the
        model may call lets it answer in that format or call them (`ToolSetup.answer_or_calls`).
        vLLM's `structured_outputs` shapes the output itself, calls and all, and stays as it is
        (as beside a forced call)."""
        kwargs = {**(defaults or {}), **self.sampling_kwargs}
        answer = kwargs.get("constraint")
        if (
            answer is not None
            and answer.param.startswith("response_format")
            and self.tools is not None
            and self.tools.choice == "auto"
        ):
            try:
                kwargs["constraint"] = self.tools.answer_or_calls(answer, tool_format)
                check_parses(kwargs["constraint"])
            except InvalidRequestError as error:
                raise from_invalid_request(error) from None
        return kwargs


def _sampling_params(kwargs: Mapping[str, Any], max_tokens: int) -> SamplingParams:
    try:
        return SamplingParams(max_tokens=max_tokens, **kwargs)
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None


# --- field readers: JSON null is "not given"; each failure names the field -----------------------


def _parse_logit_bias(value: Any) -> tuple[tuple[int, Any], ...] | None:
    """OpenAI's object of token id (a JSON key: a string) to bias, as (id, bias) pairs; the
    biases' types and ranges are SamplingParams' to check, the ids' vocabulary the gateway's."""
    if value is None:
        return None
    if not isinstance(value, dict):
        _fail("logit_bias", f"must be an object mapping token ids to biases, got {value!r}")
    pairs = []
    for key, bias in value.items():
        if not re.fullmatch(r"-?[0-9]{1,12}", key):
            _fail("logit_bias", f"keys must be token ids (integers), got {key!r}")
        pairs.append((int(key), bias))
    return tuple(pairs)


def is_int(value: Any) -> bool:
    """An integer as JSON gives one (`true` is a bool, not 1)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int_field(body: Mapping[str, Any], name: str, low: int, high: int | None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if not is_int(value):
        _fail(name, f"must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        _fail(name, f"must be in [{low}, {high if high is not None else 'inf'}], got {value}")
    return value


def _bool_field(body: Mapping[str, Any], name: str) -> bool | None:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        _fail(name, f"must be a boolean, got {value!r}")
    return value


def _str_field(body: Mapping[str, Any], name: str, max_chars: int) -> str | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > max_chars:
        _fail(name, f"must be a string of at most {max_chars} characters")
    return value


def _asks_for_nothing(value: Any, harmless: tuple[Any, ...]) -> bool:
    # Compared with the type too: `echo: 0` or `best_of: true` is a client bug, not a default.
    return value is None or any(type(value) is type(h) and value == h for h in harmless)


def check_metadata(metadata: Any) -> None:
    """OpenAI's bounds on `metadata` (it is echoed in a Response, and kept with it; chat and
    completions ignore it, but it took any value: a client's bug went unseen)."""
    problem = metadata_problem(metadata)
    if problem is not None:
        _fail("metadata", problem)


def _check_fields(body: Any, allowed: frozenset[str]) -> dict[str, Any]:
    if not isinstance(body, dict):
        _fail(None, "the request body must be a JSON object")
    for name, value in body.items():
        if name == "metadata":
            check_metadata(value)
        if name in allowed or name in _IGNORED_FIELDS:
            continue
        if name in _UNSUPPORTED_FIELDS:
            if not _asks_for_nothing(value, _UNSUPPORTED_FIELDS[name]):
                _fail(name, f"`{name}` is not supported by this server")
        else:
            _fail(name, f"unknown field `{name}`")
    return body


def _check_model(body: Mapping[str, Any], served_model: str) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        _fail("model", "`model` is required and must be a string")
    if model != served_model:
        raise model_not_found(model, served_model)
    return model


# --- the prompt --------------------------------------------------------------------------------


def _parse_prompt(value: Any, max_model_len: int) -> tuple[str | None, list[int] | None]:
    """(text, None) or (None, token ids). A batch of prompts is refused here: the HTTP route
    splits one into a request per prompt first (`batched_prompts`), and the RPC door, the batch
    service and /tokenize take one prompt a call."""
    if isinstance(value, str) and value:
        return value, None
    if _is_token_list(value):
        if min(value) < 0:
            _fail("prompt", "token ids must be >= 0")
        if len(value) >= max_model_len:
            _fail("prompt", f"the prompt is {len(value)} tokens; the context is {max_model_len}")
        return None, list(value)
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], str) and value[0]:
        return value[0], None
    if isinstance(value, list) and len(value) == 1 and _is_token_list(value[0]):
        return _parse_prompt(value[0], max_model_len)  # a batch of one (lm-eval sends it so)
    if isinstance(value, list) and len(value) > 1:
        _fail("prompt", "a batch of prompts is taken by HTTP /v1/completions only: one a call here")
    _fail("prompt", "must be a non-empty string or list of token ids, alone or in a list")


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and all(is_int(t) for t in value)


def _parse_messages(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list) or not value:
        _fail("messages", "must be a non-empty list of messages")
    return [_parse_message(message, f"messages[{i}]") for i, message in enumerate(value)]


def _parse_message(message: Any, where: str) -> dict[str, Any]:
    """{"role", "content"} (content always a string), with `tool_calls` (parsed) on an assistant
    message that has them and `tool_call_id` on a tool message that gives it."""
    if not isinstance(message, dict):
        _fail(where, "a message must be an object with `role` and `content`")
    for name, value in message.items():
        if name in _UNSUPPORTED_MESSAGE_FIELDS:
            if not _asks_for_nothing(value, _UNSUPPORTED_MESSAGE_FIELDS[name]):
                _fail(f"{where}.{name}", f"`{name}` is not supported by this server")
        elif name not in _MESSAGE_FIELDS:
            _fail(f"{where}.{name}", f"unknown field `{name}`")
    calls = message.get("tool_calls")
    if calls and message.get("role") != "assistant":
        _fail(f"{where}.tool_calls", "only assistant messages carry tool calls")
    for name in ("name", "tool_call_id"):  # `name` is accepted, unused: no speaker names
        if message.get(name) is not None and not isinstance(message[name], str):
            _fail(f"{where}.{name}", "must be a string")
    role = message.get("role")
    if not isinstance(role, str) or role not in _ROLES:
        _fail(f"{where}.role", f"must be one of {sorted(_ROLES)}, got {role!r}")
    if calls:
        text = message.get("content")
        text = "" if text is None else _parse_content(text, f"{where}.content", role)
        return {"role": "assistant", "content": text, "tool_calls": _history_calls(calls, where)}
    content = _parse_content(message.get("content"), f"{where}.content", role)
    # Open models' chat templates know system/user/assistant/tool; for OpenAI, `developer` is
    # the new name of `system`.
    parsed = {"role": "system" if role == "developer" else role, "content": content}
    if role == "tool":
        # Required, as OpenAI's: without it the result was shown as no call's (a framework's
        # bug answered 200). One naming no earlier call is taken: trimmed histories send those.
        if not message.get("tool_call_id"):
            _fail(f"{where}.tool_call_id", "a tool message must name the call it answers")
        parsed["tool_call_id"] = message["tool_call_id"]
    return parsed


def _history_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    try:
        return parse_history_calls(calls, f"{where}.tool_calls")
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None


def _parse_content(content: Any, where: str, role: str) -> str:
    """A string, or text parts joined with newlines (as vLLM does). An assistant message may
    also hold OpenAI's `refusal` parts, taken as text as vLLM does; any other part (an image,
    audio, a file) is refused: the model reads text only, and dropping it would answer another
    question than the one asked."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        _fail(where, "must be a string or a non-empty list of text parts")
    return "\n".join(_part_text(part, f"{where}[{j}]", role) for j, part in enumerate(content))


def _part_text(part: Any, where: str, role: str) -> str:
    kind = part.get("type") if isinstance(part, dict) else None
    text_key = "refusal" if kind == "refusal" and role == "assistant" else "text"
    if kind == text_key and len(part) == 2 and isinstance(part.get(text_key), str):
        return part[text_key]
    if isinstance(kind, str) and kind not in ("text", "refusal"):
        shown = kind if len(kind) <= 40 else kind[:40] + "..."
        _fail(where, f"`{shown}` parts are not supported: this model reads text parts only")
    parts = '{"type": "text", "text": string}'
    if role == "assistant":
        parts += ' and {"type": "refusal", "refusal": string}'
    _fail(where, f"only text parts, {parts}, are supported")


# --- the other fields --------------------------------------------------------------------------


def _parse_stop(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or len(stops) > MAX_STOPS:
        _fail("stop", f"must be a string or a list of at most {MAX_STOPS} strings")
    for stop in stops:
        if not isinstance(stop, str) or not 1 <= len(stop) <= MAX_STOP_CHARS:
            _fail("stop", f"each stop must be a string of 1 to {MAX_STOP_CHARS} characters")
    return tuple(stops)


def _parse_max_tokens(
    body: Mapping[str, Any], names: Sequence[str], max_model_len: int, least: int = 1
) -> tuple[int | None, str]:
    """(max_tokens or None, the field it came from). Every name is checked; the last given
    wins (chat's `max_completion_tokens` supersedes the deprecated `max_tokens`). `least`: 0
    for a completion that echoes its prompt."""
    chosen: tuple[int | None, str] = (None, names[0])
    for name in names:
        value = _int_field(body, name, least, None)
        if value is not None:
            if value >= max_model_len:
                _fail(name, f"must be < {max_model_len}, the model's context length")
            chosen = (value, name)
    return chosen


def _parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """(stream, include_usage)."""
    stream = bool(_bool_field(body, "stream"))
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        _fail("stream_options", "only allowed when `stream` is true")
    if not isinstance(options, dict):
        _fail("stream_options", "must be an object")
    for name, value in options.items():
        if name not in _STREAM_OPTIONS:
            _fail(f"stream_options.{name}", f"unknown field `{name}`")
        if value is not None and not isinstance(value, bool):
            _fail(f"stream_options.{name}", f"must be a boolean, got {value!r}")
    return stream, bool(options.get("include_usage"))


def _parse_best_of(body: Mapping[str, Any], n: int) -> int | None:
    best_of = _int_field(body, "best_of", 1, MAX_N)
    if best_of is None:
        return None
    if best_of < n:
        _fail("best_of", f"must be at least n ({n}), got {best_of}")
    if best_of > n and body.get("stream"):
        _fail("best_of", "more candidates than n cannot be streamed: only the best are answered")
    return best_of


def _parse_chat_logprobs(body: Mapping[str, Any]) -> int | None:
    wanted = _bool_field(body, "logprobs")
    top = _int_field(body, "top_logprobs", 0, MAX_LOGPROBS)
    if top is not None and not wanted:
        _fail("top_logprobs", "requires `logprobs` to be true")
    return (top or 0) if wanted else None


def _build(
    body: Mapping[str, Any],
    model: str,
    max_model_len: int,
    *,
    chat: bool,
    max_tokens: tuple[int | None, str],
    logprobs: int | None,
    prompt_text: str | None = None,
    prompt_token_ids: list[int] | None = None,
    messages: list[dict[str, Any]] | None = None,
    tools: ToolSetup | None = None,
    echo: bool = False,
) -> GenerationRequest:
    """The fields both endpoints share; the sampling fields are checked here by building a
    SamplingParams once (with the largest max_tokens the request could get)."""
    temperature = body.get("temperature")
    is_number = is_int(temperature) or isinstance(temperature, float)
    if is_number and not 0 <= temperature <= MAX_TEMPERATURE:
        _fail("temperature", f"must be in [0, {MAX_TEMPERATURE}], got {temperature}")
    sampling_kwargs = {name: body[name] for name in _SAMPLING_FIELDS if body.get(name) is not None}
    seed = sampling_kwargs.get("seed")
    if is_int(seed) and seed < 0:  # OpenAI's seeds are int64s; the engine's, their 64 bits
        if seed < -(2**63):
            _fail("seed", f"must be in [-2**63, 2**64), got {seed}")
        sampling_kwargs["seed"] = seed + 2**64  # (two's complement: -1 is 2**64 - 1)
    logit_bias = _parse_logit_bias(body.get("logit_bias"))
    if logit_bias:
        sampling_kwargs["logit_bias"] = logit_bias
    n = _int_field(body, "n", 1, MAX_N) or 1
    best_of = _parse_best_of(body, n)
    if logprobs is not None:
        sampling_kwargs["logprobs"] = logprobs
        if echo:  # the echoed prompt's tokens come with theirs
            sampling_kwargs["prompt_logprobs"] = logprobs
    elif best_of is not None and best_of > n:  # candidates are ranked by their logprobs
        sampling_kwargs["logprobs"] = 0
    try:
        constraint = parse_constraint(body)
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None
    if tools is not None and tools.forced:
        # A `response_format` shapes an answer, which a forced call is not: the call's schema
        # holds (agents force a call with the format of their final answer set, as OpenAI
        # takes it). `structured_outputs` shapes the output itself, and cannot be both.
        if constraint is not None and not constraint.param.startswith("response_format"):
            _fail("tool_choice", "a forced tool call cannot be combined with structured_outputs")
        try:
            constraint = tools.constraint()
            # A schema the engine refuses is a 400 now, not a failed call; parsed once per
            # distinct schema (an agent forcing a call every turn brings the same one).
            check_parses(constraint)
        except InvalidRequestError as error:
            raise from_invalid_request(error) from None
    if constraint is not None:
        sampling_kwargs["constraint"] = constraint
    _sampling_params(sampling_kwargs, max_tokens[0] or max_model_len - 1)
    stream, include_usage = _parse_stream(body)
    priority = _int_field(body, "priority", -(2**31), 2**31 - 1)  # an int32, as vLLM takes it
    return GenerationRequest(
        model=model,
        chat=chat,
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        messages=None if messages is None else fallback_messages(messages, tools),
        template_messages=messages,
        max_tokens=max_tokens[0],
        max_tokens_param=max_tokens[1],
        sampling_kwargs=MappingProxyType(sampling_kwargs),
        stop=_parse_stop(body.get("stop")),
        n=n,
        stream=stream,
        include_usage=include_usage,
        logprobs=logprobs,
        user=_str_field(body, "user", MAX_USER_CHARS),
        priority=priority or 0,
        tools=tools,
        echo=echo,
        best_of=best_of,
    )


def parse_completion_request(body: Any, served_model: str, max_model_len: int) -> GenerationRequest:
    """A /v1/completions body, validated; raises ApiError (400, or 404 for another model)."""
    body = _check_fields(body, _COMPLETION_FIELDS)
    model = _check_model(body, served_model)
    prompt_text, prompt_token_ids = _parse_prompt(body.get("prompt"), max_model_len)
    echo = bool(_bool_field(body, "echo"))
    return _build(
        body,
        model,
        max_model_len,
        chat=False,
        max_tokens=_parse_max_tokens(body, ("max_tokens",), max_model_len, least=0 if echo else 1),
        logprobs=_int_field(body, "logprobs", 0, MAX_LOGPROBS),
        prompt_text=prompt_text,
        prompt_token_ids=prompt_token_ids,
        echo=echo,
    )


def parse_chat_request(body: Any, served_model: str, max_model_len: int) -> GenerationRequest:
    """A /v1/chat/completions body, validated; raises ApiError (400, or 404 for another model)."""
    body = _check_fields(body, _CHAT_FIELDS)
    model = _check_model(body, served_model)
    names = ("max_tokens", "max_completion_tokens")
    try:
        tools = parse_tools(body)
    except InvalidRequestError as error:
        raise from_invalid_request(error) from None
    messages = _parse_messages(body.get("messages"))
    return _build(
        body,
        model,
        max_model_len,
        chat=True,
        max_tokens=_parse_max_tokens(body, names, max_model_len),
        logprobs=_parse_chat_logprobs(body),
        messages=messages,
        tools=tools,
    )


def _has_more_text(value: Any, limit: int) -> bool:
    """Whether the strings in a JSON value (keys too) hold more than `limit` characters; each
    value counts at least one, so the walk takes at most `limit` steps (and no recursion: a
    body may nest deeper than the stack)."""
    pending, size = [value], 0
    while pending:
        item = pending.pop()
        if isinstance(item, str):
            size += max(1, len(item))
        elif isinstance(item, Mapping):
            size += 1
            pending.extend(item.keys())
            pending.extend(item.values())
        elif isinstance(item, list | tuple):
            size += 1
            pending.extend(item)
        else:
            size += 1
        if size > limit:
            return True
    return False
