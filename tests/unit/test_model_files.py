"""`resolve_model_dir`: a --model tandem cannot read is a ConfigError naming the setting (one
line and exit status 2 at every command), not transformers' traceback."""

from __future__ import annotations

import re

import pytest

from shared.config import ConfigError
from shared.engine.model_files import resolve_model_dir


@pytest.mark.parametrize(
    "content",
    [b"not a GGUF file", b"GGUF\x03\x00\x00\x00\x01"],  # (the second: its header cut short)
    ids=["not-gguf", "cut-short"],
)
def test_a_gguf_file_that_is_none_is_refused_naming_model(tmp_path, monkeypatch, content):
    """transformers' ValueError (struct.error, cut short) was a traceback at a standalone
    prefill, decode or gateway service."""
    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    fake = tmp_path / "model.gguf"
    fake.write_bytes(content)
    with pytest.raises(ConfigError, match=f"^--model {re.escape(str(fake))}: "):
        resolve_model_dir(fake)


@pytest.mark.parametrize("content", ["{not json", "[]"])
def test_a_config_json_that_is_not_json_is_refused_naming_model(tmp_path, content):
    """transformers' OSError, read first by a service's AutoConfig or AutoTokenizer, was a
    traceback at a standalone prefill, decode or gateway service."""
    (tmp_path / "config.json").write_text(content)
    refusal = f"^--model {re.escape(str(tmp_path))}: .*config.json is not .*JSON"
    with pytest.raises(ConfigError, match=refusal):
        resolve_model_dir(tmp_path)


def test_a_model_type_not_served_is_refused_naming_model(tmp_path):
    """Refused by the workers' model config (`ModelConfig.from_hf`) alone, a gateway started
    alone took the model, and a standalone worker refused it in a traceback."""
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2}')
    refusal = f"^--model {re.escape(str(tmp_path))}: model_type 'gpt2' is not supported"
    with pytest.raises(ConfigError, match=refusal):
        resolve_model_dir(tmp_path)
