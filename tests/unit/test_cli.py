"""The `tandem` command refuses wrong input with a clear message and exit status 2."""

import subprocess
import sys

import pytest


def tandem(*argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "services.commands.cli", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )


FP16_F16 = ["--quantization", "fp16", "--dtype", "float16"]  # a float16 copy of float16: no


@pytest.mark.parametrize(
    "argv,needle",
    [
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
        (["frobnicate"], "invalid choice"),
    ],
)
def test_wrong_input_exits_2_naming_the_problem(argv, needle):
    result = tandem(*argv)
    assert result.returncode == 2, result.stderr
    assert needle in result.stderr


def test_environment_variables_are_checked_too():
    import os

    result = tandem("scheduler", env={**os.environ, "TANDEM_MAX_QUEUED_REQUESTS": "lots"})
    assert result.returncode == 2
    assert "TANDEM_MAX_QUEUED_REQUESTS" in result.stderr
