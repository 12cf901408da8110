"""The Locust file (`loadtest/locustfile.py`) run headless: a few seconds of every kind of user
against the e2e cluster, read back from the stats CSV; stream failures against a fake server
that breaks its streams; and the agent users' dependence on `TANDEM_RPC_ADDRESS`.

Locust runs in a subprocess: importing it here would monkey-patch the test process for gevent."""

from __future__ import annotations

import csv
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

LOCUSTFILE = Path(__file__).resolve().parents[2] / "loadtest" / "locustfile.py"
USER_CLASSES = ["ChatUser", "CodeAnalysisUser", "BulkUser", "AgentUser"]
# Each kind of user's calls (Locust's type and name) and the name of their TTFT row, if streamed.
CALLS = {
    ("POST", "/v1/chat/completions [chat]"): "chat",
    ("POST", "/v1/chat/completions [code]"): "code",
    ("POST", "/v1/completions [bulk]"): None,
    ("RPC", "chat [agent]"): "agent",
}


def run_locust(
    *args: str, env: dict[str, str], timeout_s: float = 180
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), *args],
        env={**os.environ, "TANDEM_RPC_ADDRESS": "", **env},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def headless(host: str, csv_prefix: Path, num_users: int, run_time: str) -> list[str]:
    return ["--headless", "-u", str(num_users), "-r", str(num_users), "-t", run_time,
            "--stop-timeout", "60", "--host", host, "--csv", str(csv_prefix),
            "--only-summary"]  # fmt: skip


def read_stats(csv_prefix: Path) -> dict[tuple[str, str], dict[str, str]]:
    with open(f"{csv_prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


@pytest.mark.slow
@pytest.mark.parametrize("which", ["open", "guarded"])
def test_every_user_gets_answers_and_ttft_is_reported(which, request, tmp_path):
    """On the shared cluster, and on the guarded one (API keys and CurveZMQ required)."""
    cluster = request.getfixturevalue("cluster" if which == "open" else "guarded_cluster")
    env = {"TANDEM_RPC_ADDRESS": cluster.rpc_address}
    if which == "guarded":
        from tests.e2e.conftest import OPEN_KEY

        env |= {"TANDEM_API_KEY": OPEN_KEY, "TANDEM_CURVE_CLIENT_DIR": str(cluster.curve_keys_dir)}
    one_each = json.dumps([{"user_class_name": name, "fixed_count": 1} for name in USER_CLASSES])
    args = headless(cluster.url, tmp_path / "run", len(USER_CLASSES), "6s")
    result = run_locust(*args, "--config-users", one_each, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    stats = read_stats(tmp_path / "run")

    for key, kind in CALLS.items():
        row = stats.get(key)
        assert row is not None, f"no {key} calls in {sorted(stats)}"
        assert int(row["Request Count"]) > 0 and int(row["Failure Count"]) == 0, row
        if kind is None:
            continue
        # One TTFT per successful stream, each shorter than its own call.
        ttft = stats[("TTFT", kind)]
        assert ttft["Request Count"] == row["Request Count"]
        assert 0 < float(ttft["Min Response Time"]) <= float(row["Max Response Time"])
        assert float(ttft["Max Response Time"]) <= float(row["Max Response Time"])
        assert float(ttft["Average Response Time"]) <= float(row["Average Response Time"])
    assert int(stats[("", "Aggregated")]["Failure Count"]) == 0


class BrokenStreams(BaseHTTPRequestHandler):
    """Answers every chat call with a 200 stream that goes wrong: in turn, an error event
    (followed by [DONE], as tandem's gateway sends it) and a stream cut before [DONE]."""

    protocol_version = "HTTP/1.0"  # the body ends when the connection closes
    num_calls = 0
    lock = threading.Lock()

    def do_POST(self) -> None:  # noqa: N802 (the name http.server looks for)
        self.rfile.read(int(self.headers["Content-Length"]))
        with BrokenStreams.lock:
            BrokenStreams.num_calls += 1
            cut = BrokenStreams.num_calls % 2 == 0
        chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}}]}
        events = [chunk] if cut else [chunk, {"error": {"message": "worker lost"}}, "[DONE]"]
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for event in events:
            data = event if isinstance(event, str) else json.dumps(event)
            self.wfile.write(f"data: {data}\n\n".encode())

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def broken_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BrokenStreams)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_broken_streams_are_failures_without_ttft(broken_server, tmp_path):
    result = run_locust(*headless(broken_server, tmp_path / "run", 2, "1s"), "ChatUser", env={})
    assert result.returncode == 1, result.stderr[-4000:]  # Locust's code for failures
    stats = read_stats(tmp_path / "run")
    chat = stats[("POST", "/v1/chat/completions [chat]")]
    assert int(chat["Request Count"]) >= 2
    assert chat["Failure Count"] == chat["Request Count"]
    assert ("TTFT", "chat") not in stats
    with open(tmp_path / "run_failures.csv", newline="") as f:
        errors = " ".join(row["Error"] for row in csv.DictReader(f))
    assert "worker lost" in errors and "without [DONE]" in errors


@pytest.mark.parametrize(
    ("address", "agents"),
    [("", False), ("tcp://127.0.0.1:8001", True), ("127.0.0.1:8001", None)],
)
def test_agent_users_follow_the_rpc_address(address, agents):
    result = run_locust("--list", env={"TANDEM_RPC_ADDRESS": address}, timeout_s=60)
    if agents is None:  # not a ZeroMQ address: refused by name before any user starts
        assert result.returncode != 0
        assert "TANDEM_RPC_ADDRESS must be a tcp:// or ipc://" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-4000:]
    listed = result.stdout.split()
    assert all(name in listed for name in USER_CLASSES[:3])
    assert ("AgentUser" in listed) == agents
