"""Test-wide set-up. Triton runs its kernels on CPU tensors through its interpreter here; the
variable must be set before anything imports triton."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session."""
    from shared.engine.loader import load_model

    return load_model()


@pytest.fixture(scope="session")
def smollm2_hf(smollm2):
    """transformers' own model on the same converted weights, for truth comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.path, dtype="float32").eval()
