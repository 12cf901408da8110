"""The services that never touch a tensor run without torch (a scheduler in 36 MiB, not 230, and
`tandem plan` answering without 2 s of imports): the wire imports torch only for a tensor
frame, the engine's request types only for a seeded generator. Each check is a fresh process,
since this one has torch loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torch_loaded_after(code: str) -> bool:
    probe = f"import sys\n{code}\nprint('torch' in sys.modules)"
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().splitlines()[-1] == "True"


@pytest.mark.parametrize("command", ["scheduler", "batch-service", "plan", "top", "bench", "batch"])
def test_commands_that_hold_no_tensor_import_no_torch(command):
    code = f"from services.commands.cli import build_parser\nbuild_parser([{command!r}])"
    assert not torch_loaded_after(code)


def test_messages_without_tensors_travel_without_torch_and_a_kv_transfer_brings_it():
    submit = """
from shared import wire
submit = wire.Submit(request_id="r", prompt_token_ids=[1, 2], sampling=wire.SamplingSpec(),
                     tenant="t", priority=0, gateway_peer_id="g", arrival_time=0.0)
assert wire.decode(wire.encode(submit)) == submit
"""
    assert not torch_loaded_after(submit)
    transfer = """
from shared import wire
from tests.unit.test_wire import kv_transfer
import torch
keys = torch.arange(64, dtype=torch.bfloat16).reshape(2, 1, 4, 2, 4)
assert torch.equal(wire.decode(wire.encode(kv_transfer(keys))).keys, keys)
"""
    assert torch_loaded_after(transfer)


def test_a_plan_runs_without_torch():
    code = """
from services.commands import cli
assert cli.main(["plan", "--workload", "poisson:rate=2,n=20,prompt=8-64,output=2-8",
                 "--slo", "ttft_p99=30s", "--max-workers", "3",
                 "--jobs", "1"]) == 0
"""
    assert not torch_loaded_after(code)
