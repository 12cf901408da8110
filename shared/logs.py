"""structlog set-up shared by every service: JSON lines, or a readable console renderer on a TTY.

Every line about a request carries `request_id`, so one grep follows a request through the cluster.
Loggers are lazy: one made at import (a module's `log = get_logger()`) takes its processors, level
and output from `configure_logging` when it first logs, not from structlog's defaults (console
text on stdout, every level) as it did when `get_logger` built it at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys

import structlog

from shared.config import ConfigError

# (With Python's own aliases: WARN and FATAL.)
LEVELS = {
    "debug": 10,
    "info": 20,
    "warning": 30,
    "warn": 30,
    "error": 40,
    "critical": 50,
    "fatal": 50,
}
FORMATS = ("console", "json")


def log_settings(level: str | None = None) -> tuple[int, str]:
    """(level, format) from `level` or TANDEM_LOG_LEVEL and TANDEM_LOG_FORMAT; ConfigError for a
    value that is neither (an unknown level was taken for INFO, an unknown format for JSON)."""
    level_name = (level or os.environ.get("TANDEM_LOG_LEVEL") or "info").strip().lower()
    if level_name not in LEVELS:
        raise ConfigError(
            f"TANDEM_LOG_LEVEL must be one of {', '.join(LEVELS)}, got {level_name!r}"
        )
    # By default, console on a terminal and JSON elsewhere.
    log_format = os.environ.get("TANDEM_LOG_FORMAT") or (
        "console" if sys.stderr.isatty() else "json"
    )
    if log_format not in FORMATS:
        raise ConfigError(f"TANDEM_LOG_FORMAT must be console or json, got {log_format!r}")
    return LEVELS[level_name], log_format


def configure_logging(service: str, level: str | None = None) -> None:
    level_number, log_format = log_settings(level)
    # The console renderer prints a traceback itself; JSON needs it made a string first (else a
    # line logged with its exception reads `"exc_info": true`, the traceback lost).
    renderers = (
        [structlog.dev.ConsoleRenderer(colors=False)]
        if log_format == "console"
        else [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            _ServiceName(service),
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level_number),
        logger_factory=structlog.PrintLoggerFactory(file=_LogOutput()),
        cache_logger_on_first_use=True,
    )
    _forward_standard_logging(level_number)


class _LogOutput:
    """stderr, for as long as someone reads it. A service whose log reader died (`tandem up`
    killed with -9: its children get SIGTERM and log their stop into a pipe nobody reads) raised
    BrokenPipeError out of whatever logged a line: the gateway's drain, which tore the streams
    it was ending. Lines nobody can read are dropped, and stderr points at /dev/null from then
    on, so Python's own last writes (a traceback, the flush at exit) do not raise either."""

    def __init__(self) -> None:
        self._reader_gone = False

    def write(self, text: str) -> int:
        if not self._reader_gone:
            try:
                return sys.stderr.write(text)
            except BrokenPipeError:
                self._drop_from_now_on()
        return len(text)

    def flush(self) -> None:
        if not self._reader_gone:
            try:
                sys.stderr.flush()
            except BrokenPipeError:
                self._drop_from_now_on()

    def _drop_from_now_on(self) -> None:
        self._reader_gone = True
        with contextlib.suppress(OSError, ValueError):  # (a stderr with no descriptor: a capture)
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stderr.fileno())
            os.close(devnull)


class _ServiceName:
    """Names the service on every line, whatever thread logs it (bound as a context variable
    it was missing from the lines of threads: a web server's, a pool's)."""

    def __init__(self, service: str) -> None:
        self.service = service

    def __call__(self, logger: object, method: str, event: dict) -> dict:
        event.setdefault("service", self.service)
        return event


class _ToStructlog(logging.Handler):
    """Python's logging records (uvicorn's, transformers', httpx's) as this service's lines:
    they came out as plain text among the JSON ones (uvicorn's "Invalid HTTP request
    received.", which any client can cause, a traceback of "Exception in ASGI application")."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields = {"logger": record.name}
            if record.exc_info:
                fields["exc_info"] = record.exc_info  # type: ignore[assignment]
            get_logger().log(record.levelno, record.getMessage(), **fields)
        except Exception:
            self.handleError(record)


def _forward_standard_logging(level_number: int) -> None:
    """Python's root logger to structlog, at WARNING and above (what Python printed alone
    before: its libraries' INFO lines, an httpx line per request, stay out) or the service's
    level if higher. A second call replaces the first's handler."""
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, _ToStructlog)]:
        root.removeHandler(handler)
    root.addHandler(_ToStructlog())
    root.setLevel(max(level_number, logging.WARNING))


def get_logger(**bindings):
    """A logger carrying `bindings`, assembled from the configuration when it first logs."""
    return structlog.get_logger(**bindings)
