"""`tandem up`: a whole local cluster as child processes, ready when this prints its URL.

One scheduler, one gateway, N prefill and M decode workers, talking over ipc:// sockets in a
private run directory. The cores it may run on are split between the workers (torch threads). Each
child's log lines are streamed with its name in front. A child that dies is started again (it
registers anew; the requests it held are resumed elsewhere); one in a crash loop, dead
`MAX_RESTARTS` times in a row each time within `STABLE_RUN_S` of its start, is left stopped if
it is a worker with a peer of its role still running, and stops the cluster otherwise.
Ctrl-C or SIGTERM stops the children in `STOP_FIRST`'s order (each stage SIGTERM, then SIGKILL
after a grace period): the gateway drains its requests under way while the scheduler and workers
still serve them. Then the run directory is removed (one a SIGKILL left behind goes at the next
start: `make_run_dir`); the children also get SIGTERM from the kernel if this process dies
(PR_SET_PDEATHSIG), so no orphan survives it.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.batch.service import BatchServiceConfig
from services.commands.prepare import resolve_model
from services.gateway.chat_prompt import read_chat_template
from services.gateway.service import STREAM_END_S, GatewayConfig
from services.scheduler.service import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.binding import check_tcp_port, host_port
from shared.config import ConfigError, add_config_arguments, config_from_args, usable_cores
from shared.endpoints import tcp_address
from shared.engine.loader import (
    DEVICE_HELP,
    DTYPE_CHOICES,
    DTYPE_HELP,
    QUANTIZATION_CHOICES,
    QUANTIZATION_HELP,
    device_argument,
)
from shared.engine.model_files import DEFAULT_MODEL
from shared.engine.sampling_defaults import model_sampling_defaults, parse_default_sampling
from shared.env_names import unread_names
from shared.logs import log_settings

PR_SET_PDEATHSIG = 1
# The ready check asks this machine's gateway itself: through `http_proxy`, as urllib's default
# opener goes, it asked a proxy that cannot reach our loopback, until --ready-timeout ran out.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))
MAX_RESTARTS = 5  # per child, in a row; past it the child is broken (`LocalCluster.leave_stopped`)
# A child that ran this long since its start is not in a crash loop: its restarts count from 0
# again. The loops seen died within seconds (a setting refused at start, a poison request
# resumed onto the restarted worker as soon as it registered); a minute is far past those, and
# far short of the time between unrelated deaths (a scheduler killed once a minute, a worker
# crashing now and then over a week), which, counted over the cluster's life, stopped it.
STABLE_RUN_S = 60.0
LOG_DRAIN_S = 5.0  # how long an exited child's last log lines may take to be echoed
STOP_GRACE_S = 10.0  # the children's time to end, at least, before the stop kills them
# A draining gateway's exit past its grace: its 503s sent (`STREAM_END_S`), its link closed,
# the interpreter's exit (about 1.7 s measured).
GATEWAY_EXIT_S = STREAM_END_S + 3.0
# Stopped one after the other, each waited for, before the rest (scheduler, workers) together:
# the gateway's drain lets requests under way finish, which needs the scheduler and workers
# (and the batch service, for the uploads and batch calls it relays). Stopped all at once, the
# rest were gone in 0.1 s and every stream ended "ran past its grace" with no token more.
STOP_FIRST = ("gateway", "batch")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, default=8000, help="the gateway's HTTP port")
    parser.add_argument("--host", default="127.0.0.1", help="the gateway's HTTP host")
    parser.add_argument("--prefill", type=int, default=1, help="number of prefill workers")
    parser.add_argument("--decode", type=int, default=1, help="number of decode workers")
    parser.add_argument(
        "--model",
        # Read here as the workers read it: a --model passed to them would beat their TANDEM_MODEL.
        default=os.environ.get("TANDEM_MODEL") or DEFAULT_MODEL,
        help="a HF directory, a .gguf file, or 'smollm2' (default: TANDEM_MODEL, else smollm2)",
    )
    parser.add_argument("--kv-cache-bytes", type=int, default=512 << 20, help="per worker")
    parser.add_argument(
        "--dtype",
        default=None,
        choices=DTYPE_CHOICES,
        help=f"{DTYPE_HELP} (default: TANDEM_DTYPE, else auto)",
    )
    parser.add_argument(
        "--quantization",
        default=None,
        choices=QUANTIZATION_CHOICES,
        help=f"{QUANTIZATION_HELP} (default: TANDEM_QUANTIZATION, else none)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        type=device_argument,
        help=f"{DEVICE_HELP}; every worker shares it (cuda: one GPU)",
    )
    parser.add_argument("--max-num-seqs", type=int, default=64, help="per decode worker")
    parser.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="decode workers replay decode steps from CUDA graphs (needs --device cuda)",
    )
    parser.add_argument("--rpc-port", type=int, default=None, help="RPC front door TCP port")
    parser.add_argument(
        "--default-sampling",
        default=None,
        help="defaults for sampling fields a request leaves unset, over the model's own "
        "(e.g. temperature=0.7,top_p=0.9)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        help="where the model's own sampling defaults come from: auto (its "
        "generation_config.json), none, or a path",
    )
    parser.add_argument(
        "--chat-template",
        default=None,
        help="a Jinja chat template file for the gateway, instead of the model's",
    )
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument(
        "--batch-dir",
        default=None,
        help="the batch service's database and files (default: inside the run directory, "
        "removed at exit: give one to keep jobs across restarts of `tandem up`)",
    )
    parser.add_argument(
        "--no-batch", action="store_true", help="no batch service (/v1/files, /v1/batches: 404)"
    )


RUN_DIR_PREFIX = "tandem-"
OWNER_FILE = "owner.pid"  # in a run directory: the process that made it, which removes it


def make_run_dir() -> str:
    """A private run directory (the sockets; the batch service's data unless --batch-dir), its
    owner's pid in it. A `tandem up` killed with SIGKILL cannot remove its own: they stayed in
    the temporary directory for good, so each start removes those whose owner is dead."""
    remove_dead_run_dirs(Path(tempfile.gettempdir()))
    run_dir = tempfile.mkdtemp(prefix=RUN_DIR_PREFIX)
    Path(run_dir, OWNER_FILE).write_text(str(os.getpid()))
    return run_dir


def remove_dead_run_dirs(parent: Path) -> list[Path]:
    """Removes this user's run directories under `parent` whose owner is dead; those removed.
    One without an owner file (not made by `make_run_dir`) is left alone."""
    removed = []
    for path in parent.glob(f"{RUN_DIR_PREFIX}*"):
        try:
            mine = path.stat().st_uid == os.getuid()
            pid = int((path / OWNER_FILE).read_text())
        except (OSError, ValueError):
            continue
        if mine and not _alive(pid):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's: alive)
        return True
    return True


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen
    log_thread: threading.Thread | None = None
    restarts: int = 0  # in a row, each soon after its start (`STABLE_RUN_S`)
    env: dict[str, str] = field(default_factory=dict)  # beyond this process's environment
    started_at: float = field(default_factory=time.monotonic)  # its process's, time.monotonic
    given_up: bool = False  # past its restarts, left stopped: the cluster serves without it


@dataclass
class LocalCluster:
    """The children of one `tandem up`; also used by the end-to-end tests."""

    args: argparse.Namespace
    run_dir: str = field(default_factory=make_run_dir)
    children: list[Child] = field(default_factory=list)
    # What clients name in `model`: the gateway serves a directory by its last part, a .gguf
    # by its stem (the banner's example named the --model path, which the gateway refused).
    served_model: str | None = None
    echo_logs: bool = True
    interrupts: StartInterrupts = field(default_factory=lambda: StartInterrupts())
    # How long `stop` lets the children end before killing them: the gateway's drain fits.
    stop_grace_s: float = STOP_GRACE_S

    def address(self, name: str) -> str:
        return f"ipc://{self.run_dir}/{name}.sock"

    @property
    def url(self) -> str:
        return f"http://{host_port(self.args.host, self.args.port)}"  # (an IPv6 host in [])

    def start(self) -> None:
        try:  # refused here, before any child starts, rather than by a gateway restarted in vain
            parse_default_sampling(self.args.default_sampling)
        except ValueError as error:
            raise ConfigError(f"--default-sampling: {error}") from None
        if getattr(self.args, "chat_template", None):
            read_chat_template(self.args.chat_template)
        if getattr(self.args, "cuda_graphs", False) and not self.args.device.startswith("cuda"):
            raise ConfigError(f"--cuda-graphs needs --device cuda, got {self.args.device}")
        for role in ("prefill", "decode"):  # a cluster without one serves nothing
            if getattr(self.args, role) < 1:
                raise ConfigError(f"--{role} must be at least 1, got {getattr(self.args, role)}")
        if not 0 < self.args.ready_timeout < math.inf:  # (NaN too) the wait gave up at once
            raise ConfigError(f"--ready-timeout must be > 0 seconds, got {self.args.ready_timeout}")
        log_settings()  # else every child exits on it, and is started again, five times
        self._check_ports()
        if not getattr(self.args, "no_batch", False):
            self._make_batch_dir()
        # (Converts a GGUF once, before the workers race to it.)
        directory, self.served_model = resolve_model(self.args.model)
        name = self.served_model
        try:  # the gateway's, refused here rather than by a gateway started again in vain
            model_sampling_defaults(directory, name == DEFAULT_MODEL, self.args.generation_config)
        except ValueError as error:
            raise ConfigError(f"--generation-config: {error}") from None
        num_workers = self.args.prefill + self.args.decode
        # (The cores this process may run on: a cpuset or taskset gave each worker a share of
        # the machine's count, and the workers' threads fought over the few cores they had.)
        threads = max(1, usable_cores() // num_workers)
        common = ["--scheduler-address", self.address("scheduler")]
        # Every service serves /metrics on a free port; the gateway's /metrics gathers them all.
        metrics = ["--metrics-port", "0", "--metrics-host", self.args.host]
        worker = [
            "--model",
            self.args.model,
            "--threads",
            str(threads),
            "--kv-cache-bytes",
            str(self.args.kv_cache_bytes),
            "--device",
            self.args.device,
            "--max-num-seqs",
            str(self.args.max_num_seqs),
            *metrics,
            *common,
        ]
        if self.args.dtype:  # else each worker's own default (TANDEM_DTYPE, else auto)
            worker += ["--dtype", self.args.dtype]
        if self.args.quantization:  # else TANDEM_QUANTIZATION, else none
            worker += ["--quantization", self.args.quantization]
        _check_worker_settings(worker)
        scheduler = [
            "scheduler",
            "--address",
            self.address("scheduler"),
            "--model",
            self.args.model,
            *metrics,
        ]
        gateway = [
            "gateway",
            "--host",
            self.args.host,
            "--port",
            str(self.args.port),
            "--model",
            self.args.model,
            "--stream-address",
            self.address("gateway-stream"),
            "--generation-config",
            self.args.generation_config,
            *common,
        ]
        if self.args.default_sampling:
            gateway += ["--default-sampling", self.args.default_sampling]
        if getattr(self.args, "chat_template", None):
            gateway += ["--chat-template", os.path.abspath(self.args.chat_template)]
        rpc_address = self.address("gateway-rpc")
        rpc_port = getattr(self.args, "rpc_port", None)
        if rpc_port is not None:
            rpc_address = tcp_address(self.args.host, rpc_port)
        batch = not getattr(self.args, "no_batch", False)
        if rpc_port is not None or batch:
            gateway += ["--rpc-address", rpc_address]
        gateway_env: dict[str, str] = {}
        batch_env: dict[str, str] = {}
        if batch:
            gateway += ["--batch-address", self.address("batch")]
            gateway_env, batch_env = batch_service_key(os.environ)
        batch_argv = self._batch_argv(rpc_address, metrics)
        services = [(scheduler, {}), (gateway, gateway_env)]
        if batch:
            services.append((batch_argv, batch_env))
        for argv, env in services:  # (the workers' were checked above)
            config = _check_service_settings(argv, env)
            if isinstance(config, GatewayConfig):
                self.stop_grace_s = stop_grace_for(config)
        self._spawn("scheduler", scheduler)
        for i in range(self.args.prefill):
            self._spawn(f"prefill-{i}", ["prefill", "--peer-id", f"prefill-{i}", *worker])
        for i in range(self.args.decode):
            self._spawn(
                f"decode-{i}",
                [
                    "decode",
                    "--peer-id",
                    f"decode-{i}",
                    "--address",
                    self.address(f"decode-{i}"),
                    *worker,
                    *(["--cuda-graphs", "true"] if self.args.cuda_graphs else []),
                ],
            )
        self._spawn("gateway", gateway, gateway_env)
        if batch:
            self._spawn("batch", batch_argv, batch_env)

    def _check_ports(self) -> None:
        """The gateway's ports must be free: `wait_ready` asks whoever answers on --port, and
        took a server already there (an earlier `tandem up`) for this cluster's gateway, which
        was failing to bind behind it."""
        _check_host_resolves(self.args.host)
        rpc_port = getattr(self.args, "rpc_port", None)
        if rpc_port == self.args.port:  # (each free alone; the gateway's second bind failed)
            raise ConfigError(f"--rpc-port {rpc_port} is the HTTP --port too: give another one")
        for flag, port in (("--port", self.args.port), ("--rpc-port", rpc_port)):
            if port is None:
                continue
            if not 1 <= port <= 65535:  # (0, any free port, is one nobody could be told)
                raise ConfigError(f"{flag} must be a port in [1, 65535], got {port}")
            check_tcp_port(self.args.host, port, flag)

    def _batch_dir(self) -> str:
        return getattr(self.args, "batch_dir", None) or os.path.join(self.run_dir, "batch")

    def _make_batch_dir(self) -> None:
        """Made here, so that one that cannot be (a file, under a file) is refused in one line:
        the batch service, started last, refused it itself, and the cluster stopped with
        "exited during start-up: batch", the reason among the children's log lines."""
        if getattr(self.args, "batch_dir", None) == "":  # (an unset $JOBS: jobs lost at exit)
            raise ConfigError("--batch-dir is given but empty: leave it out for the run directory")
        try:
            os.makedirs(self._batch_dir(), exist_ok=True)
        except OSError as error:
            # (makedirs says "File exists" of a file where the directory would be)
            reason = error.strerror or str(error)
            if isinstance(error, FileExistsError):
                reason = "not a directory"
            raise ConfigError(f"--batch-dir: cannot use {self._batch_dir()}: {reason}") from None

    def _batch_argv(self, rpc_address: str, metrics: list[str]) -> list[str]:
        return [
            "batch-service",
            "--address",
            self.address("batch"),
            "--gateway-rpc-address",
            rpc_address,
            "--data-dir",
            self._batch_dir(),
            *metrics,
        ]

    def _spawn(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> None:
        # A stopping signal waits until the child is on the list `stop` ends (one that came
        # between the fork and the append left a child running behind a stopped cluster).
        env = env or {}
        with self.interrupts.held():
            child = Child(name, argv, self._popen(argv, env), env=env)
            self.children.append(child)
            self._pump_logs(child)

    def _popen(self, argv: list[str], env_extra: Mapping[str, str]) -> subprocess.Popen:
        # Children write to a pipe, not a terminal: say which format the person at this end wants.
        fmt = os.environ.get("TANDEM_LOG_FORMAT") or ("console" if sys.stderr.isatty() else "json")
        env = dict(os.environ, TANDEM_LOG_FORMAT=fmt, **env_extra)
        for name in unread_names(env):  # said once, by `tandem up` itself, not by every child
            del env[name]
        return subprocess.Popen(
            [sys.executable, "-m", "services.commands.cli", *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=_die_with_parent,
        )

    def _pump_logs(self, child: Child) -> None:
        child.log_thread = threading.Thread(target=self._pump, args=(child,), daemon=True)
        child.log_thread.start()

    def restart_dead(self) -> list[str]:
        """Starts every dead child again; returns the names of those past `MAX_RESTARTS`
        (dead that many times in a row, each soon after its start)."""
        broken = []
        for child in self.children:
            code = child.process.poll()
            if code is None or child.given_up:
                continue
            # (Its death is seen within the caller's poll, 0.5 s: close enough to its run.)
            if time.monotonic() - child.started_at >= STABLE_RUN_S:
                child.restarts = 0
            if child.restarts >= MAX_RESTARTS:
                broken.append(child.name)
                continue
            child.restarts += 1
            sys.stderr.write(
                f"tandem up: {child.name} exited with {code}; starting it again "
                f"({child.restarts}/{MAX_RESTARTS})\n"
            )
            child.process = self._popen(child.argv, child.env)
            child.started_at = time.monotonic()
            self._pump_logs(child)
        return broken

    def leave_stopped(self, broken: list[str]) -> str | None:
        """Leaves the children past their restarts (`restart_dead`) stopped while the cluster
        serves without them: each a worker, and another of its role not broken. Else why it
        cannot (the cluster stops): one crash-looping worker of two (a bad device, say) took
        the whole cluster down with it, its healthy peer serving nothing more."""
        for name in broken:
            role = name.partition("-")[0]
            if role not in ("prefill", "decode"):
                return f"{name} kept exiting"
            others = [
                c
                for c in self.children
                if c.name.startswith(f"{role}-") and c.name not in broken and not c.given_up
            ]
            if not others:
                return f"{name} kept exiting, and no other {role} worker is left"
        for child in self.children:
            child.given_up = child.given_up or child.name in broken
        return None

    def _pump(self, child: Child) -> None:
        assert child.process.stdout is not None
        for line in iter(child.process.stdout.readline, b""):
            if self.echo_logs:
                sys.stderr.write(f"[{child.name:>9}] {line.decode(errors='replace')}")

    def wait_ready(self, timeout_s: float) -> None:
        """Until /ready answers 200 with every worker started here registered."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = [c for c in self.children if c.process.poll() is not None]
            if dead:
                self._finish_logs(dead)  # (the reason is in their last lines)
                names = ", ".join(c.name for c in dead)
                raise RuntimeError(f"cluster process(es) exited during start-up: {names}")
            try:
                with _DIRECT.open(self.url + "/ready", timeout=2) as response:
                    if response.status == 200 and self._all_joined(json.load(response)):
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.5)
        raise TimeoutError(f"the cluster was not ready within {timeout_s:.0f} s")

    def _finish_logs(self, children: list[Child]) -> None:
        """Until the log threads of these exited children have echoed all their lines: a
        child's last lines (a traceback's) may still be in its pipe after it exited, and the log
        threads, daemons, ended with this process."""
        deadline = time.monotonic() + LOG_DRAIN_S
        for child in children:
            if child.log_thread is not None:
                child.log_thread.join(max(0.0, deadline - time.monotonic()))

    def _all_joined(self, ready: dict) -> bool:
        return (
            ready.get("prefill_workers", 0) >= self.args.prefill
            and ready.get("decode_workers", 0) >= self.args.decode
        )

    def stop(self, grace_s: float | None = None) -> None:
        """Stops the children stage by stage (`STOP_FIRST`, then the rest), each stage ended
        before the next is signalled: SIGTERM, then SIGKILL to those still running `grace_s`
        (default `stop_grace_s`) after it. Every child has the grace from its own SIGTERM, so
        hung children take at most one grace per stage."""
        grace_s = self.stop_grace_s if grace_s is None else grace_s
        for stage in self._stop_stages():
            _end(stage, grace_s)
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_stages(self) -> list[list[Child]]:
        first = [[c for c in self.children if c.name == name] for name in STOP_FIRST]
        rest = [c for c in self.children if c.name not in STOP_FIRST]
        return [stage for stage in (*first, rest) if stage]


def _end(children: list[Child], grace_s: float) -> None:
    """SIGTERM to those of `children` still running, SIGKILL to those left after `grace_s`."""
    for child in children:
        if child.process.poll() is None:
            child.process.terminate()
    deadline = time.monotonic() + grace_s
    for child in children:
        try:
            child.process.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            child.process.kill()
            child.process.wait()


def _check_host_resolves(host: str) -> None:
    """Every child serves on --host (the gateway, each /metrics): a name that resolves to no
    address was let through by the port check, and each child refused it on its own, the
    cluster stopping with "exited during start-up", the reason in a child's log lines."""
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror as error:
        raise ConfigError(f"--host {host!r} resolves to no address: {error.strerror}") from None


SERVICE_CONFIGS = {
    "scheduler": SchedulerConfig,
    "gateway": GatewayConfig,
    "batch-service": BatchServiceConfig,
}


def stop_grace_for(gateway: GatewayConfig) -> float:
    """The stop's grace for a gateway draining `shutdown_grace_s` (10 s at least): killed at
    10 s, a gateway given a longer drain tore the streams it was letting finish."""
    return max(STOP_GRACE_S, gateway.shutdown_grace_s + GATEWAY_EXIT_S)


def _check_service_settings(argv: list[str], env: Mapping[str, str]) -> Any:
    """A service's settings, from its flags and the TANDEM_ variables it will read (this
    process's, and `env` beyond them), checked as the service checks them: each one refused
    its own after the workers had started loading the model, and the cluster stopped with
    "exited during start-up", the reason somewhere in the children's logs."""
    role, *flags = argv
    config_class = SERVICE_CONFIGS[role]
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, config_class)
    return config_from_args(config_class, parser.parse_args(flags), {**os.environ, **env})


def _check_worker_settings(worker_argv: list[str]) -> None:
    """The workers' settings, from these flags and the TANDEM_ variables each worker will read,
    checked once as a worker checks them (and its KV budget against the model's config): each
    worker refused them itself, after the scheduler and gateway had started, and the cluster
    stopped with "exited during start-up", the reason somewhere in the children's logs."""
    parser = argparse.ArgumentParser()
    add_config_arguments(parser, WorkerConfig)
    config = config_from_args(WorkerConfig, parser.parse_args(worker_argv))
    try:
        config.check_kv_budget()
    except ConfigError:
        raise
    except (ValueError, OSError) as error:  # its config.json: unreadable, a type not served
        raise ConfigError(f"--model {config.model}: {error}") from None


def _die_with_parent() -> None:
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    os.setpgrp()  # Ctrl-C reaches only `tandem up`, which stops the children in order
    # A signal mask outlives exec: left blocked (as `_spawn` once blocked them around the
    # fork, or as whoever started `tandem up` may), every child ignored SIGTERM (and its
    # parent's death), never stopped cleanly, and was killed when the stop's grace ran out.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def batch_service_key(environ: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The environment the gateway and the batch service get beyond this process's. With API
    keys the gateway demands one of every caller (`TANDEM_API_KEYS`, `TANDEM_API_KEYS_FILE`),
    the batch service too, which sends each job's lines to it: unless one was given it
    (`TANDEM_API_KEY`, then listed among the gateway's by whoever set it), a bare key is made
    for it and added to the gateway's. Without, every line of every job was refused (401)."""
    if not (environ.get("TANDEM_API_KEYS") or environ.get("TANDEM_API_KEYS_FILE")):
        return {}, {}
    if environ.get("TANDEM_API_KEY"):
        return {}, {}
    key = secrets.token_hex(24)
    listed = [k for k in (environ.get("TANDEM_API_KEYS", "").strip(), key) if k]
    return {"TANDEM_API_KEYS": ",".join(listed)}, {"TANDEM_API_KEY": key}


class Interrupted(Exception):
    """Ctrl-C or SIGTERM before the cluster was ready."""


class StartInterrupts:
    """The start-up's signal handler: Ctrl-C or SIGTERM raises `Interrupted` at once (a
    model's conversion, the workers' loading and the ready check are long waits), save inside
    `held()`, which raises it as it ends. Blocking the signals (`pthread_sigmask`) held off
    nothing once a child's log thread ran: the kernel hands a signal to a thread that does not
    block it, and Python runs the handler in the main thread all the same, wherever it is."""

    def __init__(self) -> None:
        self._depth = 0
        self._pending: str | None = None

    def handler(self, signum: int, _frame: object) -> None:
        name = signal.Signals(signum).name
        if self._depth:
            self._pending = self._pending or name
            return
        raise Interrupted(name)

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
        if not self._depth and self._pending is not None:
            name, self._pending = self._pending, None
            raise Interrupted(name)


def run(args: argparse.Namespace) -> int:
    cluster = LocalCluster(args)
    stopping = threading.Event()

    def on_signal(*_: object) -> None:
        stopping.set()

    signal.signal(signal.SIGINT, cluster.interrupts.handler)
    signal.signal(signal.SIGTERM, cluster.interrupts.handler)
    grace_s = None  # (the cluster's own: its gateway's drain fits)
    try:
        cluster.start()
        cluster.wait_ready(args.ready_timeout)
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        print(_banner(cluster), flush=True)
        while not stopping.wait(0.5):
            broken = cluster.restart_dead()
            if not broken:
                continue
            reason = cluster.leave_stopped(broken)
            if reason is not None:
                print(f"tandem up: {reason}; stopping the cluster", file=sys.stderr)
                return 1
            print(
                f"tandem up: {', '.join(broken)} kept exiting; left stopped, the cluster "
                "serves on without it (its log says why it exits)",
                file=sys.stderr,
            )
        return 0
    except (RuntimeError, TimeoutError) as error:
        print(f"tandem up: {error}", file=sys.stderr)
        return 1
    except Interrupted as signal_name:
        print(f"tandem up: {signal_name} before the cluster was ready; stopping", file=sys.stderr)
        grace_s = 2.0  # children still starting have served nothing: no need to wait for them
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the stop below finishes undisturbed
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        cluster.stop(grace_s)


def _banner(cluster: LocalCluster) -> str:
    model = cluster.served_model
    return f"""
tandem is ready at {cluster.url}  (Ctrl-C stops it)

  curl {cluster.url}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "The capital of France is", "max_tokens": 16}}'
"""
