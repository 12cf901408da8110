"""Service configuration: one frozen dataclass per service, from flags or environment variables.

Every field `some_field` of a config dataclass becomes the flag `--some-field` and the environment
variable `TANDEM_SOME_FIELD` (docker-compose sets only environment variables). A flag beats the
environment, which beats the default. Values are parsed by the field's annotated type (int, float,
str, bool, optional variants, tuple[str, ...] as a comma-separated list) and the dataclass validates
itself in `__post_init__`, so a bad value fails at start-up with the name of the setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

ENV_PREFIX = "TANDEM_"
C = TypeVar("C")


class ConfigError(ValueError):
    """A setting has a value the service refuses; the message names flag and variable."""


def cache_dir() -> Path:
    """Where tandem keeps what it builds once: converted models, compiled C."""
    return Path(os.environ.get("TANDEM_CACHE_DIR") or Path.home() / ".cache" / "tandem")


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def add_config_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """Adds one flag per field; defaults stay None so the environment and defaults can apply."""
    for field in dataclasses.fields(cls):
        help_text = field.metadata.get("help", "")
        parser.add_argument(
            flag_name(field.name),
            dest=field.name,
            default=None,
            help=f"{help_text} (env {env_name(field.name)}; default {_default_text(field)})",
        )


def config_from_args(
    cls: type[C], args: argparse.Namespace | None = None, environ: Mapping[str, str] | None = None
) -> C:
    environ = os.environ if environ is None else environ
    _refuse_miscased_names(cls, environ)
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        raw = getattr(args, field.name, None) if args is not None else None
        source = flag_name(field.name)
        if raw is None and env_name(field.name) in environ:
            raw, source = environ[env_name(field.name)], env_name(field.name)
        if raw is None:
            continue
        try:
            values[field.name] = parse_value(raw, hints[field.name])
        except ValueError as error:
            raise ConfigError(f"{source}: {error}") from None
        _refuse_inproc(source, values[field.name])
        if values[field.name] is None and field.metadata.get("given_blank_refused"):
            raise ConfigError(f"{source} is given but empty ({raw!r}): leave it unset for none")
    try:
        return cls(**values)
    except (ValueError, TypeError) as error:
        raise ConfigError(str(error)) from None


def _refuse_inproc(source: str, value: Any) -> None:
    """A flag or a variable configures a service run as its own process, which no peer reaches
    at an inproc:// address (ZeroMQ's inproc joins the threads of one process): the service
    bound it, said it was ready, and waited for peers that could never come (or connected
    and waited for a service that was not there). Configs built in code may use it."""
    for item in value if isinstance(value, tuple) else (value,):
        if isinstance(item, str) and item.strip().lower().startswith("inproc://"):
            raise ConfigError(
                f"{source}: {item!r} reaches only threads of this one process; a service run "
                f"as its own process is reached at a tcp:// or ipc:// address"
            )


def _refuse_miscased_names(cls: type, environ: Mapping[str, str]) -> None:
    """Environment names are case-sensitive: `tandem_curve_keys_dir` was never read, and the
    service ran without it, unsaid (in clear, for that one). A name that is one of this
    service's settings but for its case is meant as that setting: refused, naming the right one."""
    names = {env_name(field.name) for field in dataclasses.fields(cls)}
    for name in environ:
        if name not in names and name.upper() in names:
            raise ConfigError(
                f"environment variable {name} is not read (names are upper case): "
                f"set {name.upper()} instead"
            )


def parse_value(raw: Any, annotation: Any) -> Any:
    if not isinstance(raw, str):
        return raw
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        if raw.strip().lower() in ("", "none", "null"):
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return parse_value(raw, inner)
    if annotation is bool:
        lowered = raw.strip().lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"expected a boolean (true/false), got {raw!r}")
    if annotation is int:
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"expected an integer, got {raw!r}") from None
    if annotation is float:
        try:
            value = float(raw)
        except ValueError:
            raise ValueError(f"expected a number, got {raw!r}") from None
        # float() also reads "nan" and "inf", which every "> 0" check lets through: a NaN
        # heartbeat interval would stop a worker's heartbeats (no time is ever past it).
        if not math.isfinite(value):
            raise ValueError(f"expected a finite number, got {raw!r}")
        return value
    if typing.get_origin(annotation) is tuple:
        item_type = typing.get_args(annotation)[0]  # tuple[X, ...]
        return tuple(
            parse_value(part.strip(), item_type) for part in raw.split(",") if part.strip()
        )
    return raw


def _default_text(field: dataclasses.Field) -> str:
    if field.default is not dataclasses.MISSING:
        return repr(field.default)
    if field.default_factory is not dataclasses.MISSING:
        return repr(field.default_factory())
    return "required"


def setting(default: Any, help: str, given_blank_refused: bool = False) -> Any:  # noqa: A002
    """A dataclass field with a help text for its flag (argparse's name). `given_blank_refused`:
    an optional setting that, given empty (or `none`), is refused rather than read as unset."""
    metadata = {"help": help, "given_blank_refused": given_blank_refused}
    return dataclasses.field(default=default, metadata=metadata)


def require_positive(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is not None and not 0 < value < math.inf:  # NaN fails every comparison
            raise ConfigError(
                f"{name} ({flag_name(name)} / {env_name(name)}) must be > 0 and finite, got {value}"
            )


def require_address(config: Any, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if not value.startswith(("tcp://", "ipc://", "inproc://")):
            raise ConfigError(
                f"{name} ({flag_name(name)} / {env_name(name)}) must be a tcp://, ipc:// or "
                f"inproc:// address, got {value!r}"
            )
        if value.startswith("tcp://") and not _is_tcp_host_port(value[len("tcp://") :]):
            raise ConfigError(
                f"{name} ({flag_name(name)} / {env_name(name)}) must be tcp://host:port with a "
                f"port from 0 to 65535 (or *: any free one), got {value!r}"
            )


def require_distinct_addresses(config: Any, *names: str) -> None:
    """The addresses one service binds and connects to, each its own: one bound where the
    service also connects reaches the service itself (a gateway's token stream bound at its
    scheduler's address said "ready" and talked to itself), and a peer started after it could
    not bind there. Only the same text is caught; tcp://0.0.0.0:N and tcp://host:N may be one."""
    seen: dict[str, str] = {}
    for name in names:
        value = getattr(config, name)
        if value is None:
            continue
        if value in seen:
            first = seen[value]
            raise ConfigError(
                f"{first} ({flag_name(first)} / {env_name(first)}) and {name} ({flag_name(name)} "
                f"/ {env_name(name)}) are the same address {value!r}: each needs its own"
            )
        seen[value] = name


def _is_tcp_host_port(host_port: str) -> bool:
    """`host:port` as libzmq takes it: a port it would connect to without a word past 65535
    (the service ran, reaching nothing), or refuse with a bare "Invalid argument" when missing."""
    host, colon, port = host_port.rpartition(":")
    if not colon or not host:
        return False
    return port == "*" or (port.isascii() and port.isdigit() and int(port) <= 65535)


def require_port(config: Any, *names: str) -> None:
    """A TCP port, where 0 asks the system for a free one."""
    for name in names:
        value = getattr(config, name)
        if value is not None and not 0 <= value <= 65535:
            raise ConfigError(
                f"{name} ({flag_name(name)} / {env_name(name)}) must be a port in [0, 65535], "
                f"got {value}"
            )


def expand_host(address: str | None) -> str | None:
    """`{ip}` in an advertised address becomes this machine's (a container's) IP address and
    `{hostname}` its host name, so one setting serves every replica of a scaled service."""
    if address is None or "{" not in address:
        return address
    import socket

    hostname = socket.gethostname()
    if "{ip}" not in address:
        return address.replace("{hostname}", hostname)
    from shared.endpoints import host_ip

    try:
        ip = host_ip(hostname)
    except OSError as error:  # (socket.gaierror: a traceback at start-up, before)
        raise ConfigError(f"{address}: no IP address for this host {hostname!r}: {error}") from None
    if ":" in ip:  # an IPv6-only host's: in brackets, as tcp:// and URLs write it
        ip = f"[{ip}]"
    return address.replace("{hostname}", hostname).replace("{ip}", ip)


@dataclasses.dataclass(frozen=True)
class CurveSettings:
    """CurveZMQ settings every service shares (see `shared.curve`); a config class inherits
    them and calls `curve_keys()` in its `__post_init__`, so bad keys fail at start-up."""

    # Given empty, refused: read as unset, it ran the service in clear, unsaid (a Kubernetes
    # Secret made from an unset shell variable gives exactly that).
    curve_keys_dir: str | None = setting(
        None,
        "CurveZMQ: a `tandem keys` directory; encrypts and authenticates every socket",
        given_blank_refused=True,
    )
    curve_secret_key: str | None = setting(
        None,
        "CurveZMQ: the cluster's secret key (Z85), instead of a directory",
        given_blank_refused=True,
    )
    curve_client_keys: tuple[str, ...] = setting(
        (), "CurveZMQ: more public keys (Z85) allowed in, such as RPC clients'"
    )

    def curve_keys(self):
        from shared.curve import CurveError, load_keys

        try:
            return load_keys(self.curve_keys_dir, self.curve_secret_key, self.curve_client_keys)
        except CurveError as error:
            raise ConfigError(
                f"CurveZMQ settings (--curve-keys-dir, TANDEM_CURVE_SECRET_KEY, ...): {error}"
            ) from None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the platform tells it), the
    default of settings that take one thread or process a core."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1
