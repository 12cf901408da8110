"""The `tandem` command refuses wrong input with a clear message and exit status 2."""

import json
import subprocess
import sys

import pytest

from tests.helpers import free_port, run_tandem

FP16_F16 = ["--quantization", "fp16", "--dtype", "float16"]  # a float16 copy of float16: no


# (`tandem up` checks its port before the model: a free one, whatever else runs here.)
FREE_PORT = ["--port", free_port()]


WRONG_INPUTS = [
    (["generate", "--prompt", "hi", "--max-tokens", "-1"], "max_tokens"),
    (["generate", "--prompt", "hi", "--temperature", "-0.5"], "temperature"),
    (["generate", "--prompt", "hi", "--dtype", "float8"], "dtype"),
    (["generate", "--prompt", "hi", "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
    (["generate", "--prompt", "hi", "--min-tokens", "65"], "min_tokens"),
    (["generate", "--prompt", "hi", "--min-tokens", "x"], "--min-tokens"),
    (["generate", "--prompt", "hi", "--stop-token-ids", "1,b"], "--stop-token-ids"),
    (["generate", "--prompt", "hi", "--default-sampling", "heat=1"], "'heat' is not"),
    (["generate", "--prompt", "hi", "--generation-config", "/nope"], "does not exist"),
    (["up", "--default-sampling", "top_p=2"], "--default-sampling: top_p must be in"),
    (["gateway", "--default-sampling", "temperature"], "default_sampling"),
    (["up", "--chat-template", "/no/such.jinja"], "chat_template (--chat-template): cannot"),
    (["gateway", "--chat-template", "/no/such.jinja"], "cannot read /no/such.jinja"),
    (["up", "--device", "cuda:x"], "device must be cpu, cuda or cuda:N"),
    (["scheduler", "--heartbeat-timeout-s", "0"], "heartbeat_timeout_s"),
    (["scheduler", "--address", "localhost:5555"], "tcp://, ipc:// or inproc://"),
    (["decode", "--block-size", "many"], "--block-size: expected an integer"),
    (["decode"], "needs --address"),
    (["prefill", "--dtype", "int4"], "dtype"),
    (["prefill", "--quantization", "int4"], "--quantization / TANDEM_QUANTIZATION"),
    (["decode", "--address", "ipc://x", *FP16_F16], "needs a float32 or bfloat16 model"),
    (["generate", "--prompt", "hi", *FP16_F16], "bfloat16 model on the CPU, got float16"),
    (["up", "--quantization", "int8"], "--quantization"),
    (["up", "--cuda-graphs"], "--cuda-graphs needs --device cuda, got cpu"),
    (["decode", "--address", "ipc://x", "--cuda-graphs", "true"], "needs --device cuda"),
    (["decode", "--address", "ipc://x", "--cuda-graphs", "maybe"], "--cuda-graphs"),
    (["gateway", "--port", "0"], "port"),
    (["up", "--model", "/no/such", *FREE_PORT], "/no/such"),
    (["generate", "--prompt", "hi", "--model", "/no/such"], "/no/such"),
    (["up", "--prefill", "0"], "--prefill must be at least 1"),
    (["up", "--prefill", "0", "--decode", "0"], "--prefill must be at least 1"),
    (["frobnicate"], "invalid choice"),
]
# Runs each argv through the command's `main` in one interpreter (a fresh one per argv paid
# torch's import 28 times, two minutes of CI), printing its exit status and what it wrote on
# stderr; the subprocess's time limit still bounds an argv that would run instead of failing.
ALL_AT_ONCE = r"""
import contextlib, io, json, sys
from services.commands.cli import main
answers = []
for argv in json.loads(sys.argv[1]):
    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr):
        try:
            status = main(argv)
        except SystemExit as exit:
            status = exit.code
    answers.append([status, stderr.getvalue()])
print(json.dumps(answers))
"""


@pytest.fixture(scope="module")
def answers_to_wrong_inputs() -> list[tuple[int, str]]:
    argvs = json.dumps([argv for argv, _ in WRONG_INPUTS])
    result = subprocess.run(
        [sys.executable, "-c", ALL_AT_ONCE, argvs], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return [tuple(answer) for answer in json.loads(result.stdout.splitlines()[-1])]


@pytest.mark.parametrize("index", range(len(WRONG_INPUTS)), ids=lambda i: WRONG_INPUTS[i][1])
def test_wrong_input_exits_2_naming_the_problem(answers_to_wrong_inputs, index):
    status, stderr = answers_to_wrong_inputs[index]
    assert status == 2, stderr
    assert WRONG_INPUTS[index][1] in stderr


def test_a_wrong_input_in_a_process_of_its_own_exits_2_naming_it():
    """What the rest check in one interpreter, through the command line itself."""
    result = run_tandem("generate", "--prompt", "hi", "--max-tokens", "-1")
    assert result.returncode == 2 and "max_tokens" in result.stderr


def test_environment_variables_are_checked_too():
    import os

    result = run_tandem("scheduler", env={**os.environ, "TANDEM_MAX_QUEUED_REQUESTS": "lots"})
    assert result.returncode == 2
    assert "TANDEM_MAX_QUEUED_REQUESTS" in result.stderr
