"""Prompt logprobs on the real SmolLM2: each prompt token's logprob and top n equal transformers'
log-softmax of its logits, across chunk boundaries and beside sequences that do not ask."""

from pathlib import Path

import pytest
import torch

from loadtest.perplexity import PLAIN_PROMPTS
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow
CORPUS = Path(__file__).parents[2] / "loadtest" / "corpus.txt"


def hf_logprobs(smollm2_hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the log-softmax that predicts prompt token p + 1."""
    with torch.no_grad():
        logits = smollm2_hf(torch.tensor([prompt], device=smollm2_hf.device)).logits[0].float()
    return torch.log_softmax(logits[:-1], dim=-1).cpu()


def test_prompt_logprobs_equal_transformers(smollm2, smollm2_hf):
    tokenizer = smollm2.tokenizer
    prompts = [tokenizer(p).input_ids for p in PLAIN_PROMPTS[:3]]
    prompts.append(tokenizer(CORPUS.read_text()[:500]).input_ids)  # longer than several chunks
    # A small step budget cuts the prompts into chunks, batched beside each other.
    engine = LLMEngine(
        smollm2.model, EngineConfig(num_blocks=256, max_num_batched_tokens=24, max_num_seqs=8)
    )
    asking = SamplingParams(max_tokens=3, temperature=0.0, prompt_logprobs=3)
    silent = SamplingParams(max_tokens=3, temperature=0.0)
    params = [asking, silent, asking, asking]
    results = engine.generate(prompts, params)
    assert max(len(p) for p in prompts) > 3 * 24
    for prompt, result, asked in zip(prompts, results, params, strict=True):
        if asked.prompt_logprobs is None:
            assert result.prompt_logprobs is None
            continue
        expected = hf_logprobs(smollm2_hf, prompt)
        assert len(result.prompt_logprobs) == len(prompt) - 1
        chosen = torch.tensor([lp.logprob for lp in result.prompt_logprobs])
        targets = torch.tensor(prompt[1:])
        torch.testing.assert_close(
            chosen, expected.gather(1, targets.unsqueeze(1)).squeeze(1), atol=2e-4, rtol=1e-4
        )
        top_values, top_ids = expected.topk(3, dim=-1)
        for p, entry in enumerate(result.prompt_logprobs):
            assert [t for t, _ in entry.top] == top_ids[p].tolist()
            torch.testing.assert_close(
                torch.tensor([v for _, v in entry.top]), top_values[p], atol=2e-4, rtol=1e-4
            )
    # Asking changes nothing of the output: the same greedy tokens as without.
    plain = engine.generate(prompts, silent)
    assert [r.token_ids for r in results] == [r.token_ids for r in plain]


def test_a_prompt_asking_is_computed_whole_even_when_its_prefix_is_cached(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer(CORPUS.read_text()[:300]).input_ids
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=128, enable_prefix_caching=True))
    engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))
    cached = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0))[0]
    assert cached.num_cached_tokens > 0  # the cache holds the prompt
    asking = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    (result,) = engine.generate([prompt], asking)
    assert result.num_cached_tokens == 0
    assert len(result.prompt_logprobs) == len(prompt) - 1
    assert all(lp.top == [] and lp.logprob <= 0 for lp in result.prompt_logprobs)


def test_a_one_token_prompt_has_no_prompt_logprobs(smollm2):
    engine = LLMEngine(smollm2.model, EngineConfig(num_blocks=16))
    asking = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=1)
    assert engine.generate([[504]], asking)[0].prompt_logprobs == []
