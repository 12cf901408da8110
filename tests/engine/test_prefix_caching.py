"""The engine's prefix cache on the tiny random model: only the uncached suffix is computed,
and greedy output is the same as with the cache off (the real model: test_prefix_smollm2)."""

import pytest
import torch

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.errors import InvalidRequestError
from tests.helpers import our_model_from_hf, tiny_hf_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 16


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=5, device=device))


def engine(model, cache: bool, **overrides) -> LLMEngine:
    config = dict(num_blocks=96, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=8)
    config.update(overrides)
    return LLMEngine(model, EngineConfig(enable_prefix_caching=cache, **config))


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_no_leak(eng: LLMEngine) -> None:
    """Idle: every block is free or cached, none referenced."""
    assert not eng.has_unfinished
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_invariants()


def shared_system_prompt(eng: LLMEngine) -> list:
    system = tokens(70, seed=1)
    first = eng.generate([system + tokens(9, seed=2)], GREEDY)  # warms the cache
    rest = eng.generate([system + tokens(5 + i, seed=10 + i) for i in range(6)], GREEDY)
    return first + rest


def test_shared_system_prompt_same_output_and_only_suffixes_computed(model):
    off, on = engine(model, cache=False), engine(model, cache=True)
    expected, results = shared_system_prompt(off), shared_system_prompt(on)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert results[0].num_cached_tokens == 0
    # The 4 full blocks of the 70-token system prompt are found; the rest is computed.
    assert [r.num_cached_tokens for r in results[1:]] == [64] * 6
    assert on.num_computed_prompt_tokens == off.num_computed_prompt_tokens - 6 * 64
    assert on.prefix_cache.num_hit_tokens == 6 * 64
    assert_no_leak(on)


def conversation(eng: LLMEngine, num_turns: int = 4) -> tuple[list[list[int]], list[int]]:
    history: list[int] = []
    outputs, cached = [], []
    for turn in range(num_turns):
        history = history + tokens(11 + turn, seed=100 + turn)  # the user's next message
        result = eng.generate([history], GREEDY)[0]
        outputs.append(result.token_ids)
        cached.append(result.num_cached_tokens)
        history = history + result.token_ids
    return outputs, cached


def test_conversation_reuses_prompt_and_generated_blocks(model):
    expected, _ = conversation(engine(model, cache=False))
    on = engine(model, cache=True)
    outputs, cached = conversation(on)
    assert outputs == expected
    # Turn t's prompt is the history (turn t-1's prompt and reply, whose last token never ran)
    # plus a new message: every full block of the tokens that ran before is found.
    history_lengths = [0]
    for turn in range(3):
        history_lengths.append(history_lengths[-1] + 11 + turn + 10)
    assert cached == [0] + [(n - 1) // BLOCK * BLOCK for n in history_lengths[1:]]
    assert cached[1:] == [16, 32, 64]
    assert_no_leak(on)


def test_whole_prompt_cached_still_computes_its_last_block(model):
    on = engine(model, cache=True)
    prompt = tokens(2 * BLOCK, seed=3)
    first, again = on.generate([prompt, prompt], GREEDY)  # together: both computed
    repeat = on.generate([prompt], GREEDY)[0]
    assert first.token_ids == again.token_ids == repeat.token_ids
    assert repeat.num_cached_tokens == BLOCK  # the last block holds the token whose logits count
    assert_no_leak(on)


def test_chunked_prefill_continues_after_the_cached_prefix_under_pressure(model):
    """A small budget chunks the suffix; a small pool evicts and preempts: still equal."""
    prompts = [tokens(40, seed=4) + tokens(30 + i, seed=20 + i) for i in range(8)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    config = dict(num_blocks=16, max_num_batched_tokens=24, max_num_seqs=4)
    expected = engine(model, cache=False, **config).generate(prompts, params)
    on = engine(model, cache=True, **config)
    results = on.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert on.scheduler.num_preemptions > 0 and on.prefix_cache.num_hit_tokens > 0
    assert_no_leak(on)


def test_salts_keep_prefixes_apart(model):
    on = engine(model, cache=True)
    prompt = tokens(50, seed=6)
    on.add_request(prompt, GREEDY, request_id="a", cache_salt="tenant-a")
    list(on.run_until_done())
    for rid, salt, expected in [("b", "tenant-b", 0), ("c", None, 0), ("d", "tenant-a", 48)]:
        on.add_request(prompt, GREEDY, request_id=rid, cache_salt=salt)
        seq = on._sequences[rid]
        list(on.run_until_done())
        assert seq.num_cached_tokens == expected, rid


def test_bounded_cache_and_cache_off_keep_nothing(model):
    bounded = engine(model, cache=True, prefix_cache_max_blocks=2)
    bounded.generate([tokens(90, seed=7)], GREEDY)
    assert bounded.prefix_cache.num_unreferenced == 2
    off = engine(model, cache=False)
    off.generate([tokens(90, seed=7)] * 2, GREEDY)
    assert off.prefix_cache is None and off.num_computed_prompt_tokens == 180


def test_wrong_values_refused(model):
    with pytest.raises(ValueError, match="prefix_cache_max_blocks"):
        EngineConfig(prefix_cache_max_blocks=-1)
    with pytest.raises(InvalidRequestError, match="cache_salt"):
        engine(model, cache=True).add_request([5, 6], GREEDY, cache_salt=7)


def handoff(prefill: LLMEngine, decode: LLMEngine, prompt: list[int], rid: str) -> tuple:
    """Prefill on one engine, decode on another; the decode engine pins what it has cached of
    the prompt and only the rest of the KV is carried. Returns (tokens, blocks carried)."""
    first_only = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    (result,) = prefill.generate([prompt], first_only)
    size = decode.block_manager.block_size
    cached = decode.pin_cached_prefix(prompt[: len(prompt) // size * size], None)
    keys, values = prefill.export_kv(result.request_id, first_block=len(cached))
    prefill.release(result.request_id)
    new_ids = decode.block_manager.allocate(
        decode.block_manager.num_blocks_for(len(prompt) + 1) - len(cached)
    )
    decode.kv_cache.write_blocks(new_ids[: keys.shape[1]], keys, values)
    decode.add_prefilled(rid, prompt, result.token_ids, GREEDY, cached + new_ids)
    tokens = list(result.token_ids)
    for out in decode.run_until_done():
        tokens.extend(out.new_token_ids)
    return tokens, keys.shape[1]


def test_handoff_carries_only_the_blocks_the_decode_engine_lacks(model):
    """Turn 2 of a conversation: the decode engine kept turn 1's prompt and reply blocks, so
    only the new tokens' blocks travel, and the answer equals one engine's with no cache."""
    reference = engine(model, cache=False)
    prefill = engine(model, cache=True, retain_finished=True)
    decode = engine(model, cache=True)
    prompt = tokens(45, seed=8)
    reply, carried_first = handoff(prefill, decode, prompt, "t1")
    assert reply == reference.generate([prompt], GREEDY)[0].token_ids
    assert carried_first == 3  # 45 tokens: all of them
    prompt_2 = prompt + reply + tokens(7, seed=9)  # 62 tokens; 54 ran on the decode engine
    reply_2, carried_second = handoff(prefill, decode, prompt_2, "t2")
    assert reply_2 == reference.generate([prompt_2], GREEDY)[0].token_ids
    assert carried_second == 4 - 54 // BLOCK  # blocks 3.. only: the rest was pinned
    assert_no_leak(decode)
    assert_no_leak(prefill)
