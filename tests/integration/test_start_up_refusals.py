"""Start-up failures through the `tandem` command itself, on real sockets: an address or port
another program holds is one line naming the setting and exit status 2, never a traceback (nor,
for `tandem up`, a cluster taken to be ready because someone else answered on its port)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers import TINY_LLAMA, free_port, run_tandem, wait_for_line

# (The default --port, 8000, is checked first: a free one, whatever else runs here.)
FREE_PORT = ["--port", free_port()]


def assert_refused_in_one_line(result: subprocess.CompletedProcess, *needles: str) -> None:
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    said = [line for line in result.stderr.splitlines() if line.startswith("tandem ")]
    assert len(said) == 1, result.stderr
    for needle in needles:
        assert needle in said[0], said[0]


def test_the_scheduler_refuses_an_address_in_use(taken_port):
    result = run_tandem("scheduler", "--address", f"tcp://127.0.0.1:{taken_port}")
    assert_refused_in_one_line(
        result, "--address / TANDEM_ADDRESS", f"tcp://127.0.0.1:{taken_port}", "in use"
    )


def test_the_scheduler_refuses_a_metrics_port_in_use(taken_port, tmp_path):
    result = run_tandem(
        "scheduler",
        "--address",
        f"ipc://{tmp_path}/scheduler.sock",
        "--metrics-port",
        str(taken_port),
    )
    assert_refused_in_one_line(result, "--metrics-port", f"127.0.0.1:{taken_port}", "in use")


def test_the_gateway_refuses_a_port_in_use_before_loading_anything(taken_port, tmp_path):
    """uvicorn's bind came after "gateway ready" was logged, then exit status 3."""
    result = run_tandem(
        "gateway",
        "--port",
        str(taken_port),
        "--model",
        "/no/such/model",  # refused first, it would say so instead
        "--stream-address",
        f"ipc://{tmp_path}/stream.sock",
    )
    assert_refused_in_one_line(result, "--port", f"127.0.0.1:{taken_port}", "in use")


def test_the_gateway_refuses_a_stream_address_in_use(taken_port):
    """Bound in the web server's start-up, it was a traceback there."""
    result = run_tandem(
        "gateway", "--stream-address", f"tcp://127.0.0.1:{taken_port}", "--model", "/no/such",
        *FREE_PORT,
    )  # fmt: skip
    assert_refused_in_one_line(result, "--stream-address", "in use")


@pytest.mark.parametrize("flag", ["--port", "--rpc-port"])
def test_up_refuses_a_port_in_use_before_starting_anything(taken_port, flag):
    """Its ready check asked whoever answered on --port: an earlier cluster still running was
    taken for this one's gateway (which was failing to bind behind it). `--model /no/such`
    would be refused next: a cluster is never started here."""
    free = FREE_PORT if flag != "--port" else []
    result = run_tandem("up", flag, str(taken_port), "--model", "/no/such", *free)
    assert_refused_in_one_line(result, flag, f"127.0.0.1:{taken_port}", "in use")


def test_up_refuses_rpc_port_0():
    """0 read as "no RPC port" (a falsy check), where every other port setting's 0 is "any
    free one": neither could be told to a client, so it is refused."""
    result = run_tandem("up", "--rpc-port", "0", "--model", "/no/such", *FREE_PORT)
    assert_refused_in_one_line(result, "--rpc-port must be a port in [1, 65535], got 0")


def test_up_refuses_a_host_that_does_not_resolve_before_starting_anything():
    """The port check let a name it could not resolve through: the children started, each
    refused the name on its own, and `tandem up` said "exited during start-up: scheduler"
    (status 1), the reason in the scheduler's log lines."""
    result = run_tandem("up", "--host", "no-such-host.invalid", "--model", "/no/such", *FREE_PORT)
    assert_refused_in_one_line(result, "--host", "no-such-host.invalid")


def test_the_gateway_refuses_a_host_that_does_not_resolve():
    """The port check let it through: the gateway logged "gateway ready", then uvicorn exited
    3 with "ERROR: [Errno -2] Name or service not known"."""
    result = run_tandem(
        "gateway", "--host", "no-such-host.invalid", "--model", "/no/such", *FREE_PORT
    )
    assert_refused_in_one_line(result, "--host", "'no-such-host.invalid' resolves to no address")


def unreadable_model(kind: str, directory) -> str:
    """A --model tandem cannot read: a .gguf that is none, a config.json that is not JSON, or
    one of a model type not served (GPT-2's names its fields otherwise)."""
    if kind == "not-gguf":
        path = directory / "model.gguf"
        path.write_text("not a GGUF file")
        return str(path)
    if kind == "awq":  # a Llama the forward would serve, but quantized: refused by from_hf
        quantized = {
            "model_type": "llama",
            **TINY_LLAMA,
            "quantization_config": {"quant_method": "awq"},
        }
        (directory / "config.json").write_text(json.dumps(quantized))
        return str(directory)
    (directory / "config.json").write_text(
        "{not json" if kind == "not-json" else '{"model_type": "gpt2", "n_layer": 2}'
    )
    return str(directory)


@pytest.mark.parametrize(
    "service,kind",
    [("gateway", "not-gguf"), ("prefill", "not-json"), ("decode", "gpt2"), ("prefill", "awq")],
)
def test_a_standalone_service_refuses_a_model_it_cannot_read(service, kind, tmp_path):
    """`tandem up` and `tandem prepare` refused them in one line; a service started alone
    printed transformers' traceback (an AttributeError for GPT-2's config)."""
    model = unreadable_model(kind, tmp_path)
    places = {
        "gateway": ["--stream-address", f"ipc://{tmp_path}/stream.sock", *FREE_PORT],
        "prefill": ["--address", f"ipc://{tmp_path}/prefill.sock"],
        "decode": ["--address", f"ipc://{tmp_path}/decode.sock"],
    }
    environ = dict(os.environ, TANDEM_CACHE_DIR=str(tmp_path / "cache"))
    result = run_tandem(service, "--model", model, *places[service], env=environ)
    assert_refused_in_one_line(result, f"--model {model}: ")


def test_an_unknown_log_level_stops_the_service_with_status_2(tmp_path):
    environ = dict(os.environ, TANDEM_LOG_LEVEL="trace")
    result = run_tandem("scheduler", "--address", f"ipc://{tmp_path}/s.sock", env=environ)
    assert_refused_in_one_line(result, "TANDEM_LOG_LEVEL", "'trace'")


def test_the_scheduler_makes_its_ipc_directory(tmp_path):
    """The default addresses live in /tmp/tandem, which nothing made: `tandem scheduler` died
    on a ZMQError traceback."""
    address = f"ipc://{tmp_path}/run/tandem/scheduler.sock"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "scheduler", "--address", address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, TANDEM_LOG_FORMAT="json"),
    )
    try:
        wait_for_line(process, b"scheduler listening", "the scheduler")
        assert (tmp_path / "run" / "tandem" / "scheduler.sock").exists()
    finally:
        process.terminate()
        process.wait(30)
