"""The operator's commands (`tandem generate`, `up`, `batch`, ...): bugs found in review."""

import json
import shutil
import subprocess
import sys
import time

import pytest

from tests.helpers import tiny_hf_model


def _tiny_model_with_the_real_tokenizer(directory):
    """A tiny random llama (context 512) that reads the default model's tokenizer."""
    from shared.engine.model_files import resolve_model_dir

    tiny_hf_model("llama", seed=1, vocab_size=49152).save_pretrained(directory)
    real_dir, _ = resolve_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(real_dir / name, directory / name)
    return str(directory)


def test_generate_serves_a_request_as_long_as_the_models_context(tmp_path, monkeypatch, capsys):
    """The KV pool was a fixed 256 MiB: about 5,800 tokens of the default model in float32 and
    1,000 of an 8B model, so a prompt plus --max-tokens well within the model's context (which
    the cluster serves) was refused: "can never fit the KV cache". Here a budget that holds 4
    blocks stands for such a model."""
    from services.commands.cli import main
    from shared.engine import engine

    model = _tiny_model_with_the_real_tokenizer(tmp_path)
    monkeypatch.setattr(engine, "num_blocks_for_budget", lambda *args: 4)  # 64 tokens
    argv = ["generate", "--model", model, "--prompt", "hi", "--max-tokens", "100"]
    assert main([*argv, "--ignore-eos", "--json"]) == 0, capsys.readouterr().err
    assert len(json.loads(capsys.readouterr().out)["token_ids"]) == 100


def test_generate_still_refuses_a_request_past_the_models_context(tmp_path, capsys):
    """(Sized to the request, the pool is capped at the context: no huge allocation first.)"""
    from services.commands.cli import main

    model = _tiny_model_with_the_real_tokenizer(tmp_path)
    assert main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", str(10**12)]) == 2
    assert main(["generate", "--model", model, "--prompt", "hi", "--max-tokens", "600"]) == 2
    assert "exceeds the model's context of 512 tokens" in capsys.readouterr().err


class _SlowStderr:
    """A terminal or a pipe that takes its time (`tandem up 2>&1 | tee up.log`)."""

    def __init__(self):
        self.lines = []

    def write(self, text):
        time.sleep(0.0005)
        self.lines.append(text)

    def flush(self):
        pass


def test_up_shows_the_last_lines_of_a_child_that_exits_during_start_up(monkeypatch):
    """A child's last lines (a traceback's, the reason) could still be in its pipe when the
    ready check saw it dead: `tandem up` printed "exited during start-up", stopped and exited,
    its log threads (daemons) with them, and the reason was never shown."""
    from services.commands import cli, up

    args = cli.build_parser(["up"]).parse_args(["up"])
    cluster = up.LocalCluster(args, echo_logs=True)
    shutil.rmtree(cluster.run_dir, ignore_errors=True)
    script = "for i in range(2000): print('starting', i)\nprint('the reason')\nraise SystemExit(3)"
    process = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )
    process.wait()  # (all of it in the pipe: 20 KB)
    stderr = _SlowStderr()
    monkeypatch.setattr(sys, "stderr", stderr)
    child = up.Child("scheduler", [], process)
    cluster.children.append(child)
    cluster._pump_logs(child)
    with pytest.raises(RuntimeError, match="exited during start-up: scheduler"):
        cluster.wait_ready(timeout_s=5)
    assert stderr.lines[-1:] == ["[scheduler] the reason\n"]


def test_up_lets_a_gateway_given_a_longer_drain_finish_it():
    """`tandem up` killed its children 10 s after SIGTERM whatever the gateway's drain: one
    given TANDEM_SHUTDOWN_GRACE_S=20 had its streams torn halfway through their grace."""
    from services.commands import up

    gateway = ["gateway", "--scheduler-address", "ipc:///tmp/s", "--stream-address", "ipc:///tmp/t"]
    config = up._check_service_settings(gateway, {"TANDEM_SHUTDOWN_GRACE_S": "20"})
    assert config.shutdown_grace_s == 20
    assert up.stop_grace_for(config) == 20 + up.GATEWAY_EXIT_S
    default = up._check_service_settings(gateway, {})
    assert up.stop_grace_for(default) == up.STOP_GRACE_S  # (5 s of drain fits the 10 s)
    assert default.shutdown_grace_s + up.GATEWAY_EXIT_S <= up.STOP_GRACE_S


def test_up_stops_its_children_after_its_own_grace(monkeypatch):
    from services.commands import cli, up

    args = cli.build_parser(["up"]).parse_args(["up"])
    cluster = up.LocalCluster(args, echo_logs=False, stop_grace_s=0.5)
    stubborn = "import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(30)"
    process = subprocess.Popen([sys.executable, "-c", stubborn])
    time.sleep(0.5)  # (its handler set)
    cluster.children.append(up.Child("gateway", [], process))
    start = time.monotonic()
    cluster.stop()
    assert time.monotonic() - start < 5 and process.returncode == -9
