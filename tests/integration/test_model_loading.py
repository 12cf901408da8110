"""What `load_model` takes from a checkpoint directory besides the weights."""

from __future__ import annotations

import shutil

from shared.engine.engine import EngineConfig, LLMEngine
from shared.engine.loader import load_model
from shared.engine.sampling_params import SamplingParams


def test_a_loaded_model_stops_on_the_generation_configs_end_ids(tiny_model_dir, tmp_path):
    """The tokens `generation_config.json` names as ends stop a generation, as config.json's
    do: the engine ran on past them to max_tokens."""
    for file in tiny_model_dir.iterdir():
        shutil.copy(file, tmp_path / file.name)
    baseline = LLMEngine(load_model(tmp_path).model, EngineConfig(num_blocks=64))
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens = baseline.generate([[5, 17, 33, 9]], params)[0].token_ids
    assert len(tokens) == 12 and 2 not in tokens  # (config.json's end: none came)
    # A token first made after the first step, which the run would stop on.
    end = next(i for i in range(1, len(tokens)) if tokens[i] not in tokens[:i])
    (tmp_path / "generation_config.json").write_text(f'{{"eos_token_id": [2, {tokens[end]}]}}')
    loaded = load_model(tmp_path)
    assert loaded.config.eos_token_ids == (2, tokens[end])
    engine = LLMEngine(loaded.model, EngineConfig(num_blocks=64))
    output = engine.generate([[5, 17, 33, 9]], params)[0]
    assert output.token_ids == tokens[: end + 1] and output.finish_reason == "stop"
