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


SERVES_A_BAD_REQUEST = """
import socket, threading, time
import uvicorn
from services.gateway.service import UVICORN_SETTINGS
from shared.logs import configure_logging
import logging

configure_logging("test")
logging.getLogger("httpx").info("HTTP Request: GET http://x (an INFO line of a library)")

async def app(scope, receive, send):
    raise RuntimeError("a bug in the app")

config = uvicorn.Config(app, host="127.0.0.1", port=0, **UVICORN_SETTINGS)
server = uvicorn.Server(config)
thread = threading.Thread(target=server.run, daemon=True)
thread.start()
while not server.started:
    time.sleep(0.01)
port = server.servers[0].sockets[0].getsockname()[1]
for request in (b"NOT HTTP AT ALL\\r\\n\\r\\n", b"GET / HTTP/1.1\\r\\nHost: x\\r\\n\\r\\n"):
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.sendall(request)
        sock.recv(1000)
server.should_exit = True
thread.join(timeout=10)
"""


def test_the_web_servers_own_lines_are_json_lines_too():
    """uvicorn printed its warnings and errors (a client's malformed request, an app's
    traceback) as plain text among the gateway's JSON lines; they now come through structlog,
    at WARNING and above (a library's INFO lines stay out, as before)."""
    environ = dict(os.environ, TANDEM_LOG_FORMAT="json")
    result = subprocess.run(
        [sys.executable, "-c", SERVES_A_BAD_REQUEST],
        capture_output=True,
        text=True,
        env=environ,
        check=True,
        timeout=60,
    )
    lines = [json.loads(line) for line in result.stderr.splitlines()]  # every one JSON
    events = {line["event"]: line for line in lines}
    assert "Invalid HTTP request received." in events
    failed = events["Exception in ASGI application\n"]  # (uvicorn's own text)
    assert failed["level"] == "error" and failed["logger"] == "uvicorn.error"
    assert "RuntimeError: a bug in the app" in failed["exception"]
    assert not [line for line in lines if "HTTP Request" in line["event"]]
    assert all(line["service"] == "test" for line in lines)


LOGS_AFTER_ITS_READER_LEFT = """
import sys
from shared.logs import configure_logging, get_logger
configure_logging("test")
log = get_logger()
log.info("read")
sys.stdin.readline()  # the reader of its logs is gone once this returns
for n in range(3):
    log.warning("nobody reads this", n=n)  # a drain's lines, after its parent died
print("went on", flush=True, file=open(sys.argv[1], "w"))
"""


def test_a_service_whose_log_reader_is_gone_goes_on(tmp_path):
    """`tandem up` killed with -9: its children get SIGTERM (PR_SET_PDEATHSIG) and their logs
    go to a pipe nobody reads. A line logged then raised BrokenPipeError in whatever logged it:
    the gateway's drain, which tore its streams instead of ending them with [DONE]."""
    done = tmp_path / "done"
    child = subprocess.Popen(
        [sys.executable, "-c", LOGS_AFTER_ITS_READER_LEFT, str(done)],
        stdin=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=dict(os.environ, TANDEM_LOG_FORMAT="json"),
    )
    assert b"read" in child.stderr.readline()
    child.stderr.close()  # the reader dies
    child.stdin.write(b"\n")
    child.stdin.close()
    assert child.wait(timeout=60) == 0
    assert done.read_text() == "went on\n"
