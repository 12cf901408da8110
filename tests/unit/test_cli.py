"""The `tandem` command refuses wrong input with a clear message and exit status 2."""

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from services.worker.config import WorkerConfig
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
    (["generate", "--prompt", "hi", "--threads", "0"], "--threads: must be greater than 0"),
    (["generate", "--prompt", "hi", "--threads", "two"], "--threads: expected an integer"),
    # (The gateway refuses it in a request; here it was a traceback once the text was made.)
    (["generate", "--prompt", "hi", "--stop", ""], "--stop: a stop string must not be empty"),
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


class _RecordedChild:
    """Stands in for a child process of `tandem up`: alive, with nothing to say."""

    stdout = None

    def poll(self):
        return None


def _spawned_argvs(monkeypatch, argv: list[str], environ: dict[str, str]) -> dict[str, list]:
    """Each child `tandem up` would start (name -> argv), none of them started."""
    return {child.name: child.argv for child in _spawned(monkeypatch, argv, environ)}


def _spawned(monkeypatch, argv: list[str], environ: dict[str, str]) -> list:
    """The children `tandem up` would start, none of them started."""
    from services.commands import up

    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(up, "resolve_model", lambda model: (Path(model), model))
    monkeypatch.setattr(WorkerConfig, "check_kv_budget", lambda self: None)  # (no such model)
    monkeypatch.setattr(up.LocalCluster, "_popen", lambda self, argv, env: _RecordedChild())
    monkeypatch.setattr(up.LocalCluster, "_pump_logs", lambda self, child: None)
    return _start_up(_up_args(argv)).children


def _up_args(argv: list[str]):
    from services.commands import cli

    return cli.build_parser(["up"]).parse_args(["up", *argv, *FREE_PORT])


def _start_up(args):
    """`LocalCluster.start`, its run directory removed after."""
    from services.commands import up

    cluster = up.LocalCluster(args, echo_logs=False)
    try:
        cluster.start()
    finally:
        shutil.rmtree(cluster.run_dir, ignore_errors=True)
    return cluster


def test_up_gives_its_batch_service_a_key_the_gateway_takes(monkeypatch):
    """With API keys in the environment the gateway demanded one of the batch service, which
    had none: every line of every job was refused (401)."""
    from services.gateway.auth import ApiKeys

    keys = "k" * 20 + "=alpha"
    children = {c.name: c for c in _spawned(monkeypatch, [], {"TANDEM_API_KEYS": keys})}
    batch_key = children["batch"].env["TANDEM_API_KEY"]
    listed = children["gateway"].env["TANDEM_API_KEYS"].split(",")
    assert listed[0] == keys and batch_key in listed  # a bare key: lines name their owner
    gateway_keys = ApiKeys.load(listed, None)
    assert gateway_keys.check(batch_key).tenant is None
    assert gateway_keys.check("k" * 20).tenant == "alpha"


def test_up_leaves_a_batch_key_given_and_clusters_without_keys_alone(monkeypatch):
    given = {"TANDEM_API_KEYS": "k" * 20 + "," + "b" * 20, "TANDEM_API_KEY": "b" * 20}
    for environ in ({}, given):
        children = {c.name: c for c in _spawned(monkeypatch, [], environ)}
        assert children["gateway"].env == {} and children["batch"].env == {}


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_up_takes_the_model_from_tandem_model(monkeypatch):
    """The workers read TANDEM_MODEL; `tandem up` passed its own default over it as --model,
    so the cluster served smollm2 to a user who had exported another model."""
    argvs = _spawned_argvs(monkeypatch, [], {"TANDEM_MODEL": "/models/other"})
    for name in ("scheduler", "prefill-0", "decode-0", "gateway"):
        assert _flag(argvs[name], "--model") == "/models/other", name


def test_up_model_flag_beats_tandem_model(monkeypatch):
    argvs = _spawned_argvs(monkeypatch, ["--model", "/models/flag"], {"TANDEM_MODEL": "/x"})
    assert _flag(argvs["prefill-0"], "--model") == "/models/flag"


@pytest.mark.parametrize(
    "argv,environ,needle",
    [
        (
            ["--kv-cache-bytes", "0"],
            {},
            "kv_cache_bytes (--kv-cache-bytes / TANDEM_KV_CACHE_BYTES)",
        ),
        (["--kv-cache-bytes", "1000"], {}, "holds no block of 16 tokens"),
        (["--max-num-seqs", "0"], {}, "max_num_seqs"),
        ([], {"TANDEM_BLOCK_SIZE": "big"}, "TANDEM_BLOCK_SIZE: expected an integer"),
        ([], {"TANDEM_SWAP_BYTES": "-1"}, "swap_bytes"),
        (["--generation-config", "/no/such.json"], {}, "--generation-config: generation config"),
    ],
)
def test_up_refuses_worker_settings_before_starting_anything(monkeypatch, argv, environ, needle):
    """Each worker (the gateway: its --generation-config) refused them itself, after the others
    had started: the cluster stopped with "exited during start-up" (status 1), its reason in a
    child's log lines."""
    from services.commands import up
    from shared.config import ConfigError

    started = []
    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, argv: started.append(name))
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _start_up(_up_args(argv))
    assert started == []


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("TANDEM_DEFAULT_SAMPLING", "heat=1", "'heat' is not a sampling field"),
        ("TANDEM_API_KEYS_FILE", "/no/such/keys", "/no/such/keys"),
        ("TANDEM_MAX_BODY_BYTES", "0", "max_body_bytes"),
        ("TANDEM_HEARTBEAT_TIMEOUT_S", "0", "heartbeat_timeout_s"),
        ("TANDEM_MAX_LINES", "0", "max_lines"),
    ],
)
def test_up_refuses_the_other_services_settings_before_starting_anything(
    monkeypatch, name, value, needle
):
    """The gateway's, the scheduler's and the batch service's TANDEM_ variables, which reach
    them: each one refused its own, after the workers had started loading the model, and the
    cluster stopped with "exited during start-up" (status 1), its reason among the logs."""
    from services.commands import up
    from shared.config import ConfigError

    started = []
    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, *_: started.append(name))
    monkeypatch.setattr(up, "resolve_model", lambda model: (Path(model), model))
    monkeypatch.setattr(WorkerConfig, "check_kv_budget", lambda self: None)  # (no such model)
    monkeypatch.setattr(up, "model_sampling_defaults", lambda *args: {})
    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        _start_up(_up_args([]))
    assert started == []


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_up_refuses_a_ready_timeout_that_is_not_a_positive_number(monkeypatch, value):
    """nan or 0 gave up at once: "the cluster was not ready within nan s" (status 1)."""
    from services.commands import up
    from shared.config import ConfigError

    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, argv: pytest.fail(name))
    with pytest.raises(ConfigError, match="--ready-timeout must be > 0"):
        _start_up(_up_args(["--ready-timeout", value]))


def test_up_reaches_an_ipv6_gateway_at_a_url_with_brackets():
    """`--host ::1` made http://::1:8000, which reaches no one: the ready check waited out its
    --ready-timeout (300 s) and the banner printed a URL no client could use."""
    from services.commands import up

    for host, url in (("::1", "http://[::1]:{}"), ("127.0.0.1", "http://127.0.0.1:{}")):
        cluster = up.LocalCluster(_up_args(["--host", host]))
        shutil.rmtree(cluster.run_dir)
        assert cluster.url == url.format(cluster.args.port)


def test_a_signal_during_a_childs_spawn_waits_until_the_child_is_listed(monkeypatch):
    """SIGTERM as a child is forked: the stop must know that child. The signals were blocked
    around the fork, which held nothing off once a log thread ran (the kernel gave the signal to
    that thread, and Python ran the handler in the main thread all the same, inside the fork's
    Popen): the child ran on behind a stopped cluster."""
    from services.commands import up

    cluster = up.LocalCluster(_up_args([]), echo_logs=False)
    shutil.rmtree(cluster.run_dir, ignore_errors=True)
    log_thread_done = threading.Event()
    log_thread = threading.Thread(target=log_thread_done.wait)  # as a running child's log pump
    log_thread.start()

    def popen_signalled(self, argv, env):
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)  # the handler runs here, mid-spawn
        return _RecordedChild()

    monkeypatch.setattr(up.LocalCluster, "_popen", popen_signalled)
    monkeypatch.setattr(up.LocalCluster, "_pump_logs", lambda self, child: None)
    previous = signal.signal(signal.SIGTERM, cluster.interrupts.handler)
    try:
        with pytest.raises(up.Interrupted, match="SIGTERM"):
            cluster._spawn("scheduler", ["scheduler"])
        assert [child.name for child in cluster.children] == ["scheduler"]
        with pytest.raises(up.Interrupted):  # outside a spawn: at once
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
        log_thread_done.set()
        log_thread.join()


def test_up_asks_its_own_gateway_when_a_proxy_is_set(monkeypatch):
    """The ready check went through `http_proxy` (urllib's default), which cannot reach this
    machine's loopback gateway: behind a proxy `tandem up` waited out --ready-timeout and
    stopped a cluster that was ready all along."""
    import http.server

    from services.commands import up

    class ReadyGateway(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - the base class's name
            body = json.dumps({"ready": True, "prefill_workers": 1, "decode_workers": 1})
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *args):
            pass

    gateway = http.server.ThreadingHTTPServer(("127.0.0.1", 0), ReadyGateway)
    threading.Thread(target=gateway.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("http_proxy", "http://127.0.0.1:9")  # (the discard port: no one)
        monkeypatch.delenv("no_proxy", raising=False)
        monkeypatch.delenv("NO_PROXY", raising=False)
        args = _up_args([])
        args.port = gateway.server_address[1]
        cluster = up.LocalCluster(args, echo_logs=False)
        shutil.rmtree(cluster.run_dir, ignore_errors=True)
        cluster.wait_ready(timeout_s=3)
    finally:
        gateway.shutdown()


def test_up_splits_the_cores_this_process_may_run_on_between_the_workers(monkeypatch):
    """The machine's count (os.cpu_count), not the cores `tandem up` may run on (taskset, a
    container's cpuset): on 2 of 64 cores each of 2 workers ran 32 torch threads on 2 cores."""
    from services.commands import up

    monkeypatch.setattr(up.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(up.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    argvs = _spawned_argvs(monkeypatch, [], {})
    assert _flag(argvs["prefill-0"], "--threads") == "2"
    assert _flag(argvs["decode-0"], "--threads") == "2"


def test_generate_runs_on_the_threads_it_is_given(tmp_path, capsys, monkeypatch):
    """On a machine other work shares, torch's one thread per core ran `tandem generate` 7.5x
    slower than one thread (32 tokens: 40 s against 5.3 s); workers and benches had
    `--threads`, generate had not."""
    import torch

    from services.commands.cli import main
    from shared.engine.model_files import resolve_model_dir
    from tests.helpers import tiny_hf_model

    tiny_hf_model("llama", seed=1, vocab_size=49152).save_pretrained(tmp_path)  # (SmolLM2's)
    real_dir, _ = resolve_model_dir()
    shutil.copy(real_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    threads: list[int] = []
    monkeypatch.setattr(torch, "set_num_threads", threads.append)
    argv = ["generate", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2"]
    assert main([*argv, "--threads", "1"]) == 0
    assert threads == [1]


def test_generate_chat_with_a_model_without_a_chat_template_exits_2(tmp_path, capsys):
    """transformers' ValueError, a traceback after the model's load; the gateway answers 400."""
    from services.commands.cli import main
    from shared.engine.model_files import resolve_model_dir
    from tests.helpers import tiny_hf_model

    tiny_hf_model("llama", seed=1).save_pretrained(tmp_path)
    real_dir, _ = resolve_model_dir()
    shutil.copy(real_dir / "tokenizer.json", tmp_path / "tokenizer.json")  # (no template file)
    shutil.copy(real_dir / "tokenizer_config.json", tmp_path / "tokenizer_config.json")
    argv = ["generate", "--chat", "--model", str(tmp_path), "--prompt", "hi", "--max-tokens", "2"]
    assert main(argv) == 2
    assert "--chat: this model has no chat template" in capsys.readouterr().err


def test_up_refuses_a_batch_dir_it_cannot_make_before_starting_anything(monkeypatch, tmp_path):
    """The batch service refused it itself, started last: the cluster stopped with "exited
    during start-up: batch" (status 1), the reason among the children's log lines."""
    from services.commands import up
    from shared.config import ConfigError

    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, argv: pytest.fail(name))
    a_file = tmp_path / "jobs"
    a_file.write_text("not a directory")
    with pytest.raises(ConfigError, match="--batch-dir"):
        _start_up(_up_args(["--batch-dir", str(a_file)]))
    with pytest.raises(ConfigError, match="--batch-dir"):
        _start_up(_up_args(["--batch-dir", str(a_file / "under")]))
    # (`--batch-dir "$JOBS"`, unset: the jobs went into the run directory, removed at exit)
    with pytest.raises(ConfigError, match="--batch-dir is given but empty"):
        _start_up(_up_args(["--batch-dir", ""]))


def test_up_refuses_one_port_for_both_http_and_rpc_before_starting_anything(monkeypatch):
    """Each was free when checked, so the workers loaded the model before the gateway, its
    HTTP server holding the port, failed to bind its RPC front door: "exited during start-up:
    gateway" (status 1) a minute later."""
    from services.commands import up
    from shared.config import ConfigError

    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, argv: pytest.fail(name))
    args = _up_args([])
    args.rpc_port = args.port
    with pytest.raises(ConfigError, match="--rpc-port .* --port"):
        _start_up(args)


def test_up_banner_asks_for_the_model_by_the_name_the_gateway_serves(monkeypatch):
    """The gateway serves a directory by its last part (a .gguf by its stem), and refuses any
    other `model` (404): the banner's example request named the --model path, and failed."""
    from services.commands import up

    monkeypatch.setattr(up, "resolve_model", lambda model: (Path(model), Path(model).name))
    monkeypatch.setattr(WorkerConfig, "check_kv_budget", lambda self: None)  # (no such model)
    monkeypatch.setattr(up.LocalCluster, "_popen", lambda self, argv, env: _RecordedChild())
    monkeypatch.setattr(up.LocalCluster, "_pump_logs", lambda self, child: None)
    cluster = _start_up(_up_args(["--model", "/models/tiny-llama"]))
    assert '"model": "tiny-llama"' in up._banner(cluster)


def _unreadable_models(directory: Path) -> dict[str, Path]:
    """A model path of each kind that exists and is no model tandem can read."""
    not_gguf = directory / "notes.gguf"
    not_gguf.write_text("not a GGUF file")
    bad_json = directory / "bad-json"
    bad_json.mkdir()
    (bad_json / "config.json").write_text("{")
    other_type = directory / "phi3"
    other_type.mkdir()
    (other_type / "config.json").write_text(json.dumps({"model_type": "phi3"}))
    return {"not_gguf": not_gguf, "bad_json": bad_json, "other_type": other_type}


@pytest.mark.parametrize("kind", ["not_gguf", "bad_json", "other_type"])
def test_up_refuses_a_model_it_cannot_read_in_one_line(monkeypatch, tmp_path, kind):
    """Each was a traceback (transformers' ValueError or OSError, the model type's refusal)."""
    from services.commands import up
    from shared.config import ConfigError

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(up.LocalCluster, "_spawn", lambda self, name, argv: pytest.fail(name))
    model = _unreadable_models(tmp_path)[kind]
    with pytest.raises(ConfigError, match=f"--model {re.escape(str(model))}: "):
        _start_up(_up_args(["--model", str(model)]))


def test_prepare_refuses_a_file_that_is_no_gguf_in_one_line(monkeypatch, tmp_path, capsys):
    from services.commands.cli import main

    monkeypatch.setenv("TANDEM_CACHE_DIR", str(tmp_path / "cache"))
    assert main(["prepare", "--model", str(_unreadable_models(tmp_path)["not_gguf"])]) == 2
    assert "GGUF" in capsys.readouterr().err


@pytest.mark.parametrize("kind", ["bad_json", "other_type"])
def test_generate_refuses_a_model_it_cannot_read_in_one_line(monkeypatch, tmp_path, kind, capsys):
    from services.commands.cli import main

    model = str(_unreadable_models(tmp_path)[kind])
    assert main(["generate", "--prompt", "hi", "--model", model]) == 2
    assert f"tandem generate: error: --model {model}: " in capsys.readouterr().err


LEFT_BY_ITS_READER = """
import sys
from services.commands import cli, keys

def endless(args):
    for i in range(10_000_000):
        print("a line of output", i)

keys.run = endless
sys.exit(cli.main(["keys", "--dir", sys.argv[1]]))
"""


def test_a_command_whose_reader_leaves_or_is_interrupted_ends_without_a_traceback(
    tmp_path, monkeypatch, capsys
):
    """`tandem batch download ID | head`, Ctrl-C in `tandem generate`: Python tracebacks."""
    import subprocess
    import sys

    from services.commands import cli, keys

    pipeline = subprocess.run(
        f"{sys.executable} -c '{LEFT_BY_ITS_READER}' {tmp_path} | head -n 1",
        shell=True,
        capture_output=True,
        text=True,
        timeout=60,
        executable="/bin/bash",
    )
    assert pipeline.stdout == "a line of output 0\n"
    assert "Traceback" not in pipeline.stderr and "BrokenPipe" not in pipeline.stderr

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(keys, "run", interrupted)
    assert cli.main(["keys", "--dir", str(tmp_path)]) == 130
    assert "tandem keys: interrupted" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["bench", "batch", "keys"])
def test_a_subcommands_help_keeps_its_example_lines(command, monkeypatch):
    """The examples in a subcommand's docstring (an indented block) print one per line, as
    written; argparse's filling ran them together into the paragraph around them. The prose
    is still filled to the terminal's width."""
    from services.commands import cli

    parser = cli.build_parser([command])
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    subparser = subparsers.choices[command]
    monkeypatch.setenv("COLUMNS", "80")  # (argparse reads it as it formats)
    help_text = subparser.format_help()
    examples = [line for line in subparser.description.splitlines() if line.startswith("    ")]
    assert examples
    for example in examples:
        assert example in help_text.splitlines()
    prose = [line for line in help_text.splitlines() if not line.startswith(" ")]
    assert max(map(len, prose)) <= 80
