"""Decode steps replayed per batch-size bucket (`shared/engine/decode_graphs.py`): the buckets,
the static buffers and their padding, and the engine's tokens through them. On the CPU a replay
runs the step again on the static buffers (`eager_capture`), which tests everything but the
recording itself; on CUDA (`loadtest/gpu_check.sh`) the same tests capture real CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from shared.engine.decode_graphs import (
    DecodeGraphs,
    bucket_for,
    cuda_capture,
    eager_capture,
    fill_static,
    graph_buckets,
    padding_batch,
)
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams
from shared.engine.step_batch import SequenceChunk, build_step_batch
from tests.helpers import our_model_from_hf, tiny_hf_model


@pytest.fixture(scope="module")
def model(device):
    return our_model_from_hf(tiny_hf_model("llama", seed=5, device=device))


def capture_on(device) -> object:
    """The real recording on CUDA; on the CPU, a replay that warms up as CUDA's does (two runs
    at capture time, on the padding the buffers start with), then runs the step again."""
    if torch.device(device).type == "cuda":
        return cuda_capture

    def warming(step):
        step()
        step()
        return eager_capture(step)

    return warming


@pytest.mark.parametrize(
    "max_num_seqs,buckets",
    [
        (1, (1,)),
        (5, (1, 2, 4, 5)),
        (8, (1, 2, 4, 8)),
        (12, (1, 2, 4, 8, 12)),
        (64, (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)),
    ],
)
def test_buckets_are_powers_of_two_to_eight_then_every_eight_to_max_num_seqs(max_num_seqs, buckets):
    assert graph_buckets(max_num_seqs) == buckets


def test_a_batch_takes_the_smallest_bucket_that_holds_it():
    buckets = graph_buckets(64)
    assert [bucket_for(n, buckets) for n in (1, 2, 3, 5, 8, 9, 17, 64)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        64,
    ]
    assert bucket_for(65, buckets) is None
    with pytest.raises(ValueError, match="max_num_seqs"):
        graph_buckets(0)


def test_rows_past_a_batch_are_padding_again_after_a_bigger_one():
    static = padding_batch(4, max_blocks=3, block_size=16, device=torch.device("cpu"))
    assert static.slot_mapping.tolist() == [-1] * 4 and static.context_lens.tolist() == [1] * 4
    big = build_step_batch([SequenceChunk([5], 20, [7, 8]) for _ in range(3)], 16)
    fill_static(static, big)
    small = build_step_batch([SequenceChunk([6], 3, [9])], 16)
    fill_static(static, small)
    assert static.token_ids.tolist() == [6, 0, 0, 0]
    assert static.positions.tolist() == [3, 0, 0, 0]
    assert static.slot_mapping.tolist() == [9 * 16 + 3, -1, -1, -1]
    assert static.context_lens.tolist() == [4, 1, 1, 1]
    assert static.block_tables.tolist() == [[9, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0]]
    assert static.last_token_indices.tolist() == [0, 1, 2, 3]
    assert (static.max_query_len, static.max_context_len) == (1, 48)


def test_a_padded_replay_gives_the_eager_logits_and_writes_only_the_real_slots(model, device):
    engine = LLMEngine(model, EngineConfig(num_blocks=16, max_num_seqs=8, max_model_len=64))
    kv = engine.kv_cache
    generator = torch.Generator().manual_seed(0)
    for caches in (kv.key_caches, kv.value_caches):  # a stray write would show in any of them
        for cache in caches:
            cache.copy_(torch.randn(cache.shape, generator=generator).to(cache.dtype))
    chunks = [
        SequenceChunk([7], start_position=5, block_ids=[3]),
        SequenceChunk([9], start_position=20, block_ids=[4, 5]),
        SequenceChunk([11], start_position=0, block_ids=[6]),
    ]
    batch = build_step_batch(chunks, kv.block_size, device)
    before = [c.clone() for c in kv.key_caches + kv.value_caches]
    expected = model.step(batch, kv)
    after_eager = [c.clone() for c in kv.key_caches + kv.value_caches]
    for cache, saved in zip(kv.key_caches + kv.value_caches, before, strict=True):
        cache.copy_(saved)

    graphs = DecodeGraphs(model, kv, 8, 64, capture=capture_on(device))
    logits = graphs.run(batch)  # 3 sequences in the bucket of 4, captured here
    assert logits.shape == expected.shape
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)
    # The real rows' slots hold their keys and values (as close as the eager step's: a matmul
    # of 4 rows may round otherwise than one of 3); every other slot is untouched, bit for bit.
    real = torch.zeros(
        kv.num_blocks * kv.block_size, dtype=torch.bool, device=batch.slot_mapping.device
    )
    real[batch.slot_mapping] = True
    caches = kv.key_caches + kv.value_caches
    for cache, old, want in zip(caches, before, after_eager, strict=True):
        flat, flat_old, flat_want = (t.view(-1, *t.shape[2:]) for t in (cache, old, want))
        assert torch.equal(flat[~real], flat_old[~real])
        torch.testing.assert_close(flat[real], flat_want[real], rtol=1e-4, atol=1e-4)
    assert graphs.captured_buckets == {4} and graphs.num_replays == 1


def test_prompt_chunks_and_batches_past_the_largest_bucket_stay_eager(model, device):
    engine = LLMEngine(model, EngineConfig(num_blocks=16, max_num_seqs=8, max_model_len=64))
    graphs = DecodeGraphs(model, engine.kv_cache, 2, 64, capture=capture_on(device))
    prompt = build_step_batch([SequenceChunk([5, 6, 7], 0, [1])], 16, device)
    three = build_step_batch([SequenceChunk([5], 1, [b]) for b in (1, 2, 3)], 16, device)
    assert not graphs.takes(prompt) and not graphs.takes(three)
    with pytest.raises(ValueError, match="not a decode step a graph takes"):
        graphs.run(prompt)
    assert graphs.num_replays == 0


def test_an_engine_decoding_through_the_graphs_gives_the_eager_engines_tokens(model, device):
    """Staggered arrivals and lengths: batches grow and shrink through the buckets, prompts
    arrive between decode steps (eager), and a bucket is reused by smaller batches."""
    config = EngineConfig(num_blocks=64, max_num_seqs=6, max_model_len=128)
    generator = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (5, 17, 9, 30)]
    prompts += [torch.randint(3, 256, (n,), generator=generator).tolist() for n in (3, 12, 21)]
    lengths = [4, 20, 9, 14, 2, 17, 6]

    def run(engine: LLMEngine) -> dict[str, list[int]]:
        results: dict[str, list[int]] = {}
        pending = list(enumerate(prompts))
        while pending or engine.has_unfinished:
            if pending:
                index, prompt = pending.pop(0)
                params = SamplingParams(max_tokens=lengths[index], temperature=0.0, ignore_eos=True)
                engine.add_request(prompt, params, request_id=str(index))
            for out in engine.step():
                results.setdefault(out.request_id, []).extend(out.new_token_ids)
        return results

    expected = run(LLMEngine(model, config))
    graphed = LLMEngine(model, config)
    graphed.decode_graphs = DecodeGraphs(
        model, graphed.kv_cache, 6, graphed.max_model_len, capture=capture_on(device)
    )
    assert run(graphed) == expected
    assert [len(expected[str(i)]) for i in range(len(prompts))] == lengths
    assert graphed.decode_graphs.num_replays > 10
    assert len(graphed.decode_graphs.captured_buckets) >= 3  # several buckets captured and reused


def test_cuda_graphs_are_refused_off_cuda():
    cpu_model = our_model_from_hf(tiny_hf_model("llama", seed=5))
    with pytest.raises(ValueError, match="cuda_graphs needs a CUDA device"):
        LLMEngine(cpu_model, EngineConfig(num_blocks=8, cuda_graphs=True))


def test_cuda_graphs_are_refused_for_a_head_size_the_triton_kernel_cannot_tile():
    """Such a model's decode steps take the reference attention, which plans on the host and
    cannot be captured: the worker ended at its first decode step."""
    model = our_model_from_hf(tiny_hf_model("llama", seed=5, hidden_size=80, head_dim=20))
    assert model.config.head_dim == 20
    with pytest.raises(ValueError, match="head sizes that are powers of two; this model's is 20"):
        LLMEngine(model, EngineConfig(num_blocks=8, cuda_graphs=True))
