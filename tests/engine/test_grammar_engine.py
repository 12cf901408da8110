"""Constrained requests in the engine on the real model: mixed with free rows in one batch, cut
by max_tokens, resumed from generated tokens (replay), and handed off like a KV transfer."""

import dataclasses
import json
import threading
import time
from types import SimpleNamespace

import jsonschema
import pytest

from services.commands.generate import encode_prompt
from shared.engine import grammar
from shared.engine.constraint import Constraint, choice_constraint, schema_constraint
from shared.engine.engine import COMPILE_POLL_S, EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(smollm2):
    return LLMEngine(smollm2.model, EngineConfig(num_blocks=256), tokenizer=smollm2.tokenizer)


@pytest.fixture(scope="module")
def prompt(smollm2):
    return encode_prompt(smollm2.tokenizer, "Describe a person as JSON.", chat=True)


def text(smollm2, token_ids):
    return smollm2.tokenizer.decode(token_ids, skip_special_tokens=True)


def test_constrained_and_free_rows_in_one_batch(engine, smollm2, prompt):
    free = SamplingParams(max_tokens=8, temperature=0)
    constrained = [
        SamplingParams(max_tokens=60, temperature=0, constraint=schema_constraint(SCHEMA, "s")),
        SamplingParams(
            max_tokens=20, temperature=0.9, seed=3, constraint=Constraint("regex", "[a-z]{3}-\\d")
        ),
        SamplingParams(
            max_tokens=5, temperature=0, constraint=choice_constraint(["up", "down"], "c")
        ),
    ]
    results = engine.generate([prompt] * 4, [free, *constrained])
    alone = LLMEngine(smollm2.model, EngineConfig(num_blocks=64)).generate([prompt], free)[0]
    assert results[0].token_ids == alone.token_ids  # the free row is untouched by the masks
    assert all(r.finish_reason == "stop" for r in results[1:])
    jsonschema.validate(json.loads(text(smollm2, results[1].token_ids)), SCHEMA)
    assert len(text(smollm2, results[2].token_ids)) == 5
    assert text(smollm2, results[3].token_ids) in ("up", "down")


def test_cut_mid_structure_finishes_with_length(engine, smollm2, prompt):
    params = SamplingParams(max_tokens=4, temperature=0, constraint=schema_constraint(SCHEMA, "s"))
    (result,) = engine.generate([prompt], params)
    assert result.finish_reason == "length"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text(smollm2, result.token_ids))


def test_resumed_request_replays_its_generated_tokens(engine, smollm2, prompt):
    params = SamplingParams(max_tokens=60, temperature=0, constraint=schema_constraint(SCHEMA, "s"))
    (whole,) = engine.generate([prompt], params)
    done = whole.token_ids[:5]  # what a client had when its worker died
    request_id = engine.add_request(prompt + done, params, num_generated=len(done))
    rest = [t for out in engine.run_until_done() for t in out.new_token_ids]
    assert request_id and done + rest == whole.token_ids  # greedy: the same object
    jsonschema.validate(json.loads(text(smollm2, done + rest)), SCHEMA)


def test_a_complete_structure_ends_the_choice_despite_min_tokens_or_ignore_eos(engine, smollm2):
    # The grammar allows only EOS once "up" or "down" is out. min_tokens must not mask it (that
    # left no token to draw), nor ignore_eos carry on past it (the matcher has terminated).
    prompt = encode_prompt(smollm2.tokenizer, "Up or down?", chat=True)
    choice = choice_constraint(["up", "down"], "c")
    for fields in ({"min_tokens": 6}, {"ignore_eos": True}, {"min_tokens": 6, "ignore_eos": True}):
        for temperature in (0.0, 0.8):
            params = SamplingParams(
                max_tokens=10, temperature=temperature, seed=1, constraint=choice, **fields
            )
            (result,) = engine.generate([prompt], params)
            assert result.finish_reason == "stop", fields
            assert text(smollm2, result.token_ids) in ("up", "down"), fields


def test_a_grammar_with_no_way_on_ends_its_request_with_the_reason(engine, prompt):
    """Where the grammar allows no token at all, every logit was -inf and the draw fell on token
    0, again and again until max_tokens, the request called complete ("length"); the row beside
    it is untouched."""
    dead_end = Constraint("grammar", 'root ::= "a" x\nx ::= x "b"')  # "a", then nothing can
    stuck = SamplingParams(max_tokens=30, temperature=0, constraint=dead_end)
    free = SamplingParams(max_tokens=5, temperature=0)
    ended, beside = engine.generate([prompt, prompt], [stuck, free])
    assert ended.finish_reason == "abort" and "allows no next token" in ended.error
    assert len(ended.token_ids) == 1  # the "a"
    assert beside.finish_reason == "length" and len(beside.token_ids) == 5


def test_cut_where_the_structure_is_complete_says_stop(engine, prompt):
    """max_tokens running out on the last token of a choice (or a JSON object's closing brace)
    left a whole answer labelled "length"; one the grammar could still extend stays "length"."""
    choice = choice_constraint(["up", "down"], "c")
    (free,) = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, constraint=choice)
    )
    spelled = [t for t in free.token_ids if t not in engine.eos_token_ids]
    assert free.finish_reason == "stop" and len(spelled) < len(free.token_ids)  # EOS drawn last
    (cut,) = engine.generate(
        [prompt], SamplingParams(max_tokens=len(spelled), temperature=0, constraint=choice)
    )
    assert cut.token_ids == spelled and cut.finish_reason == "stop"
    digits = Constraint("regex", "[0-9]+")  # complete after one digit, yet it may go on
    (open_ended,) = engine.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0, constraint=digits)
    )
    assert open_ended.finish_reason == "length"


@pytest.fixture
def gated_engine(smollm2):
    """An engine whose grammar compiles wait for `engine.gate` (a slow compile, simulated)."""

    def make(compile_timeout_s: float) -> LLMEngine:
        config = EngineConfig(num_blocks=128, grammar_compile_timeout_s=compile_timeout_s)
        engine = LLMEngine(smollm2.model, config, tokenizer=smollm2.tokenizer)
        cache, gate = engine.grammar.cache, threading.Event()
        compile_now = cache._compile
        cache._compile = lambda constraint: gate.wait() and compile_now(constraint)
        engine.gate = gate
        made.append(engine)
        return engine

    made: list[LLMEngine] = []
    yield make
    for engine in made:
        engine.gate.set()  # (the compile threads end)


def step_outputs(engine):
    """One step: its new tokens and finish reasons (with errors) by request."""
    outputs = engine.step()
    tokens = {out.request_id: out.new_token_ids for out in outputs}
    ends = {out.request_id: (out.finish_reason, out.error) for out in outputs if out.finished}
    return tokens, ends


def test_a_compiling_grammar_holds_its_own_request_and_not_the_batch(engine, gated_engine, prompt):
    """The step that samples a constrained request's first token waited there for its compile
    (up to the 30 s limit), and so did every other request of the batch: a free request's
    steps went from under a second to 8 s when a 5 s compile arrived. Now the request runs its
    prompt but the last token, and waits; the others step on; then it ends as it would have."""
    constrained = SamplingParams(
        max_tokens=60, temperature=0, constraint=schema_constraint(SCHEMA, "s")
    )
    (expected,) = engine.generate([prompt], constrained)
    gated = gated_engine(compile_timeout_s=60.0)
    held = gated.add_request(prompt, constrained)
    free = gated.add_request(prompt, SamplingParams(max_tokens=6, temperature=0))
    free_tokens = []
    for _ in range(6):
        started = time.monotonic()
        tokens, ends = step_outputs(gated)
        assert time.monotonic() - started < 10.0  # (a step waiting on the compile: 60 s)
        assert held not in tokens and held not in ends
        free_tokens += tokens[free]
    assert len(free_tokens) == 6 and ends == {free: ("length", None)}
    waiting = gated.sequence(held)
    assert waiting.num_computed_tokens == len(prompt) - 1 and waiting.block_ids  # prefilled
    assert [gated.step() for _ in range(3)] == [[], [], []]  # nothing to run: it waits
    assert gated.last_step_idle
    gated.gate.set()
    outputs = list(gated.run_until_done())
    assert [t for out in outputs for t in out.new_token_ids] == expected.token_ids  # greedy
    assert outputs[-1].finish_reason == "stop"


def test_a_compile_past_its_deadline_still_ends_its_request_with_the_error(
    gated_engine, prompt, monkeypatch
):
    """The deadline fails the request as before, with the limit in its error; the free request
    beside it is done long before, and the steps with nothing else to run wait on the compile
    a little each instead of spinning. (The deadline's clock is the test's.)"""
    now = [0.0]
    monkeypatch.setattr(grammar, "time", SimpleNamespace(monotonic=lambda: now[0]))
    gated = gated_engine(compile_timeout_s=2.0)
    constrained = SamplingParams(max_tokens=8, constraint=schema_constraint(SCHEMA, "s"))
    held = gated.add_request(prompt, constrained)
    free = gated.add_request(prompt, SamplingParams(max_tokens=3, temperature=0))
    ends = {}
    while free not in ends:
        ends.update(step_outputs(gated)[1])
    assert ends == {free: ("length", None)}
    started = time.monotonic()
    for _ in range(5):
        assert step_outputs(gated) == ({}, {}) and gated.last_step_idle
    assert time.monotonic() - started >= 5 * COMPILE_POLL_S * 0.9  # waited, did not spin
    now[0] = 2.0  # the deadline
    outputs = list(gated.run_until_done())
    assert [(out.request_id, out.finish_reason) for out in outputs] == [(held, "abort")]
    assert outputs[0].error.startswith("the grammar did not compile within 2 s")


def test_a_prefilled_request_waits_for_its_compile_beside_running_ones(
    engine, smollm2, gated_engine, prompt
):
    """A decode worker's request arrives with its prompt's KV and first token; its matcher
    replays that token once its grammar compiles, and until then its decode step waits while
    the other requests' steps go on."""
    constrained = SamplingParams(
        max_tokens=30, temperature=0, constraint=schema_constraint(SCHEMA, "s")
    )
    (expected,) = engine.generate([prompt], constrained)
    prefill = LLMEngine(
        smollm2.model,
        EngineConfig(num_blocks=64, retain_finished=True),
        tokenizer=smollm2.tokenizer,
    )
    (first,) = prefill.generate([prompt], dataclasses.replace(constrained, max_tokens=1))
    keys, values = prefill.export_kv(first.request_id)
    decode = gated_engine(compile_timeout_s=60.0)
    free = decode.add_request(prompt, SamplingParams(max_tokens=4, temperature=0))
    block_ids = decode.block_manager.allocate(keys.shape[1])
    decode.kv_cache.write_blocks(block_ids, keys, values)
    decode.add_prefilled("held", prompt, first.token_ids, constrained, block_ids)
    for _ in range(4):
        tokens, _ = step_outputs(decode)
        assert list(tokens) == [free]
    assert decode.sequence("held").block_ids == block_ids  # it keeps its KV while it waits
    decode.gate.set()
    rest = [t for out in decode.run_until_done() for t in out.new_token_ids]
    assert first.token_ids + rest == expected.token_ids
