"""The worker's grammar compiles (`shared.engine.grammar`): failures of every kind end only their
own request, and the byte-bounded LRU of compiled grammars."""

import threading
import time
from concurrent.futures import Future

import pytest

from services.commands.generate import encode_prompt
from shared.engine.constraint import Constraint
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.grammar import GrammarCache, GrammarError, GrammarState
from shared.engine.model_files import resolve_model_dir
from shared.engine.sampling_params import SamplingParams

VOCAB = 49152
EOS = 2


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    directory, _ = resolve_model_dir(None)
    return AutoTokenizer.from_pretrained(directory)


def settle(cache: GrammarCache) -> None:
    """Waits for the done callbacks of the compiles that ended (a future's waiter may wake
    before its callback runs): every entry left is then counted."""
    deadline = time.monotonic() + 10
    while any(c not in cache._sizes for c in cache._entries) and time.monotonic() < deadline:
        time.sleep(0.001)


def failed_future(error: BaseException) -> Future:
    future = Future()
    future.set_exception(error)
    return future


@pytest.mark.parametrize("error", [ValueError("bad"), MemoryError()])
def test_any_error_of_a_compile_is_a_grammar_error(error):
    """Only RuntimeError and InvalidRequestError became a GrammarError: any other exception of
    the compile thread went up through the engine's step, and the worker's loop with it."""
    state = GrammarState(failed_future(error), time.monotonic() + 60)
    with pytest.raises(GrammarError, match="failed to compile"):
        state.build([])


def test_xgrammars_compile_errors_do_not_name_its_source_files(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, [EOS])
    with pytest.raises(GrammarError) as info:
        cache.get(Constraint("grammar", "root ::= Token(999999)"))
    message = str(info.value)
    assert message.startswith("the grammar failed to compile: ")
    assert ".cc:" not in message and "[" not in message.split(": ", 1)[1][:1]


def test_a_compile_that_failed_by_chance_is_not_kept(tokenizer):
    """A compile that ran out of memory (not the spec's fault) was cached as failed: every later
    request with that spec failed at once, until evicted."""
    cache = GrammarCache(tokenizer, VOCAB, [EOS])
    compile_now, calls = cache._compile, []

    def flaky(constraint):
        calls.append(constraint)
        if len(calls) == 1:
            raise MemoryError()
        return compile_now(constraint)

    cache._compile = flaky
    constraint = Constraint("regex", "x0+")
    with pytest.raises(GrammarError, match="failed to compile"):
        cache.get(constraint)
    settle(cache)
    assert cache.get(constraint) is not None and len(calls) == 2
    settle(cache)
    assert cache.num_bytes == cache._sizes[constraint]
    invalid = Constraint("regex", "((")  # the spec's own fault: kept, not compiled again
    for _ in range(2):
        with pytest.raises(GrammarError, match="invalid regex"):
            cache.get(invalid)
    assert len(calls) == 3


def test_a_grammar_bigger_than_the_bound_does_not_empty_the_cache(tokenizer):
    """A compiled grammar larger than the whole bound evicted every other entry (least recently
    used first, until the bytes fit) before itself: one such request flushed the cache."""
    cache = GrammarCache(tokenizer, VOCAB, [EOS], max_bytes=20_000)
    small = [Constraint("regex", "x0+"), Constraint("regex", "(ab|cd)*e")]
    kept = [cache.get(c) for c in small]
    settle(cache)
    bytes_before = cache.num_bytes
    big = cache.get(Constraint("regex", "[a-z]{3}"))  # about 140 kB compiled
    settle(cache)
    assert big.memory_size_bytes > cache.max_bytes
    assert cache.num_bytes == bytes_before and len(cache) == 2
    hits = cache.num_hits
    assert [cache.get(c) for c in small] == kept and cache.num_hits == hits + 2


@pytest.mark.slow
def test_a_compile_raising_anything_fails_only_its_request(smollm2):
    """The compile thread raising something other than RuntimeError (here a ValueError from
    xgrammar's FFI, or a MemoryError) raised out of the engine's step: the worker's loop died
    with every request on it. Now that request ends with the error and frees its blocks."""
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=64), tokenizer=smollm2.tokenizer)
    cache = engine.grammar.cache
    broken = Constraint("regex", "[0-9]")
    compile_now = cache._compile

    def compile_or_fail(constraint):
        if constraint == broken:
            raise ValueError("cannot compile this")
        return compile_now(constraint)

    cache._compile = compile_or_fail
    prompt = encode_prompt(smollm2.tokenizer, "A digit?", chat=True)
    free_blocks = engine.block_manager.num_free_blocks
    params = [
        SamplingParams(max_tokens=4, temperature=0, constraint=broken),
        SamplingParams(max_tokens=4, temperature=0),
        SamplingParams(max_tokens=4, temperature=0, constraint=Constraint("regex", "[a-c]")),
    ]
    ids = [engine.add_request(prompt, p) for p in params]
    ends = {}
    for out in engine.run_until_done():
        if out.finished:
            ends[out.request_id] = (out.finish_reason, out.error)
    assert ends[ids[0]] == ("abort", "the grammar failed to compile: cannot compile this")
    assert ends[ids[1]] == ("length", None) and ends[ids[2]][0] == "stop"
    assert engine.block_manager.num_free_blocks == free_blocks


def test_one_spec_asked_twice_while_it_compiles_compiles_once(tokenizer):
    cache = GrammarCache(tokenizer, VOCAB, [EOS])
    compile_now, gate, calls = cache._compile, threading.Event(), []
    cache._compile = lambda c: calls.append(c) or (gate.wait() and compile_now(c))
    constraint = Constraint("regex", "x0+")
    first, second = cache.submit(constraint), cache.submit(constraint)
    assert first is second and not first.done()
    gate.set()
    assert first.result(timeout=10) is not None and len(calls) == 1


def test_a_compile_every_asker_gave_up_on_is_skipped(tokenizer):
    """Compiles waited in the pool's queue however long: under a burst of distinct specs the
    pool compiled grammars whose requests had timed out, while fresh ones timed out behind."""
    cache = GrammarCache(tokenizer, VOCAB, [EOS], num_threads=1)
    assert cache.compiler_error() is None
    compile_now, gate, calls = cache._compile, threading.Event(), []

    def compile_when_let(constraint):
        calls.append(constraint)
        gate.wait()
        return compile_now(constraint)

    cache._compile = compile_when_let
    try:
        busy = cache.submit(Constraint("regex", "busy+"))  # holds the only thread
        now = time.monotonic()
        given_up = Constraint("regex", "x0+")
        stale = cache.submit(given_up, now + 0.05)
        kept_alive = Constraint("regex", "y0+")
        cache.submit(kept_alive, now + 0.05)
        later_asker = cache.submit(kept_alive, now + 60)  # a second request still waits for it
        time.sleep(0.1)
    finally:
        gate.set()  # (else a failure here left the thread, and pytest's exit, waiting)
    assert busy.result(timeout=10) is not None and later_asker.result(timeout=10) is not None
    with pytest.raises(GrammarError, match="gave up"):
        stale.result(timeout=10)
    assert given_up not in calls and kept_alive in calls and cache.num_skipped == 1
    settle(cache)
    assert cache.get(given_up) is not None  # the next request compiles it afresh
    assert calls.count(given_up) == 1


def test_closing_with_compiles_queued_logs_no_callback_errors(tokenizer, caplog):
    cache = GrammarCache(tokenizer, VOCAB, [EOS], num_threads=1)
    assert cache.compiler_error() is None  # (built on the pool's one thread)
    started, gate, compile_now = threading.Event(), threading.Event(), cache._compile

    def compile_when_let(constraint):
        started.set()
        gate.wait()
        return compile_now(constraint)

    cache._compile = compile_when_let
    try:
        running = cache.submit(Constraint("regex", "a+"))
        queued = cache.submit(Constraint("regex", "b+"))
        assert started.wait(timeout=10)
        cache.close()
    finally:
        gate.set()
    running.result(timeout=10)
    assert queued.cancelled()
    assert not [r for r in caplog.records if "exception calling callback" in r.getMessage()]
