"""Our paged forward against transformers' own, on tiny random models, float32, on the test
device (`TANDEM_TEST_DEVICE`: on CUDA, decode steps run the compiled Triton kernels)."""

import pytest
import torch

from kernels import cpu_decode_attention
from shared.engine.block_manager import BlockManager
from shared.engine.kv_cache import KVCache
from shared.engine.step_batch import SequenceChunk, build_step_batch
from tests.conftest import TEST_DEVICE
from tests.helpers import our_model_from_hf, tiny_hf_model

TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def hf_llama(device):
    return tiny_hf_model("llama", device=device)


@pytest.fixture(scope="module", params=["auto", "dense"])
def llama(hf_llama, request):
    """Our model, its matrices packed for oneDNN (`auto`, on the CPU) and plain (`dense`)."""
    return our_model_from_hf(hf_llama, linear_backend=request.param)


def hf_logits(hf_model, token_ids: list[int]) -> torch.Tensor:
    """transformers' logits at every position of one unpadded sequence: [len, vocab]."""
    with torch.no_grad():
        return hf_model(torch.tensor([token_ids], device=hf_model.device)).logits[0].float()


class PagedRunner:
    """Drives our model over several sequences, chunk by chunk, with real block tables."""

    def __init__(self, model, block_size: int, num_blocks: int = 256):
        self.model = model
        self.block_size = block_size
        self.cache = KVCache(model.config, num_blocks, block_size, model.dtype, model.device)
        self.blocks = BlockManager(num_blocks, block_size)
        # Shuffle the pool so tables are not contiguous runs of ids.
        ids = list(self.blocks._free_ids)
        torch.manual_seed(1)
        self.blocks._free_ids.clear()
        self.blocks._free_ids.extend(ids[i] for i in torch.randperm(len(ids)).tolist())
        self.tables: dict[int, list[int]] = {}
        self.computed: dict[int, int] = {}

    def run(self, chunks: dict[int, list[int]]) -> torch.Tensor:
        seq_chunks = []
        for seq, tokens in chunks.items():
            table = self.tables.setdefault(seq, [])
            start = self.computed.get(seq, 0)
            self.blocks.grow(table, start + len(tokens))
            seq_chunks.append(SequenceChunk(tokens, start, table))
            self.computed[seq] = start + len(tokens)
        batch = build_step_batch(seq_chunks, self.block_size, self.model.device)
        return self.model.step(batch, self.cache)


@pytest.mark.parametrize("block_size", [1, 16])
def test_single_prompt(hf_llama, llama, block_size):
    prompt = torch.randint(3, 256, (37,), generator=torch.Generator().manual_seed(0)).tolist()
    ours = PagedRunner(llama, block_size).run({0: prompt})
    expected = hf_logits(hf_llama, prompt)[-1]
    assert (ours[0] - expected).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("block_size", [1, 16])
def test_batch_of_different_lengths_then_decode(hf_llama, llama, block_size):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(3, 256, (n,), generator=gen).tolist() for n in (1, 5, 16, 17, 40)]
    runner = PagedRunner(llama, block_size)
    logits = runner.run(dict(enumerate(prompts)))
    for step in range(4):
        for i, prompt in enumerate(prompts):
            expected = hf_logits(hf_llama, prompt)[-1]
            assert (logits[i] - expected).abs().max().item() < TOLERANCE, (step, i)
        next_tokens = logits.argmax(-1).tolist()
        for prompt, token in zip(prompts, next_tokens, strict=True):
            prompt.append(token)
        logits = runner.run({i: [t] for i, t in enumerate(next_tokens)})


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("chunk_size", [1, 7, 16, 33])
def test_chunked_prefill_equals_whole(hf_llama, llama, block_size, chunk_size):
    prompt = torch.randint(3, 256, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    expected_all = hf_logits(hf_llama, prompt + [5, 6, 7])
    runner = PagedRunner(llama, block_size)
    for start in range(0, len(prompt), chunk_size):
        chunk = prompt[start : start + chunk_size]
        logits = runner.run({0: chunk})
        position = start + len(chunk) - 1
        assert (logits[0] - expected_all[position]).abs().max().item() < TOLERANCE, position
    for offset, token in enumerate([5, 6, 7]):  # decode steps after the chunked prompt
        logits = runner.run({0: [token]})
        expected = expected_all[len(prompt) + offset]
        assert (logits[0] - expected).abs().max().item() < TOLERANCE


def test_mixed_step_prefill_chunks_with_decodes(hf_llama, llama):
    """One step holds a decode token of one sequence and prompt chunks of two others."""
    gen = torch.Generator().manual_seed(4)
    a, b, c = (torch.randint(3, 256, (n,), generator=gen).tolist() for n in (20, 45, 9))
    runner = PagedRunner(llama, 16)
    runner.run({0: a})
    logits = runner.run({0: [11], 1: b[:30], 2: c})
    assert (logits[0] - hf_logits(hf_llama, a + [11])[-1]).abs().max() < TOLERANCE
    assert (logits[1] - hf_logits(hf_llama, b[:30])[-1]).abs().max() < TOLERANCE
    assert (logits[2] - hf_logits(hf_llama, c)[-1]).abs().max() < TOLERANCE
    logits = runner.run({1: b[30:], 2: [12]})
    assert (logits[0] - hf_logits(hf_llama, b)[-1]).abs().max() < TOLERANCE
    assert (logits[1] - hf_logits(hf_llama, c + [12])[-1]).abs().max() < TOLERANCE


@pytest.mark.parametrize(
    "model_type,overrides",
    [
        ("qwen2", {}),  # q/k/v bias
        ("mistral", {"sliding_window": None}),
        ("llama", {"tie_word_embeddings": True}),
        ("llama", {"head_dim": 32}),  # not hidden_size / heads
        ("llama", {"attention_bias": True, "mlp_bias": True}),  # every projection's bias
        ("llama", {"num_key_value_heads": 1}),  # one KV head for every query head
        ("llama", {"num_key_value_heads": 4}),  # no grouping
        ("qwen2", {"tie_word_embeddings": True, "rms_norm_eps": 1e-2}),
        ("mistral", {"sliding_window": None, "head_dim": 8, "num_attention_heads": 12}),
        # Fields another family reads: Mistral's projections and Qwen2's MLP take no bias.
        ("mistral", {"sliding_window": None, "attention_bias": True, "mlp_bias": True}),
        ("qwen2", {"attention_bias": True, "mlp_bias": True}),
        ("llama", {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 500.0}}),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "llama3",
                    "factor": 8.0,
                    "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0,
                }
            },
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 4.0,
                    "original_max_position_embeddings": 128,
                    "rope_theta": 10000.0,
                }
            },
        ),
        (
            "llama",
            {
                "rope_parameters": {
                    "rope_type": "yarn",
                    "factor": 8.0,
                    "original_max_position_embeddings": 64,
                    "rope_theta": 10000.0,
                    "mscale": 0.7,
                    "mscale_all_dim": 1.0,
                    "beta_fast": 16,
                    "beta_slow": 2,
                    "truncate": False,
                }
            },
        ),
    ],
)
def test_family_variants(model_type, overrides, device):
    hf = tiny_hf_model(model_type, seed=5, device=device, **overrides)
    ours = our_model_from_hf(hf)
    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    runner = PagedRunner(ours, 16)
    expected = hf_logits(hf, prompt)
    logits = runner.run({0: prompt[:100]})
    assert (logits[0] - expected[99]).abs().max().item() < TOLERANCE
    logits = runner.run({0: prompt[100:]})
    assert (logits[0] - expected[-1]).abs().max().item() < TOLERANCE


def test_a_sliding_window_model_is_served_within_its_window(device):
    """Mistral attends over a window (4096 tokens by default): it was taken for full attention,
    and past the window its tokens differed from transformers'. Within it they are the same,
    and the engine serves no longer a context."""
    from shared.engine.engine import EngineConfig, LLMEngine
    from shared.engine.model_config import served_context_len

    hf = tiny_hf_model("mistral", seed=5, device=device, sliding_window=24)
    ours = our_model_from_hf(hf)
    assert ours.config.attention_window == 24
    prompt = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = PagedRunner(ours, 16).run({0: prompt})
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE
    assert LLMEngine(ours, EngineConfig(num_blocks=8)).max_model_len == 24
    # The gateway reads the same limit off the config (a prompt past it is its 400).
    assert served_context_len(hf.config) == 24 and served_context_len(hf.config, 512) == 24
    assert served_context_len(tiny_hf_model("llama", seed=5, device=device).config, 100) == 100


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_tracks_transformers(dtype, device):
    """16-bit runs are not bit-identical (other kernels, other rounding), but stay close."""
    hf = tiny_hf_model("llama", seed=8, device=device)
    ours = our_model_from_hf(hf, dtype)
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    runner = PagedRunner(ours, 16)
    runner.run({0: prompt[:25]})
    decoded = runner.run({0: [prompt[25]]})  # a decode step: the Triton kernel on CUDA
    logits = runner.run({0: prompt[26:]})
    expected = hf_logits(hf.to(dtype), prompt)
    assert logits.dtype == decoded.dtype == torch.float32
    for ours, position in ((decoded[0], 25), (logits[0], len(prompt) - 1)):
        scale = expected[position].abs().max().item()
        assert (ours - expected[position]).abs().max().item() < 0.05 * scale, position


@pytest.mark.skipif(TEST_DEVICE != "cpu", reason="the C decode kernel serves CPU tensors only")
def test_bfloat16_with_the_cpu_decode_kernel_tracks_transformers(tmp_path):
    """Decode rows through `kernels.cpu_decode_attention`, alone and in a step that also carries
    another sequence's prompt chunk (the reference attends the chunk)."""
    hf = tiny_hf_model("llama", seed=8)
    ours = our_model_from_hf(hf, torch.bfloat16, decode_kernel=cpu_decode_attention.build(tmp_path))
    prompt = torch.randint(3, 256, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    other = torch.randint(3, 256, (30,), generator=torch.Generator().manual_seed(10)).tolist()
    runner = PagedRunner(ours, 16)
    runner.run({0: prompt[:25]})
    decoded = runner.run({0: [prompt[25]]})
    mixed = runner.run({0: [prompt[26]], 1: other})
    expected = hf_logits(hf.to(torch.bfloat16), prompt)
    expected_other = hf_logits(hf, other)
    checks = ((decoded[0], expected[25]), (mixed[0], expected[26]), (mixed[1], expected_other[-1]))
    for logits, truth in checks:
        scale = truth.abs().max().item()
        assert (logits - truth).abs().max().item() < 0.05 * scale


def test_yarn_serves_past_the_original_positions_as_transformers_does(device):
    """Qwen2.5's long-context setting keeps max_position_embeddings (here 64) and adds yarn,
    factor 4: transformers (and vLLM) serve 256 positions, tandem refused past 64. The rope
    factor's default comes from the model's positions, never from the served length."""
    from shared.engine.engine import EngineConfig, LLMEngine
    from shared.engine.model_config import served_context_len

    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    hf = tiny_hf_model(
        "qwen2", seed=5, device=device, max_position_embeddings=64, rope_parameters=yarn
    )
    assert served_context_len(hf.config) == 256
    ours = our_model_from_hf(hf)
    assert LLMEngine(ours, EngineConfig(num_blocks=32)).max_model_len == 256
    prompt = torch.randint(3, 256, (150,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = PagedRunner(ours, 16).run({0: prompt})
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("layers_sliding", [False, True])
def test_a_qwen2_window_counts_only_where_a_layer_slides(layers_sliding, device):
    """Qwen2 slides only in the layers from `max_window_layers` on: with none, its window was
    refused though full attention is the model; with some, it is served within the window."""
    from shared.engine.model_config import served_context_len

    hf = tiny_hf_model(
        "qwen2",
        seed=5,
        device=device,
        use_sliding_window=True,
        sliding_window=24,
        max_window_layers=1 if layers_sliding else 2,
    )
    ours = our_model_from_hf(hf)
    assert ours.config.attention_window == (24 if layers_sliding else None)
    assert served_context_len(hf.config) == (24 if layers_sliding else 512)
    prompt = torch.randint(3, 256, (24,), generator=torch.Generator().manual_seed(6)).tolist()
    logits = PagedRunner(ours, 16).run({0: prompt})
    assert (logits[0] - hf_logits(hf, prompt)[-1]).abs().max().item() < TOLERANCE


@pytest.mark.parametrize("activation", ["gelu", "relu", "gelu_pytorch_tanh"])
def test_an_activation_the_forward_does_not_compute_is_refused(activation):
    """The MLP's gate is SiLU: a GELU model ran as SiLU, silently wrong from its first token."""
    from shared.engine.model_config import ModelConfig

    with pytest.raises(ValueError, match=f"hidden_act '{activation}' is not supported"):
        ModelConfig.from_hf(tiny_hf_model("llama", hidden_act=activation).config)


def test_the_rope_tables_do_not_depend_on_the_length_served():
    """Yarn without a `factor` takes it from the model's positions over the original ones: it
    was taken from the positions served, so a --max-model-len changed every position's angle."""
    from shared.engine.rope import RotaryEmbedding

    yarn = {
        "rope_type": "yarn",
        "factor": None,  # (null: transformers refuses a yarn config without the key)
        "original_max_position_embeddings": 16,
        "rope_theta": 1e4,
    }
    whole = RotaryEmbedding(yarn, 8, 64)
    served = RotaryEmbedding(yarn, 8, 32, max_position_embeddings=64)
    assert torch.equal(served.cos, whole.cos[:32]) and torch.equal(served.sin, whole.sin[:32])
