"""structlog set-up shared by every service: JSON lines, or a readable console renderer on a TTY.

Every line about a request carries `request_id`, so one grep follows a request through the cluster.
"""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure_logging(service: str, level: str | None = None) -> None:
    level_name = (level or os.environ.get("TANDEM_LOG_LEVEL") or "INFO").upper()
    # TANDEM_LOG_FORMAT=console|json; by default, console on a terminal and JSON elsewhere.
    log_format = os.environ.get("TANDEM_LOG_FORMAT") or (
        "console" if sys.stderr.isatty() else "json"
    )
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
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *renderers,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level_name, 20)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
    structlog.contextvars.bind_contextvars(service=service)


def get_logger(**bindings):
    return structlog.get_logger().bind(**bindings)
