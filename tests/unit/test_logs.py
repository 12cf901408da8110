"""The services' log lines: a line logged with its exception carries the traceback in JSON too
(the format outside a terminal: files, containers), not `"exc_info": true`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from shared.config import ConfigError

LOGS_AN_EXCEPTION = """
from shared.logs import configure_logging, get_logger
configure_logging("test")
log = get_logger()
try:
    {}["missing"]
except KeyError as error:
    log.exception("with exception", request_id="r1")
    log.error("with exc_info", exc_info=error)
"""


def test_a_json_line_logged_with_its_exception_carries_the_traceback():
    environ = dict(os.environ, TANDEM_LOG_FORMAT="json")
    result = subprocess.run(
        [sys.executable, "-c", LOGS_AN_EXCEPTION],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["with exception", "with exc_info"]
    for line in lines:
        assert "exc_info" not in line
        assert line["exception"].startswith("Traceback (most recent call last)")
        assert "KeyError: 'missing'" in line["exception"]
    assert lines[0]["request_id"] == "r1" and lines[0]["level"] == "error"


LOGS_FROM_A_MODULE_LOGGER = """
from services.gateway import federation  # its `log = get_logger()` runs at import
from shared.logs import configure_logging, get_logger
configure_logging("test")
federation.log.warning("below the level")
federation.log.error("module logger", url="u")
get_logger().error("configured logger")
"""


def test_a_logger_made_at_import_follows_the_configuration():
    """A module's `log = get_logger()` ran before `configure_logging` and was built from
    structlog's defaults: console text on stdout, every level, whatever TANDEM_LOG_* said."""
    environ = dict(os.environ, TANDEM_LOG_FORMAT="json", TANDEM_LOG_LEVEL="ERROR")
    result = subprocess.run(
        [sys.executable, "-c", LOGS_FROM_A_MODULE_LOGGER],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
    )
    assert result.stdout == ""
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["event"] for line in lines] == ["module logger", "configured logger"]
    assert lines[0]["url"] == "u" and lines[0]["level"] == "error"


@pytest.mark.parametrize(
    "name, value", [("TANDEM_LOG_LEVEL", "trace"), ("TANDEM_LOG_FORMAT", "xml")]
)
def test_an_unknown_log_level_or_format_is_refused(monkeypatch, name, value):
    """`trace` was taken for INFO, `xml` for JSON, without a word."""
    from shared.logs import configure_logging

    monkeypatch.setenv(name, value)
    with pytest.raises(ConfigError, match=f"{name} must be .*got '{value}'"):
        configure_logging("test")  # (refused before it configures anything)


def test_log_levels_are_read_in_any_case(monkeypatch):
    from shared.logs import log_settings

    monkeypatch.setenv("TANDEM_LOG_FORMAT", "json")
    monkeypatch.setenv("TANDEM_LOG_LEVEL", "Warning")
    assert log_settings() == (30, "json")
    assert log_settings("debug") == (10, "json")
    # Python's own aliases, which the configuration took before its names were checked.
    assert log_settings("WARN") == (30, "json") and log_settings("fatal") == (50, "json")
