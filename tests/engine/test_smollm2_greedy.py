"""The real SmolLM2: our greedy tokens equal transformers' `generate`, token for token."""

import pytest
import torch

from loadtest.perplexity import CHAT_PROMPTS, PLAIN_PROMPTS
from services.commands.generate import encode_prompt
from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.slow

NUM_TOKENS = 64


def test_greedy_equals_transformers_generate(smollm2, smollm2_hf):
    tokenizer = smollm2.tokenizer
    prompts = [encode_prompt(tokenizer, p, chat=True) for p in CHAT_PROMPTS]
    prompts += [encode_prompt(tokenizer, p, chat=False) for p in PLAIN_PROMPTS]
    # A small step budget forces chunked prefill and mixes prompt chunks with decode steps.
    engine = LLMEngine(
        smollm2.model, EngineConfig(num_blocks=512, max_num_batched_tokens=48, max_num_seqs=8)
    )
    results = engine.generate(prompts, SamplingParams(max_tokens=NUM_TOKENS, temperature=0.0))
    for prompt, result in zip(prompts, results, strict=True):
        with torch.no_grad():
            hf = smollm2_hf.generate(
                torch.tensor([prompt], device=smollm2_hf.device),
                attention_mask=torch.ones(
                    1, len(prompt), dtype=torch.long, device=smollm2_hf.device
                ),
                max_new_tokens=NUM_TOKENS,
                do_sample=False,
            )
        expected = hf[0, len(prompt) :].tolist()
        assert result.token_ids == expected, tokenizer.decode(prompt)
    assert engine.block_manager.num_free_blocks == 512
