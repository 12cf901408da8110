"""The real SmolLM2 in float32: greedy output with the prefix cache on equals the cache off, for a
multi-turn chat and for prompts sharing a system prompt, while far fewer prompt tokens run; and
with a pool too small for the traffic, whose evicted blocks come back from the host tier."""

import pytest

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(max_tokens=12, temperature=0.0)
SYSTEM = (
    "You are a careful assistant for a hardware store. Answer in one or two short sentences, "
    "name the aisle when you can, and never invent prices. Aisles: 1 paint and brushes, "
    "2 screws, nails and anchors, 3 power tools, 4 garden hoses and seeds, 5 lighting."
)
QUESTIONS = [
    "Where are the wood screws?",
    "Do you sell LED bulbs?",
    "Which aisle has tomato seeds?",
]
TURNS = ["Where do I find paint rollers?", "And a ladder to reach the ceiling?", "Thanks!"]


def chat(tokenizer, messages: list[dict]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def make_engine(smollm2, cache: bool) -> LLMEngine:
    assert str(smollm2.model.dtype) == "torch.float32"
    config = EngineConfig(
        num_blocks=256, max_num_batched_tokens=96, max_num_seqs=8, enable_prefix_caching=cache
    )
    return LLMEngine(smollm2.model, config)


def shared_system(smollm2, eng: LLMEngine) -> list[list[int]]:
    prompts = [
        chat(
            smollm2.tokenizer,
            [{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
        )
        for q in QUESTIONS
    ]
    first = eng.generate(prompts[:1], GREEDY)
    return [r.token_ids for r in first + eng.generate(prompts[1:], GREEDY)]


def conversation(smollm2, eng: LLMEngine) -> tuple[list[list[int]], list[int]]:
    messages = [{"role": "system", "content": SYSTEM}]
    outputs, cached = [], []
    for turn in TURNS:
        messages.append({"role": "user", "content": turn})
        result = eng.generate([chat(smollm2.tokenizer, messages)], GREEDY)[0]
        outputs.append(result.token_ids)
        cached.append(result.num_cached_tokens)
        reply = smollm2.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
    return outputs, cached


def test_cache_on_equals_cache_off_on_the_real_model(smollm2):
    off, on = make_engine(smollm2, False), make_engine(smollm2, True)
    assert shared_system(smollm2, on) == shared_system(smollm2, off)
    # Each later question reuses the system prompt's full blocks.
    assert on.prefix_cache.num_hit_tokens >= 2 * 64
    on_before, off_before = on.num_computed_prompt_tokens, off.num_computed_prompt_tokens
    outputs, cached = conversation(smollm2, on)
    assert outputs == conversation(smollm2, off)[0]
    assert all(n >= 64 for n in cached)  # the system prompt at least, from the first part
    assert cached[2] > cached[1] > cached[0]  # each turn finds the previous ones
    computed_on = on.num_computed_prompt_tokens - on_before
    computed_off = off.num_computed_prompt_tokens - off_before
    assert computed_on < 0.5 * computed_off, (computed_on, computed_off)
    assert on.block_manager.num_free_blocks == 256
    on.block_manager.check_invariants()


OTHER = (
    "You are a terse travel agent. Answer with a city name and one reason, no more. The client "
    "prefers trains to planes, quiet places to crowded ones, and the sea to the mountains."
)


def interleaved(smollm2, eng: LLMEngine) -> list[list[int]]:
    """The conversation, with another client's question between its turns: a 12-block pool
    cannot keep both, so each turn's history is evicted (to the host tier, when on)."""
    messages = [{"role": "system", "content": SYSTEM}]
    outputs = []
    for index, turn in enumerate(TURNS):
        messages.append({"role": "user", "content": turn})
        result = eng.generate([chat(smollm2.tokenizer, messages)], GREEDY)[0]
        outputs.append(result.token_ids)
        reply = smollm2.tokenizer.decode(result.token_ids, skip_special_tokens=True)
        messages.append({"role": "assistant", "content": reply})
        other = [
            {"role": "system", "content": OTHER},
            {"role": "user", "content": QUESTIONS[index]},
        ]
        outputs.append(eng.generate([chat(smollm2.tokenizer, other)], GREEDY)[0].token_ids)
    return outputs


def test_the_host_tier_gives_the_same_tokens_on_the_real_model(smollm2):
    def tight(cache: bool, host: int) -> LLMEngine:
        config = EngineConfig(
            num_blocks=12,
            max_num_batched_tokens=96,
            enable_prefix_caching=cache,
            swap_bytes=64 << 20,
            host_cache_bytes=host,
        )
        return LLMEngine(smollm2.model, config)

    off, tier = tight(False, 0), tight(True, 64 << 20)
    assert interleaved(smollm2, tier) == interleaved(smollm2, off)
    assert tier.host_tier.num_demoted_blocks > 0
    assert tier.prefix_cache.num_host_hit_tokens > 0  # evicted history found in host RAM
    assert tier.block_manager.num_free_blocks == 12
    tier.block_manager.check_invariants()
    tier.host_tier.check_invariants()
