"""Shared factories for the tests: tiny random Llama-family models and their transformers twins."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from kernels.cpu_decode_attention import CpuDecodeAttention
from shared.engine.model import LlamaModel, load_hf_weights
from shared.engine.model_config import ModelConfig

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    # Larger than the usual 0.02 so that logits differ enough between tokens to catch mistakes.
    initializer_range=0.2,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def tiny_hf_model(
    model_type: str = "llama", seed: int = 0, device: torch.device | str = "cpu", **overrides
):
    """A transformers causal LM with random weights (float32, eval mode). The weights are drawn
    on the CPU, so a seed gives the same model on every device."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(model_type, **{**TINY_LLAMA, **overrides})
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().to(device)


def our_model_from_hf(
    hf_model,
    dtype: torch.dtype = torch.float32,
    linear_backend: str = "auto",
    decode_kernel: CpuDecodeAttention | None = None,
) -> LlamaModel:
    """Our model on the same weights and device as `hf_model`."""
    config = ModelConfig.from_hf(hf_model.config)
    return load_hf_weights(
        config,
        hf_model.state_dict().items(),
        dtype,
        hf_model.device,
        linear_backend=linear_backend,
        decode_kernel=decode_kernel,
    )


# A KV cache's shape without a model: 2 layers, 1 KV head of 4 dims (256 bytes per 4-token block
# in float32), for tests of the block tiers.
TINY_KV_CONFIG = ModelConfig(
    model_type="llama",
    vocab_size=32,
    hidden_size=8,
    intermediate_size=16,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=False,
)


CHAT_TEMPLATES = Path(__file__).parent / "chat_templates"


def chat_template(name: str) -> str:
    """A chat template of tests/chat_templates (templates of each tool-call family)."""
    return (CHAT_TEMPLATES / name).read_text()


class FailingModel:
    """The real model, whose step raises when `fails(batch)` says so, after running it and
    spoiling the KV it wrote (a forward that failed late leaves its batch's new slots holding
    anything)."""

    def __init__(self, model, fails):
        self._model, self._fails = model, fails
        self.num_raised = 0

    def __getattr__(self, name):
        return getattr(self._model, name)

    def step(self, batch, kv_cache):
        logits = self._model.step(batch, kv_cache)
        if self._fails(batch, kv_cache.block_size):
            for cache in (*kv_cache.key_caches, *kv_cache.value_caches):
                cache.view(-1, *cache.shape[2:])[batch.slot_mapping] = 7.0
            self.num_raised += 1
            raise RuntimeError("injected")
        return logits


def writes_into(engine, *request_ids: str):
    """Whether a step's batch writes into a block one of `request_ids` holds."""

    def fails(batch, block_size):
        held = set()
        for request_id in request_ids:
            seq = engine._sequences.get(request_id)
            held.update(seq.block_ids if seq is not None else ())
        return bool(set((batch.slot_mapping // block_size).tolist()) & held)

    return fails


def run_tandem(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """The `tandem` command run in a child process, its output captured."""
    return subprocess.run(
        [sys.executable, "-m", "services.commands.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


def free_port() -> str:
    """A TCP port free on 127.0.0.1 now (as a flag's value)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return str(probe.getsockname()[1])


def wait_for_line(process: subprocess.Popen, needle: bytes, what: str) -> None:
    """Reads a child's output until a line holds `needle` (start-up may take a while on a busy
    machine); AssertionError if it exits first."""
    for line in process.stdout:
        if needle in line:
            return
    raise AssertionError(f"{what} exited before saying {needle.decode()!r}")


def scheduler_process(address: str, *flags: str) -> subprocess.Popen:
    """`tandem scheduler` (model "m") at `address` as a child, its JSON log on its stdout."""
    return subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "scheduler", "--address", address,
         "--model", "m", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        env={**os.environ, "TANDEM_LOG_FORMAT": "json"},
    )  # fmt: skip
