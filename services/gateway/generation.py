"""One request through the cluster, as the gateway sees it: tokenize, submit, stream text back.

Shared by the HTTP API and the RPC front door. A request with `n` choices becomes `n` cluster
requests (seeded ones get seeds seed, seed+1, ...). Each choice's tokens are detokenized
incrementally and passed through its stop-string matcher; a stop string ends that choice and
cancels its cluster request. Leaving the `events` iterator early (a client that disconnected)
cancels every choice still running, so its queue entry, prefill job and KV blocks are freed.

A long prompt is tokenized off the event loop (`prepare_async`): the fast tokenizer releases the
GIL while it encodes, and an 8 MiB prompt takes it seconds, which every other client's stream
waited out on the loop. At most one such prompt per core is tokenized at once; the others wait
their turn, and one whose client left meanwhile is dropped unstarted. A short prompt stays on the
loop, where it costs less than the hop to a thread would.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from services.gateway.chat_prompt import chat_prompt_ids
from services.gateway.cluster import SUBMIT_ANSWER_S, ClusterClient, SubmitRefused
from services.gateway.context_probe import refuse_far_past_context
from services.gateway.detokenizer import (
    MAX_CHARACTER_TOKENS,
    IncrementalDetokenizer,
    StopStringMatcher,
    token_bytes,
    token_text,
)
from services.gateway.echo import echoed_logprobs, echoed_text
from services.gateway.grammar_check import grammar_token_ids
from services.gateway.openai_protocol import ApiError, GenerationRequest, bad_request
from services.gateway.openai_shapes import TokenLogprob
from services.gateway.tool_formats import (
    TAGGED,
    ToolFormat,
    special_marker_ids,
    template_tool_format,
)
from shared import wire
from shared.config import usable_cores
from shared.engine.constraint import Constraint
from shared.engine.sampling_params import SamplingParams
from shared.lifecycle import ChoiceTrace, GatewayEvents
from shared.wire_convert import sampling_spec

# A prompt of more characters than this is tokenized off the event loop. Measured with SmolLM2's
# tokenizer: ~0.5 us a character inline (this many: ~2 ms on the loop), ~0.2 ms a thread hop.
OFF_LOOP_PROMPT_CHARS = 4096
T = TypeVar("T")


@dataclass(frozen=True)
class Timeouts:
    """How long a request may wait at the gateway: for its first token, and in all."""

    first_token_s: float = 300.0
    request_s: float = 3600.0


@dataclass
class ChoiceEvent:
    index: int
    text: str  # new text, safe to show (no half character, no part of a stop string)
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: str | None = None  # "stop" or "length" on the choice's last event


@dataclass
class ChoiceText:
    """One choice's text pipeline: tokens -> whole characters -> text up to a stop string.

    As in vLLM, no stop string may end in the text of the first `min_tokens` tokens (what each
    shows decoded in turn; a character they begin is the next token's): nothing ends a choice
    before it has that many (the engine masks EOS and stop tokens until then). One that begins
    there and ends later does end it. A token of `stop_token_ids` that ended the choice (finish
    "stop") is not shown, as vLLM drops it (its ids and logprobs stay)."""

    detokenizer: IncrementalDetokenizer
    matcher: StopStringMatcher
    min_tokens: int = 0
    num_tokens: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    # The last tokens before the next one (the prompt's, at first): what its logprobs' texts
    # are read after (`token_text`).
    recent_token_ids: list[int] = field(default_factory=list)
    num_kept: int = 0  # of the last push's tokens, those the output keeps (see `push`)

    def push(self, token_ids: list[int], finish_reason: str | None = None) -> tuple[str, bool]:
        """(text safe to show, stopped) for the choice's next tokens; `finish_reason`: the
        engine's, when they are its last. A stop string ends the choice at the token that
        completes it: `num_kept` then counts the tokens given up to that one (the others, a
        delta's later tokens, are not its output, as vLLM stops at that token)."""
        shown = token_ids
        if finish_reason == "stop" and token_ids and token_ids[-1] in self.stop_token_ids:
            shown = token_ids[:-1]
        self.num_kept = len(token_ids)
        text = ""
        # One token at a time, as vLLM decodes: pushed together, tokens ending inside a
        # character held all their text back with it, and the next (checked) tokens showed it
        # as text a stop string could end in; and the token completing a stop string is known.
        for count, token in enumerate(shown, start=1):
            may_stop = self.num_tokens >= self.min_tokens
            self.num_tokens += 1
            piece, stopped = self.matcher.feed(self.detokenizer.push([token]), may_stop)
            text += piece
            if stopped:
                self.num_kept = count
                return text, True
        self.num_tokens += len(token_ids) - len(shown)
        return text, False

    def flush(self) -> tuple[str, bool]:
        """(the rest of the text, stopped) once generation has ended."""
        may_stop = self.num_tokens > self.min_tokens
        tail, stopped = self.matcher.feed(self.detokenizer.flush(), may_stop)
        return (tail if stopped else tail + self.matcher.flush()), stopped


@dataclass
class Generation:
    """A validated, tokenized request, ready to run."""

    request: GenerationRequest
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    created: int
    arrived_at: float  # monotonic: latencies count from here
    # How the model writes tool calls (its template's format, or the fallback's tagged one).
    tool_format: ToolFormat = TAGGED
    # Prompt tokens a prefill's cache skipped (the most of any choice), for usage.
    num_cached_tokens: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


class Generator:
    def __init__(
        self,
        cluster: ClusterClient,
        tokenizer,
        model_name: str,
        max_model_len: int,
        telemetry: GatewayEvents,
        timeouts: Timeouts | None = None,
        sampling_defaults: Mapping[str, Any] | None = None,
        tokenize_threads: int | None = None,
    ):
        """`tokenize_threads`: how many long prompts may be tokenized at once (default: one a
        core this process may run on)."""
        self.cluster = cluster
        # What a request's unset sampling fields take (shared.engine.sampling_defaults).
        self.sampling_defaults = sampling_defaults or {}
        self.telemetry = telemetry
        self.timeouts = timeouts or Timeouts()
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.vocab_size = len(tokenizer)
        # Tools go through the model's own template when it teaches a call format we parse;
        # that format's openers are kept by detokenization even where they are special tokens.
        self.template_tool_format = template_tool_format(tokenizer)
        self.tool_format = self.template_tool_format or TAGGED
        self._marker_ids = special_marker_ids(tokenizer, self.tool_format)
        # (Its threads start as work comes, and end with the process.)
        self._off_loop = ThreadPoolExecutor(
            tokenize_threads or usable_cores(), thread_name_prefix="gateway-tokenize"
        )

    async def prepare_async(self, request: GenerationRequest, id_prefix: str) -> Generation:
        """`prepare`, a long prompt tokenized off the event loop (a cancelled wait for a thread
        drops the work unstarted: a tokenization already running ends on its own)."""
        if not tokenizes_off_loop(request):
            return self.prepare(request, id_prefix)
        arrived_at = time.monotonic()  # (its wait for a thread counts in its latencies)
        return await self.off_loop(self.prepare, request, id_prefix, arrived_at)

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on one of the threads long prompts are tokenized on, once one is free."""
        return await asyncio.get_running_loop().run_in_executor(self._off_loop, work, *args)

    def prepare(
        self, request: GenerationRequest, id_prefix: str, arrived_at: float | None = None
    ) -> Generation:
        """The request validated and tokenized, on this thread (`prepare_async` on the loop)."""
        arrived_at = time.monotonic() if arrived_at is None else arrived_at
        template_tools = self.template_tool_format is not None
        refuse_far_past_context(self.tokenizer, request, self.max_model_len, template_tools)
        prompt_ids = self.tokenize(request)
        pool = self.cluster.view.max_decode_pool_tokens
        params = request.sampling_params(
            len(prompt_ids),
            self.max_model_len,
            self.sampling_defaults,
            self.tool_format.name,
            cache_room=pool - len(prompt_ids) if pool else None,
        )
        if any(not 0 <= t < self.vocab_size for t in params.stop_token_ids):
            raise bad_request("stop_token_ids", f"ids must be in [0, {self.vocab_size})")
        if any(not 0 <= t < self.vocab_size for t in params.logit_bias_ids):
            raise bad_request("logit_bias", f"token ids must be in [0, {self.vocab_size})")
        if params.constraint is not None:
            self._check_grammar_token_ids(params.constraint)
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        return Generation(
            request, prompt_ids, params, request_id, int(time.time()), arrived_at, self.tool_format
        )

    def _check_grammar_token_ids(self, constraint: Constraint) -> None:
        """A grammar's token references must be in the vocabulary: the worker's compile refused
        one past it, and the request ended as a failed generation."""
        outside = sorted(t for t in grammar_token_ids(constraint) if not 0 <= t < self.vocab_size)
        if outside:
            raise bad_request(
                constraint.param,
                f"names token id {outside[0]}; token ids must be in [0, {self.vocab_size})",
            )

    def tokenize(
        self,
        request: GenerationRequest,
        add_special_tokens: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """The prompt's ids; the two flags, vLLM's /tokenize's, change a text prompt's special
        tokens and a chat's assistant opening (a generation keeps both)."""
        if request.messages is not None:
            template_tools = self.template_tool_format is not None
            ids = chat_prompt_ids(self.tokenizer, request, template_tools, add_generation_prompt)
        elif request.prompt_token_ids is not None:
            ids = request.prompt_token_ids
            if any(not 0 <= t < self.vocab_size for t in ids):
                raise bad_request("prompt", f"token ids must be in [0, {self.vocab_size})")
        else:
            ids = self.tokenizer(
                request.prompt_text, add_special_tokens=add_special_tokens
            ).input_ids
        if not ids:
            raise bad_request(request.prompt_param, "the prompt is empty")
        return list(ids)

    async def events(
        self, generation: Generation, tenant: str, bulk: bool = False
    ) -> AsyncIterator[ChoiceEvent]:
        """The choices' events; `bulk`: the scheduler's bulk class (a batch job's line)."""
        request = generation.request
        num_choices = request.num_candidates  # (`best_of`'s candidates, or the n choices)
        # Logged here, with the tenant its API key gives (`user` names it only for a bare key:
        # logged from `user`, a keyed client's request was told as another tenant's).
        num_prompt_tokens = len(generation.prompt_token_ids)
        self.telemetry.arrived(generation.request_id, num_prompt_tokens, tenant, num_choices)
        choice_ids = [f"{generation.request_id}-{i}" for i in range(num_choices)]
        queues: list[asyncio.Queue] = []
        traces: list[ChoiceTrace] = []
        running = set(range(num_choices))
        echo_pending = set(range(num_choices)) if request.echo else set()
        parses_calls = request.tools is not None and request.tools.choice == "auto"
        kept_ids = self._marker_ids if parses_calls else frozenset()
        texts = [
            ChoiceText(
                IncrementalDetokenizer(
                    self.tokenizer,
                    keep_special_ids=kept_ids,
                    prompt_token_ids=generation.prompt_token_ids,
                ),
                StopStringMatcher(request.stop),
                generation.params.min_tokens,
                stop_token_ids=frozenset(generation.params.stop_token_ids),
                recent_token_ids=generation.prompt_token_ids[-MAX_CHARACTER_TOKENS:],
            )
            for _ in range(num_choices)
        ]
        try:
            for index, choice_id in enumerate(choice_ids):
                params = generation.params
                if params.seed is not None:  # (wrapping: a seed must stay under 2**64)
                    params = dataclasses.replace(params, seed=(params.seed + index) % 2**64)
                queues.append(await self._submit(generation, choice_id, params, tenant, bulk))
                traces.append(
                    self.telemetry.submitted(
                        choice_id, generation.arrived_at, generation.num_prompt_tokens
                    )
                )
            deltas = _merge(queues)
            while True:
                index, delta = await self._next_delta(deltas, generation, traces)
                if index not in running:
                    # A choice a stop string ended: what its workers sent before they heard
                    # the cancel is not its output (a second finish, tokens in the usage).
                    continue
                if delta.num_cached_tokens:
                    # (A resumed attempt's count takes in the output it was given: usage counts
                    # prompt tokens, and never more than the prompt has.)
                    cached = min(delta.num_cached_tokens, generation.num_prompt_tokens)
                    generation.num_cached_tokens = max(generation.num_cached_tokens, cached)
                event = self._traced_advance(traces[index], texts[index], index, delta)
                if index in echo_pending and delta.token_ids:
                    echo_pending.discard(index)
                    event = self._echoed(generation, event, delta)
                if event.finish_reason is not None:
                    running.discard(index)
                    if delta.finish_reason is None:  # a stop string ended it: workers stop too
                        await self.cluster.cancel(choice_ids[index], "stop string")
                    else:  # (`finished` first would leave `cancel` nothing to cancel)
                        self.cluster.finished(choice_ids[index])
                yield event
                if not running:
                    return
        finally:
            for index in running:
                if index < len(traces):
                    self.telemetry.finished(traces[index], "abort")
                await self.cluster.cancel(choice_ids[index], "client gone")

    async def _submit(
        self,
        generation: Generation,
        choice_id: str,
        params: SamplingParams,
        tenant: str,
        bulk: bool = False,
    ) -> asyncio.Queue:
        submit = wire.Submit(
            request_id=choice_id,
            prompt_token_ids=generation.prompt_token_ids,
            sampling=sampling_spec(params),
            tenant=tenant,
            priority=generation.request.priority,
            gateway_peer_id=self.cluster.peer_id,
            arrival_time=time.time(),
            bulk=bulk,
            first_token_deadline_s=self._first_token_deadline(generation),
        )
        # The answer waited for no longer than the request may wait for its first token: with
        # a limit under SUBMIT_ANSWER_S, a slow scheduler was a 503 past the limit, not its 504.
        answer_wait_s = min(SUBMIT_ANSWER_S, submit.first_token_deadline_s or SUBMIT_ANSWER_S)
        try:
            return await self.cluster.submit(submit, answer_wait_s)
        except SubmitRefused as refused:
            error = _refusal_error(refused)
            if not refused.answered and answer_wait_s < SUBMIT_ANSWER_S:
                limit, name = self._first_token_limit()
                message = f"no answer within {limit:g} s for a token ({name})"
                error = ApiError(504, message, "server_error")
            self.telemetry.failed(None, choice_id, error.status, error.message)
            raise error from None

    def _first_token_limit(self) -> tuple[float, str]:
        """The limit a request's first token waits under, and its setting's name."""
        return min(
            (self.timeouts.first_token_s, "first_token_timeout_s"),
            (self.timeouts.request_s, "request_timeout_s"),
        )

    def _first_token_deadline(self, generation: Generation) -> float:
        """What is left of the request's time for a first token (at least a millisecond: the
        wire takes only a positive deadline)."""
        waited = time.monotonic() - generation.arrived_at
        limit, _ = self._first_token_limit()
        return max(1e-3, limit - waited)

    async def _next_delta(
        self, deltas: AsyncIterator, generation: Generation, traces: list[ChoiceTrace]
    ) -> tuple[int, wire.TokenDelta]:
        """The next delta of any choice, within the request's time limits (else 504)."""
        waited = time.monotonic() - generation.arrived_at
        first = not any(t.first_token_at for t in traces)
        limits = [(self.timeouts.request_s, "request_timeout_s", "to finish")]
        if first:
            limits.append((self.timeouts.first_token_s, "first_token_timeout_s", "for a token"))
        limit, name, what = min(limits)
        try:
            # A timer, not a task per token (this is the token stream's hot path).
            async with asyncio.timeout(max(0.0, limit - waited)):
                return await anext(deltas)
        except TimeoutError:
            message = f"no answer within {limit:g} s {what} ({name})"
            for trace in traces:
                self.telemetry.failed(trace, trace.request_id, 504, message)
            raise ApiError(504, message, "server_error") from None

    def _traced_advance(
        self, trace: ChoiceTrace, choice: ChoiceText, index: int, delta: wire.TokenDelta
    ) -> ChoiceEvent:
        try:
            event = self._advance(choice, index, delta)
        except ApiError as error:
            self.telemetry.failed(trace, trace.request_id, error.status, error.message)
            raise
        # The tokens the client gets (`_advance` cuts a delta at a stop string's last token):
        # counted before the cut, the metrics and the finished line said more than `usage`.
        self.telemetry.tokens(trace, len(event.token_ids))
        if event.finish_reason is not None:
            self.telemetry.finished(trace, event.finish_reason)
        return event

    def _advance(self, choice: ChoiceText, index: int, delta: wire.TokenDelta) -> ChoiceEvent:
        if delta.error is not None:
            status = 504 if delta.finish_reason == "timeout" else 500
            raise ApiError(status, f"generation failed: {delta.error}", "server_error")
        logprobs = self._logprobs(delta, choice.recent_token_ids)
        recent = [*choice.recent_token_ids, *delta.token_ids]
        choice.recent_token_ids = recent[-MAX_CHARACTER_TOKENS:]
        finish = delta.finish_reason
        token_ids = list(delta.token_ids)
        text, stopped = choice.push(token_ids, finish)
        if stopped:
            finish = "stop"
            del token_ids[choice.num_kept :]
            if logprobs is not None:
                del logprobs[choice.num_kept :]
        elif finish is not None:
            tail, stopped = choice.flush()
            text += tail
            finish = "stop" if stopped else finish
        if finish == "abort":
            raise ApiError(500, "the request was aborted by the cluster", "server_error")
        return ChoiceEvent(index, text, token_ids, logprobs, finish if finish else None)

    def _logprobs(self, delta: wire.TokenDelta, context: list[int]) -> list[TokenLogprob] | None:
        """The delta's tokens with their logprobs; `context`: the tokens before its first."""
        if delta.logprobs is None:
            return None
        tops = delta.top_logprobs or [[] for _ in delta.token_ids]
        views = []
        for token, logprob, top in zip(delta.token_ids, delta.logprobs, tops, strict=True):
            alternatives = tuple(self._token_view(t, lp, (), context) for t, lp in top)
            views.append(self._token_view(token, logprob, alternatives, context))
            context = [*context[1 - MAX_CHARACTER_TOKENS :], token]
        return views

    def _token_view(
        self,
        token: int,
        logprob: float | None,
        top: tuple[TokenLogprob, ...] = (),
        context: Sequence[int] = (),
    ) -> TokenLogprob:
        """`token` as logprobs show it, after the tokens of `context` (`token_text`)."""
        text = token_text(self.tokenizer, token, context)
        token_as_bytes = token_bytes(self.tokenizer, token, context, text)
        return TokenLogprob(text, token_as_bytes, logprob, top)

    def _echoed(
        self, generation: Generation, event: ChoiceEvent, delta: wire.TokenDelta
    ) -> ChoiceEvent:
        """A choice's first event with the prompt before it (`echo`)."""
        request, prompt_ids = generation.request, generation.prompt_token_ids
        text = echoed_text(self.tokenizer, request.prompt_text, prompt_ids)
        logprobs = event.logprobs  # unasked, best_of's ranking still reads them (none shown)
        if request.logprobs is not None:
            logprobs = echoed_logprobs(prompt_ids, delta, self._token_view)
        if request.max_tokens == 0:  # the prompt alone: its token computed alongside is not shown
            return ChoiceEvent(event.index, text, [], logprobs, "length")
        if request.logprobs is not None:
            logprobs += event.logprobs or []
        return ChoiceEvent(
            event.index, text + event.text, event.token_ids, logprobs, event.finish_reason
        )


def tokenizes_off_loop(request: GenerationRequest) -> bool:
    """Whether the request's prompt is long enough to tokenize off the event loop: a text over
    `OFF_LOOP_PROMPT_CHARS` characters, or a chat whose messages (and tools) hold as many."""
    return request.holds_more_text(OFF_LOOP_PROMPT_CHARS)


def _refusal_error(refused: SubmitRefused) -> ApiError:
    kinds = {429: "rate_limit_error", 503: "service_unavailable", 400: "invalid_request_error"}
    error = ApiError(
        refused.status_code, refused.message, kinds.get(refused.status_code, "server_error")
    )
    error.retry_after_s = refused.retry_after_s
    return error


async def _merge(queues: list[asyncio.Queue]) -> AsyncIterator[tuple[int, wire.TokenDelta]]:
    """Deltas of every choice as they come, tagged with the choice's index."""
    if len(queues) == 1:
        while True:
            yield 0, await queues[0].get()
    merged: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, queue: asyncio.Queue) -> None:
        while True:
            merged.put_nowait((index, await queue.get()))

    tasks = [asyncio.create_task(pump(i, q)) for i, q in enumerate(queues)]
    try:
        while True:
            yield await merged.get()
    finally:
        for task in tasks:
            task.cancel()
