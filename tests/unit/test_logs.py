"""The services' log lines: a line logged with its exception carries the traceback in JSON too
(the format outside a terminal: files, containers), not `"exc_info": true`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
