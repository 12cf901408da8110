"""`tandem profile`: a worker profile measured on the tiny model, and its refusals."""

from __future__ import annotations

import pytest

from loadtest.worker_profile import (
    context_cost,
    kv_bytes_per_token,
    measure_profile,
    measure_transfer,
)
from services.commands import cli
from services.planner.profile import WorkerProfile, WorkerSettings
from tests.helpers import our_model_from_hf, tiny_hf_model


def test_measures_a_profile_the_simulator_reads(tmp_path):
    model = our_model_from_hf(tiny_hf_model())
    grid = {
        "prefill_tokens": [16, 64],
        "prefill_contexts": [64, 128, 4096],  # past the tiny model's 512 positions: skipped
        "batch_sizes": [1, 4],
        "contexts": [32, 64],
    }
    profile = measure_profile(model, grid, 1, WorkerSettings(), {"note": "test"})
    assert profile.decode_batch_sizes == [1, 4] and len(profile.decode_seconds[1]) == 2
    assert 0 <= profile.prefill_s_per_context_pair < 1e-3
    # 2 (K and V) x 2 layers x 2 KV heads x head dim 16 x 4 bytes
    assert kv_bytes_per_token(model) == profile.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert profile.transfer_bytes_per_s > 0 and profile.transfer_latency_s >= 0
    path = tmp_path / "p.json"
    profile.save(path)
    assert WorkerProfile.load(path).metadata == {"note": "test"}


def test_on_cuda_every_timed_run_ends_with_a_synchronize(monkeypatch):
    """A prefill step only queues its kernels on a GPU: timed without a synchronize, each run
    measured the one before it, and the context cost (runs after different contexts, in
    alternation) came out negative and was read as none. The model runs on the CPU here;
    `device` says where its work is timed, and the synchronizes are counted."""
    import torch

    model = our_model_from_hf(tiny_hf_model())
    grid = {"prefill_tokens": [16, 32], "prefill_contexts": [64], "batch_sizes": [1],
            "contexts": [32]}  # fmt: skip
    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *_: synchronized.append(1))
    repeats = 2
    measure_profile(model, grid, repeats, WorkerSettings(), {}, device="cuda")
    # After each warm-up and each timed run: two prefill sizes, the context pair, one decode.
    timed = [1, 1, 2, 1]
    assert len(synchronized) == sum(1 + n * repeats for n in timed)


def test_the_context_cost_is_a_slope_through_the_origin():
    # 1 us a pair, read off two points whose noise cancels; a negative slope reads as none.
    assert context_cost([1000, 2000], [0.0011, 0.0019]) == pytest.approx(0.98e-6)
    assert context_cost([1000, 2000], [0.001, 0.002]) == pytest.approx(1e-6)
    assert context_cost([1000], [-0.001]) == 0.0


def test_transfer_fit_is_a_latency_and_a_bandwidth():
    latency_s, bytes_per_s = measure_transfer(2, sizes=(1 << 12, 1 << 20, 1 << 22))
    assert 0 <= latency_s < 0.1
    assert bytes_per_s > 1e7  # an ipc socket pair moves far more than 10 MB/s


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--batch-sizes", "8,1"], "increasing"),
        (["--contexts", "lots"], "integers"),
        (["--prefill-tokens", "0,16"], "positive"),
        (["--repeats", "0"], "--repeats must be >= 1"),
        (["--prefill-contexts", "1024,512"], "increasing"),
        (["--max-num-batched-tokens", "8"], "settings.max_num_batched_tokens must be"),
        (["--block-size", "0"], "settings.block_size"),
        (["--kv-cache-bytes", "0"], "settings.kv_cache_bytes"),
    ],
)
def test_wrong_flag_values_exit_2(tmp_path, capsys, flags, message):
    assert cli.main(["profile", "--out", str(tmp_path / "p.json"), *flags]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize(
    "grid, message",
    [
        ({"prefill_tokens": [16, 1024]}, "--prefill-tokens 1024"),
        ({"contexts": [32, 1024]}, "--contexts 1024"),
        ({"contexts": [32, 510]}, "--contexts 510"),  # its steps' positions go past 512
    ],
)
def test_a_grid_past_the_models_positions_is_refused_before_measuring(grid, message):
    """(Measured until it got there, then an IndexError: minutes of a real model's time.)"""
    from loadtest.worker_profile import ProfileArgumentError

    model = our_model_from_hf(tiny_hf_model())  # 512 positions
    base = {"prefill_tokens": [16], "prefill_contexts": [64], "batch_sizes": [1],
            "contexts": [32]}  # fmt: skip
    with pytest.raises(ProfileArgumentError, match=f"{message}.* 512 positions"):
        measure_profile(model, {**base, **grid}, 1, WorkerSettings(), {})
