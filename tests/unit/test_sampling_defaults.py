"""Defaults for unset sampling fields: the model's generation config, then --default-sampling."""

from __future__ import annotations

import json

import pytest

from services.gateway.openai_protocol import parse_completion_request
from shared.engine.sampling_defaults import (
    DEFAULT_MODEL_SAMPLING,
    model_sampling_defaults,
    parse_default_sampling,
    read_generation_config,
    sampling_defaults,
)


def write_config(directory, **values) -> None:
    (directory / "generation_config.json").write_text(json.dumps(values))


def test_parse_default_sampling():
    assert parse_default_sampling(None) == {}
    assert parse_default_sampling(" temperature=0.7 , top_k=40,") == {
        "temperature": 0.7,
        "top_k": 40,
    }
    assert isinstance(parse_default_sampling("top_k=40")["top_k"], int)


@pytest.mark.parametrize(
    "text,words",
    [
        ("temperature", "field=value"),
        ("seed=3", "'seed' is not a sampling field"),
        ("max_tokens=3", "'max_tokens' is not a sampling field"),
        ("temperature=hot", "temperature must be a number"),
        ("top_k=1.5", "top_k must be an integer"),
        ("temperature=nan", "must be finite"),
        ("top_p=0", "top_p must be in (0, 1]"),
        ("temperature=-1", "temperature must be >= 0"),
        ("top_p=0.5,top_p=0.6", "given twice"),
    ],
)
def test_wrong_default_sampling_is_refused_by_name(text, words):
    with pytest.raises(ValueError, match=None) as error:
        parse_default_sampling(text)
    assert words in str(error.value)


def test_generation_config_fields_as_vllm_reads_them(tmp_path):
    write_config(
        tmp_path, temperature=0.6, top_p=0.9, top_k=20, do_sample=False, max_new_tokens=9, eos=2
    )
    assert read_generation_config(tmp_path) == {"temperature": 0.6, "top_p": 0.9, "top_k": 20}
    assert read_generation_config(tmp_path / "elsewhere") == {}


@pytest.mark.parametrize(
    "content,words",
    [
        ("{not json", "not a readable JSON"),
        ("[1]", "JSON object"),
        ('{"top_p": 7}', "top_p must be in (0, 1]"),
    ],  # fmt: skip
)
def test_a_broken_generation_config_is_an_error(tmp_path, content, words):
    (tmp_path / "generation_config.json").write_text(content)
    with pytest.raises(ValueError) as error:
        read_generation_config(tmp_path)
    assert words in str(error.value)


def test_where_the_models_defaults_come_from(tmp_path):
    # The default model's GGUF has no generation config: its model card's values stand in.
    assert model_sampling_defaults(tmp_path, is_default_model=True) == DEFAULT_MODEL_SAMPLING
    assert model_sampling_defaults(tmp_path, is_default_model=False) == {}
    assert model_sampling_defaults(tmp_path, is_default_model=True, source="none") == {}
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"temperature": 0.5}))
    assert model_sampling_defaults(tmp_path, True, source=str(other)) == {"temperature": 0.5}
    with pytest.raises(ValueError, match="does not exist"):
        model_sampling_defaults(tmp_path, True, source=str(tmp_path / "missing.json"))
    write_config(tmp_path, temperature=0.8)
    assert model_sampling_defaults(tmp_path, is_default_model=True) == {"temperature": 0.8}


def test_the_operators_defaults_go_over_the_models(tmp_path):
    write_config(tmp_path, temperature=0.6, top_p=0.9)
    merged = sampling_defaults(tmp_path, False, overrides="temperature=0.3,min_p=0.05")
    assert dict(merged) == {"temperature": 0.3, "top_p": 0.9, "min_p": 0.05}


def test_a_request_takes_the_defaults_only_for_the_fields_it_leaves_unset():
    defaults = {"temperature": 0.2, "top_p": 0.9}
    body = {"model": "m", "prompt": "hi", "max_tokens": 4}
    unset = parse_completion_request(body, "m", 64).sampling_params(2, 64, defaults)
    assert (unset.temperature, unset.top_p) == (0.2, 0.9)
    body = {**body, "temperature": 0, "top_p": None}  # null is "not given", as in OpenAI's API
    given = parse_completion_request(body, "m", 64).sampling_params(2, 64, defaults)
    assert (given.temperature, given.top_p) == (0.0, 0.9)
    plain = parse_completion_request(body, "m", 64).sampling_params(2, 64)
    assert (plain.temperature, plain.top_p) == (0.0, 1.0)
