"""Settings past what the model allows are refused at start-up, naming the setting: a KV budget
that holds no block, and a context longer than the model's positions."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shared.config import ConfigError
from shared.engine.kv_cache import bytes_per_block, num_blocks_for_budget
from shared.engine.model_config import served_context_len
from tests.helpers import TINY_KV_CONFIG


def test_a_kv_budget_that_holds_no_block_is_a_config_error():
    """`tandem prefill --kv-cache-bytes 1000` loaded the model, then died on a ValueError
    traceback naming no setting."""
    block_bytes = bytes_per_block(TINY_KV_CONFIG, 4, torch.float32)
    assert num_blocks_for_budget(TINY_KV_CONFIG, 4, torch.float32, block_bytes) == 1
    with pytest.raises(ConfigError) as refused:
        num_blocks_for_budget(TINY_KV_CONFIG, 4, torch.float32, block_bytes - 1)
    message = str(refused.value)
    assert message.startswith("kv_cache_bytes (--kv-cache-bytes / TANDEM_KV_CACHE_BYTES): ")
    assert f"take {block_bytes} bytes each" in message


def hf_config(max_position_embeddings: int, **fields) -> SimpleNamespace:
    return SimpleNamespace(
        model_type="llama", max_position_embeddings=max_position_embeddings, **fields
    )


def test_a_max_model_len_past_the_models_positions_is_refused():
    """The gateway took --max-model-len 8192 on a model of 2,048 positions, admitted prompts
    past them, and the workers' engines (which serve at most the model's) failed them."""
    assert served_context_len(hf_config(2048)) == 2048
    assert served_context_len(hf_config(2048), 2048) == 2048
    assert served_context_len(hf_config(2048), 1024) == 1024
    with pytest.raises(ConfigError, match=r"max_model_len \(--max-model-len / TANDEM_MAX_MOD"):
        served_context_len(hf_config(2048), 8192)
    # Within the positions, a sliding window still caps it (as before).
    window = hf_config(2048, sliding_window=512)
    window.model_type = "mistral"
    assert served_context_len(window, 2048) == 512
