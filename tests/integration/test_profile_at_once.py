"""Profiles measured several at once (`plan_validate --profile measure`): real `tandem profile`
processes on the tiny model, their median, and a failing one reported."""

from __future__ import annotations

import pytest

from loadtest.profile_at_once import brief, measure_at_once
from services.planner.profile import ProfileError
from shared.engine.loader import parse_dtype

SMALL_GRID = ["--prefill-tokens", "16,32", "--batch-sizes", "1,2", "--contexts", "16,32"]


def test_two_measured_at_once_give_their_median(tiny_model_dir):
    profile = measure_at_once(2, 1, ["--model", str(tiny_model_dir), *SMALL_GRID])
    assert profile.metadata["median_of"] == 2
    assert profile.metadata["note"] == "2 measured at once (plan_validate)"
    assert profile.metadata["threads"] == 1
    # `--dtype auto` (the default): the dtype the workers resolve on this machine.
    assert profile.metadata["dtype"] == str(parse_dtype("auto")).removeprefix("torch.")
    assert profile.prefill_tokens == [16, 32] and profile.decode_contexts == [16, 32]
    assert all(t > 0 for t in profile.prefill_seconds)
    assert brief(profile).startswith("prefill 32 tok ")


def test_a_failing_profile_is_reported(tiny_model_dir):
    with pytest.raises(ProfileError, match="increasing"):
        measure_at_once(2, 1, ["--model", str(tiny_model_dir), "--batch-sizes", "4,1"])
    with pytest.raises(ProfileError, match=">= 1"):
        measure_at_once(0, 1)
