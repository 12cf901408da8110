"""The host swap space and the swap-or-recompute choice."""

import pytest
import torch

from shared.engine.swap import PreemptionCosts, SwapSpace


def test_swap_space_counts_bytes_and_refuses_past_its_capacity():
    space = SwapSpace(capacity_bytes=1000)
    keys, values = torch.zeros(50), torch.ones(50)  # 400 bytes together
    space.reserve(400)
    space.put("a", keys, values)
    assert space.used_bytes == 400 and len(space) == 1
    assert space.fits(600) and not space.fits(601)
    with pytest.raises(ValueError, match="no reservation"):
        space.put("b", keys, values)
    with pytest.raises(ValueError, match="no room"):
        space.reserve(601)
    got_keys, got_values = space.take("a")
    assert torch.equal(got_values, values) and space.used_bytes == 0
    space.discard("a")  # idempotent


def test_the_cheaper_estimate_wins_and_a_full_pool_means_recompute():
    costs = PreemptionCosts(copy_bytes_per_s=1e6, prefill_tokens_per_s=100.0)
    space = SwapSpace(capacity_bytes=10**9)
    # 1 MB moved twice: 2 s; 1,000 tokens again: 10 s -> swap. 10 tokens: 0.1 s -> recompute.
    assert costs.choose(10**6, 1000, space) == "swap"
    assert costs.choose(10**6, 10, space) == "recompute"
    assert costs.choose(10**6, 1000, SwapSpace(capacity_bytes=10)) == "recompute"
    assert PreemptionCosts("swap").choose(10**6, 1, space) == "swap"
    assert PreemptionCosts("recompute").choose(1, 10**6, space) == "recompute"


def test_rates_follow_measurements():
    costs = PreemptionCosts(copy_bytes_per_s=1e9, prefill_tokens_per_s=500.0)
    for _ in range(60):
        costs.record_copy(10**6, 1.0)
        costs.record_prefill(100, 1.0)
    assert costs.copy_bytes_per_s == pytest.approx(1e6, rel=1e-3)
    assert costs.prefill_tokens_per_s == pytest.approx(100.0, rel=1e-3)


def test_an_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="preemption_mode must be one of"):
        PreemptionCosts("lottery")
