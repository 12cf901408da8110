"""Grammar-constrained sampling with xgrammar: compiled grammars, per-sequence matchers, masks.

Three pieces, each small:

- `GrammarCache` compiles a `Constraint` against the tokenizer once per distinct constraint, on
  a background thread, so that a request's compile overlaps its prefill and the batch never
  waits on it: until the compile ends (or its deadline passes) the step scheduler holds back
  the chunk that would bring the sequence to its next token (`GrammarState.ready`), and the
  rest of the batch steps on. Entries are kept least recently used first and bounded by their
  compiled size in bytes (an unbounded cache is a memory-exhaustion hole); the spec itself is
  capped in `shared.engine.constraint`. A grammar larger than the whole bound is used by its
  requests but not kept, and so is a failure that was not the spec's own (a MemoryError): a
  later request compiles again. A compile that does not finish within the time limit fails its
  request (xgrammar cannot be interrupted: the thread runs on, but nothing waits for it), and
  so does one that raises, whatever it raises: that request alone ends, with the error. A
  compile still queued when every request that asked for it has given up is skipped.
- `GrammarState` is one sequence's matcher. It is built lazily, when its grammar is compiled,
  by replaying the tokens the sequence already generated: those of a prefill job resumed from a
  client's tokens, those carried by a KV handoff, those kept across preemption. The matcher is
  thus rebuilt from tokens wherever the sequence lands and its state never travels.
- `MaskBuffer` fills the token bitmasks of every constrained row of a batch in one call
  (xgrammar's batch matcher), for the rows whose matcher is built on a thread while the forward
  pass runs, and applies them to the logits in place; rows without a constraint are not
  touched, and a batch without any constrained row costs one list scan.

Termination: EOS is allowed only where the grammar accepts the output as complete (the
matcher's stop tokens are the model's EOS ids). A sequence cut by max_tokens mid-structure
finishes with "length", as the engine reports it.
"""

from __future__ import annotations

import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as futures_wait
from typing import Any

import torch
import xgrammar as xgr

from shared.engine.constraint import Constraint, to_grammar
from shared.errors import InvalidRequestError

DEFAULT_CACHE_BYTES = 256 << 20
DEFAULT_COMPILE_TIMEOUT_S = 30.0
_FAILED_ENTRY_BYTES = 1024  # a cached failure's charge against the byte bound
# xgrammar's C++ checks prefix their message with a time and a source line (`[02:08:04]
# /project/cpp/grammar_compiler.cc:1086: Check failed: ...`): not the client's business.
_XGRAMMAR_ORIGIN = re.compile(r"^\[[\d:]+\]\s*\S+\.(?:cc|h):\d+:\s*")


class GrammarError(Exception):
    """A constraint that could not be compiled (invalid, or past the time limit)."""


class GrammarCache:
    """Compiled grammars by constraint, LRU, bounded by bytes; compiles run on a thread pool."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        max_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
        num_threads: int = 2,
    ):
        if max_bytes <= 0 or compile_timeout_s <= 0:
            raise ValueError("max_bytes and compile_timeout_s must be > 0")
        self.vocab_size = vocab_size
        self.max_bytes = max_bytes
        self.compile_timeout_s = compile_timeout_s
        self._pool = ThreadPoolExecutor(num_threads, thread_name_prefix="grammar-compile")
        # xgrammar's tokenizer tables take 0.2-0.3 s to build for a 49k vocabulary: built on
        # the pool, so that the first constrained request does not stall the engine's loop
        # (and every sequence on it) for as long; its compile waits for them instead.
        self._compiler = self._pool.submit(
            _make_compiler, tokenizer, vocab_size, sorted(eos_token_ids)
        )
        self._lock = threading.Lock()
        self._entries: OrderedDict[Constraint, Future] = OrderedDict()
        self._sizes: dict[Constraint, int] = {}  # completed entries only
        self.num_bytes = 0
        self.num_hits = 0
        self.num_compiles = 0
        self.num_skipped = 0  # compiles whose askers had all given up before they began
        self._awaited_until: dict[Constraint, float] = {}  # compiles not begun: last deadline

    def compiler_error(self) -> BaseException | None:
        """Waits for xgrammar's compiler (its tokenizer tables); what building it raised."""
        return self._compiler.exception()

    def submit(self, constraint: Constraint, deadline: float | None = None) -> Future:
        """The compiled grammar's future: cached, or a compile started now. `deadline`
        (time.monotonic(), by default the time limit from now) is when its asker stops waiting:
        a compile that waited in the pool's queue past every asker's is skipped."""
        if deadline is None:
            deadline = time.monotonic() + self.compile_timeout_s
        with self._lock:
            future = self._entries.get(constraint)
            if future is not None:
                self._entries.move_to_end(constraint)
                self.num_hits += 1
                if constraint in self._awaited_until:  # not started yet
                    self._awaited_until[constraint] = max(self._awaited_until[constraint], deadline)
                return future
            self.num_compiles += 1
            self._awaited_until[constraint] = deadline
            future = self._pool.submit(self._compile_if_awaited, constraint)
            self._entries[constraint] = future
        future.add_done_callback(lambda f: self._on_done(constraint, f))
        return future

    def get(self, constraint: Constraint, timeout_s: float | None = None) -> Any:
        """The compiled grammar, waiting for its compile up to the time limit."""
        timeout_s = timeout_s or self.compile_timeout_s
        future = self.submit(constraint, time.monotonic() + timeout_s)
        return wait_compiled(future, timeout_s)

    def _compile_if_awaited(self, constraint: Constraint) -> Any:
        """Compiles, unless every request that asked has given up waiting: under a burst of
        distinct specs the pool's queue outgrew the time limit, and it went on compiling
        grammars nobody waited for while the fresh ones timed out behind them. A skipped
        entry leaves the cache at once (no later request finds it failed); the next to ask
        compiles afresh."""
        with self._lock:
            awaited_until = self._awaited_until.pop(constraint)
            if time.monotonic() >= awaited_until:
                del self._entries[constraint]
                self.num_skipped += 1
                raise GrammarError("every request waiting for this grammar gave up first")
        return self._compile(constraint)

    def _compile(self, constraint: Constraint) -> Any:
        grammar = to_grammar(constraint)
        return self._compiler.result().compile_grammar(grammar)

    def _on_done(self, constraint: Constraint, future: Future) -> None:
        if future.cancelled():  # by `close` (asking for its exception would raise)
            return
        error = future.exception()
        size = _FAILED_ENTRY_BYTES if error else future.result().memory_size_bytes
        with self._lock:
            if self._entries.get(constraint) is not future:
                return  # evicted meanwhile
            if size > self.max_bytes or (error is not None and not _is_the_specs_fault(error)):
                # Not kept (its requests hold the future): a grammar larger than the whole bound
                # would evict every other entry, then itself; a failure that was not the spec's
                # own (out of memory) would fail every later request with that spec.
                del self._entries[constraint]
                return
            self._sizes[constraint] = size
            self.num_bytes += size
            self._evict()

    def _evict(self) -> None:
        """Least recently used completed entries go until the bytes fit (pending ones stay:
        a request waits on them). Called with the lock held."""
        for constraint in list(self._entries):
            if self.num_bytes <= self.max_bytes:
                return
            if constraint in self._sizes:
                del self._entries[constraint]
                self.num_bytes -= self._sizes.pop(constraint)

    def __len__(self) -> int:
        return len(self._entries)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _make_compiler(tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> Any:
    info = xgr.TokenizerInfo.from_huggingface(
        tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
    )
    return xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)


def wait_compiled(future: Future, timeout_s: float, limit_s: float | None = None) -> Any:
    """The compiled grammar, waiting up to `timeout_s`; past it, the error names `limit_s`
    (the whole time limit, of which `timeout_s` may be what is left), by default `timeout_s`."""
    try:
        return future.result(timeout=max(timeout_s, 0.0))
    except FutureTimeout:
        limit_s = timeout_s if limit_s is None else limit_s
        raise GrammarError(
            f"the grammar did not compile within {limit_s:.3g} s (the compile time limit); a"
            " compile under way goes on, and the same spec sent again once it is done is served"
            " from the worker's cache"
        ) from None
    except InvalidRequestError as error:
        raise GrammarError(error.message) from None
    except Exception as error:  # whatever the compile thread raised ends only this request
        message = _XGRAMMAR_ORIGIN.sub("", str(error).strip()) or type(error).__name__
        raise GrammarError(f"the grammar failed to compile: {message}") from None


def _is_the_specs_fault(error: BaseException) -> bool:
    """A compile failure the same spec would meet again: refused by the parse, or by
    xgrammar's compiler (its errors are RuntimeErrors); not, say, a MemoryError."""
    return isinstance(error, InvalidRequestError | RuntimeError)


class GrammarState:
    """One sequence's matcher, built from its compiled grammar by replaying its generated
    tokens; `accept` advances it with each new token."""

    def __init__(
        self,
        future: Future,
        deadline: float,
        replay_token_ids: Sequence[int] = (),
        limit_s: float | None = None,
    ):
        self._future = future
        self._deadline = deadline  # time.monotonic() past which the compile has failed
        self._limit_s = limit_s  # the compile time limit the deadline stands for (its error's)
        self._replay_token_ids = list(replay_token_ids)  # generated before this engine's output
        self.matcher: Any = None

    @property
    def ready(self) -> bool:
        """Whether `build` answers at once: the compile has ended (compiled or failed), or its
        deadline has passed (build then fails). Until then the sequence is not sampled: the
        scheduler holds back the chunk that would bring it to its next token, so nothing in a
        step waits on a compile."""
        return self._future.done() or time.monotonic() >= self._deadline

    @property
    def pending(self) -> Future | None:
        """The compile this state still waits on, None once `ready`."""
        return None if self.ready else self._future

    @property
    def seconds_left(self) -> float:
        """Until the compile's deadline."""
        return self._deadline - time.monotonic()

    def build(self, output_token_ids: Sequence[int]) -> Any:
        """The matcher, built on first use from the tokens generated so far (waiting for the
        compile up to the deadline: the engine asks only once `ready`, and then nothing is
        waited for). Raises GrammarError if it cannot be."""
        if self.matcher is None:
            compiled = wait_compiled(self._future, self.seconds_left, self._limit_s)
            matcher = xgr.GrammarMatcher(compiled)
            for i, token in enumerate(self._replay_token_ids + list(output_token_ids)):
                if not matcher.accept_token(token):
                    raise GrammarError(f"generated token {i} ({token}) breaks the grammar")
            self.matcher = matcher
        return self.matcher

    def accept(self, token_id: int) -> bool:
        """Advances the matcher by a sampled token; False if the grammar refuses it, which a
        masked draw yields only where the grammar allowed no token at all (a dead end: every
        logit was -inf, and the draw fell on token 0)."""
        if self.matcher is None or self.matcher.is_terminated():
            return True
        return bool(self.matcher.accept_token(token_id))

    @property
    def is_terminated(self) -> bool:
        return self.matcher is not None and self.matcher.is_terminated()

    def only_end_allowed(self) -> bool:
        """The output so far is complete and nothing could extend it: the grammar allows only a
        stop token next (a JSON object closed, a choice spelled out). One mask fill: asked once,
        where a sequence reaches max_tokens."""
        matcher = self.matcher
        if matcher is None or matcher.is_terminated() or not matcher.is_completed():
            return False
        vocab_size = self._future.result().tokenizer_info.vocab_size
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        matcher.fill_next_token_bitmask(bitmask)
        allowed = torch.zeros(1, vocab_size)
        xgr.apply_token_bitmask_inplace(allowed, bitmask)
        allowed_ids = torch.isfinite(allowed[0]).nonzero().flatten().tolist()
        return set(allowed_ids) <= set(matcher.stop_token_ids)


class MaskBuffer:
    """A reused token bitmask, grown to the largest batch seen, and the masks filled ahead.

    `fill_ahead` starts filling the masks of the matchers a step will sample (those built
    already) on a thread of its own, before the forward pass: xgrammar's fill releases the GIL,
    so it runs on another core while the model runs (issue 16: mask filling competes with the
    model on a CPU). `apply` then takes those rows and fills only the rest (a matcher built
    after the forward, at a prompt's first token). No matcher may change between the two: the
    engine accepts tokens only after sampling, and `settle` waits for a fill nobody used."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._ahead_bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self._ahead_batch = xgr.BatchGrammarMatcher(max_threads=1)
        self._ahead_thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._ahead: tuple[dict[int, int], Future] | None = None  # matcher id -> row, the fill

    def fill_ahead(self, matchers: Sequence[Any]) -> None:
        """Starts filling the masks of `matchers` (built, about to be sampled) on the mask
        thread; `apply` uses them."""
        self.settle()
        if not matchers:
            return
        if self._ahead_bitmask.shape[0] < len(matchers):
            self._ahead_bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._ahead_bitmask[: len(matchers)]
        future = self._ahead_thread.submit(
            self._ahead_batch.batch_fill_next_token_bitmask, list(matchers), bitmask
        )
        self._ahead = ({id(matcher): row for row, matcher in enumerate(matchers)}, future)

    def settle(self) -> dict[int, int]:
        """Waits for the fill ahead, if any, and hands over its rows (matcher id -> row of the
        ahead bitmask); none are kept for later."""
        ahead, self._ahead = self._ahead, None
        if ahead is None:
            return {}
        rows, future = ahead
        future.result()
        return rows

    def apply(self, logits: torch.Tensor, matchers: Sequence[Any | None]) -> None:
        """Masks in place the rows of `logits` [rows, vocab] whose matcher is given: tokens the
        grammar forbids go to -inf. The rows filled ahead are copied, the others filled in one
        call."""
        ahead_rows = self.settle()
        rows = [i for i, matcher in enumerate(matchers) if matcher is not None]
        if not rows:
            return
        if self._bitmask.shape[0] < len(matchers):
            self._bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        bitmask = self._bitmask[: len(matchers)]
        late = []
        for i in rows:
            ahead = ahead_rows.get(id(matchers[i]))
            if ahead is None:
                late.append(i)
            else:
                bitmask[i] = self._ahead_bitmask[ahead]
        if late:
            self._batch.batch_fill_next_token_bitmask(
                [matchers[i] for i in late], bitmask, indices=late
            )
        xgr.apply_token_bitmask_inplace(
            logits, bitmask.to(logits.device), indices=rows, vocab_size=logits.shape[-1]
        )


class GrammarBinding:
    """The engine's side: gives each constrained sequence its `GrammarState` and builds its
    matcher before it samples. The cache (and xgrammar's tokenizer tables) is made at the
    first constrained request, so engines that never see one pay nothing, or by `warm`, which
    workers call before they register."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int] | frozenset[int],
        max_bytes: int = DEFAULT_CACHE_BYTES,
        compile_timeout_s: float = DEFAULT_COMPILE_TIMEOUT_S,
    ):
        self._tokenizer = tokenizer
        self._args = (vocab_size, sorted(eos_token_ids), max_bytes, compile_timeout_s)
        self._cache: GrammarCache | None = None

    @property
    def cache(self) -> GrammarCache:
        if self._cache is None:
            if self._tokenizer is None:
                raise InvalidRequestError(
                    "structured_outputs", "this engine was started without a tokenizer"
                )
            self._cache = GrammarCache(self._tokenizer, *self._args)
        return self._cache

    def warm(self) -> str | None:
        """Builds the cache and xgrammar's tokenizer tables now, waiting for them: what a worker
        does before it registers (0.2-0.4 s and some 2 MiB for a 49k vocabulary), so that no
        request waits on them. The error if they could not be built (constrained requests then
        fail with it, the others are served); None without a tokenizer, or once built."""
        if self._tokenizer is None:
            return None
        error = self.cache.compiler_error()
        return None if error is None else f"{type(error).__name__}: {error}"

    def attach(self, seq: Any, replay_token_ids: Sequence[int] = ()) -> None:
        """Starts (or finds) the compile of `seq`'s constraint; its matcher will replay
        `replay_token_ids` then its output tokens."""
        constraint = seq.params.constraint
        if constraint is None:
            return
        cache = self.cache
        limit_s = cache.compile_timeout_s
        deadline = time.monotonic() + limit_s
        future = cache.submit(constraint, deadline)
        seq.grammar = GrammarState(future, deadline, replay_token_ids, limit_s)

    @staticmethod
    def wait_for_compiles(sequences: Iterable[Any], max_wait_s: float) -> bool:
        """Waits until one of `sequences`' pending compiles ends, at most `max_wait_s` and never
        past the earliest deadline: what a step with nothing to run does instead of returning
        at once, which spun the worker's loop for as long as the compile took. False if none
        was pending (nothing waited for)."""
        states = [seq.grammar for seq in sequences if seq.grammar is not None]
        pending = [(state, state.pending) for state in states]
        pending = [(state, future) for state, future in pending if future is not None]
        if not pending:
            return False
        timeout_s = min(max_wait_s, *(state.seconds_left for state, _ in pending))
        futures = [future for _, future in pending]
        futures_wait(futures, timeout=max(timeout_s, 0.0), return_when=FIRST_COMPLETED)
        return True

    def prepare(self, seq: Any) -> str | None:
        """Builds `seq`'s matcher if it has none yet; the error if that failed. Asked where
        `seq` samples, which the scheduler lets happen only once its grammar is `ready`."""
        if seq.grammar is None:
            return None
        try:
            seq.grammar.build(seq.output_token_ids)
        except GrammarError as error:
            return str(error)
        return None
