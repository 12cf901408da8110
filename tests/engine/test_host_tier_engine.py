"""The prefix cache's host tier and think-time retention in the engine, on the tiny random model:
a pool too small for the traffic evicts cached blocks to host RAM and a later prompt copies them
back (counted as hits), with greedy output token-identical to the cache off; a finished turn's
blocks outlive a flood of other prompts for their retention time (a fake clock)."""

import pytest
import torch

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.prefix_cache import chain_hashes, root_hash
from shared.engine.sampling_params import SamplingParams
from tests.helpers import our_model_from_hf, tiny_hf_model

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 16
TIER = 1 << 20  # bytes: ample room for every block the tests evict (a tiny block is 8 KiB)


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=5, device=device))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def engine(model, cache: bool = True, host: int = TIER, clock=None, **overrides) -> LLMEngine:
    config = dict(num_blocks=8, block_size=BLOCK, max_num_batched_tokens=64, max_num_seqs=4)
    config.update(overrides)
    config.setdefault("swap_bytes", host)
    return LLMEngine(
        model,
        EngineConfig(enable_prefix_caching=cache, host_cache_bytes=host, **config),
        clock=clock or FakeClock(),
    )


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(3, 256, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def assert_no_leak(eng: LLMEngine) -> None:
    assert not eng.has_unfinished
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    eng.block_manager.check_invariants()
    if eng.host_tier is not None:
        eng.host_tier.check_invariants()


def agents(eng: LLMEngine, num_turns: int = 3) -> list[list[int]]:
    """Three conversations sharing a system prompt, taking turns: the 8-block pool holds about
    one conversation, so each turn finds its history evicted by the other two."""
    system = tokens(40, seed=1)
    histories = [system + tokens(9 + a, seed=10 + a) for a in range(3)]
    outputs = []
    for turn in range(num_turns):
        for a in range(3):
            result = eng.generate([histories[a]], GREEDY)[0]
            outputs.append(result.token_ids)
            histories[a] = histories[a] + result.token_ids + tokens(5, seed=100 * turn + a)
    return outputs


def test_evicted_history_comes_back_from_host_ram_with_identical_output(model):
    expected = agents(engine(model, cache=False, host=0))
    device_only = engine(model, host=0)
    with_tier = engine(model)
    assert agents(device_only) == expected
    assert agents(with_tier) == expected
    cache, tier = with_tier.prefix_cache, with_tier.host_tier
    assert tier.num_demoted_blocks > 0 and tier.num_promoted_blocks > 0
    assert cache.num_host_hit_tokens > 0
    # The tier's hits come on top of the device's: fewer prompt tokens computed.
    assert cache.num_hit_tokens > device_only.prefix_cache.num_hit_tokens
    assert with_tier.num_computed_prompt_tokens < device_only.num_computed_prompt_tokens
    assert device_only.host_tier is None and device_only.prefix_cache.num_host_hit_tokens == 0
    assert_no_leak(with_tier)


def test_swap_under_pressure_keeps_priority_over_the_host_tier(model):
    """A pool too small for the batch swaps sequences out while the tier holds evicted prefix
    blocks in the same host memory: swaps always find their room, output stays identical."""
    prompts = [tokens(40, seed=4) + tokens(30 + i, seed=20 + i) for i in range(6)]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    config = dict(num_blocks=16, max_num_batched_tokens=24, preemption_mode="swap")
    expected = engine(model, cache=False, host=0, **config).generate(prompts, params)
    # Host memory for 12 blocks (8 KiB each), all of it lendable to the tier.
    on = engine(model, host=12 * 8192, **config)
    results = on.generate(prompts, params)
    assert [r.token_ids for r in results] == [r.token_ids for r in expected]
    assert on.scheduler.num_preemptions_by_mode["swap"] > 0
    assert on.host_tier.num_demoted_blocks > 0
    assert on.swap_space.used_bytes == on.swap_space.reserved_bytes == 0
    assert_no_leak(on)


def hang_up(eng: LLMEngine, num_prompts: int = 2) -> None:
    """Requests whose clients went away after the first token: their prompt blocks stay cached
    but carry no retention (no turn finished)."""
    for i in range(num_prompts):
        rid = eng.add_request(tokens(70, seed=500 + i), GREEDY)
        while not eng.sequence(rid).output_token_ids:
            eng.step()
        eng.abort(rid)


def second_turn_hit(eng: LLMEngine, clock: FakeClock, think_s: float) -> int:
    """Turn 1; during its think time, two hung-up requests and a long one-off prompt that needs
    7 of the 12 blocks; then turn 2: how much of turn 1 it still found."""
    first = tokens(50, seed=2)
    reply = eng.generate([first], GREEDY)[0].token_ids
    clock.now += think_s
    hang_up(eng)
    eng.generate([tokens(100, seed=600)], GREEDY)
    return eng.generate([first + reply + tokens(6, seed=3)], GREEDY)[0].num_cached_tokens


def test_a_finished_turn_outlives_other_traffic_for_its_retention_time(model):
    """Without a host tier, retention alone decides whether turn 2 finds turn 1's 3 cached
    blocks: the long prompt needs 6 cached blocks back, and LRU would take turn 1's first."""
    plain_clock, kept_clock, late_clock = FakeClock(), FakeClock(), FakeClock()
    pool = dict(host=0, num_blocks=12)
    plain = engine(model, clock=plain_clock, **pool)
    kept = engine(model, clock=kept_clock, finished_retention_s=30.0, **pool)
    late = engine(model, clock=late_clock, finished_retention_s=30.0, **pool)
    assert second_turn_hit(plain, plain_clock, 5.0) == 0  # LRU evicted the conversation
    assert second_turn_hit(kept, kept_clock, 5.0) == 48  # kept: the hung-up requests' went
    assert second_turn_hit(late, late_clock, 31.0) == 0  # past the deadline: plain LRU again
    assert kept.prefix_cache.num_retained > 0 and plain.prefix_cache.num_retained == 0
    for eng in (plain, kept, late):
        assert_no_leak(eng)


def test_retained_blocks_go_to_host_ram_under_pressure_and_come_back(model):
    """A 6-block pool cannot keep the retained turn beside 5-block prompts: its blocks move to
    host RAM rather than being dropped, and turn 2 copies them back (identical output)."""
    clock = FakeClock()
    eng = engine(model, clock=clock, finished_retention_s=30.0, num_blocks=6)
    first = tokens(50, seed=2)
    reply = eng.generate([first], GREEDY)[0].token_ids
    for i in range(2):
        eng.generate([tokens(70, seed=500 + i)], GREEDY)
    turn_hashes = list(chain_hashes(root_hash(eng.cache_key), first + reply, BLOCK))[:3]
    assert all(eng.host_tier.holds(h) for h in turn_hashes)
    second = eng.generate([first + reply + tokens(6, seed=3)], GREEDY)[0]
    assert second.num_cached_tokens == 48
    assert eng.prefix_cache.num_host_hit_tokens == 48
    reference = engine(model, cache=False, host=0, num_blocks=6)
    reference.generate([first], GREEDY)
    expected = reference.generate([first + reply + tokens(6, seed=3)], GREEDY)[0]
    assert second.token_ids == expected.token_ids
    assert_no_leak(eng)


def test_the_tier_takes_at_most_the_swap_spaces_memory(model):
    assert engine(model, host=TIER, swap_bytes=8192).host_tier.capacity_bytes == 8192
    assert engine(model, host=TIER, swap_bytes=0).host_tier is None  # recompute only: no tier
    assert engine(model, cache=False).host_tier is None


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (dict(host_cache_bytes=-1), "host_cache_bytes"),
        (dict(finished_retention_s=-1.0), "finished_retention_s"),
        (dict(finished_retention_s=float("nan")), "finished_retention_s"),
    ],
)
def test_wrong_values_refused(overrides, needle):
    with pytest.raises(ValueError, match=needle):
        EngineConfig(**overrides)
