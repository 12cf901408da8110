"""`tandem` as a container's process 1: SIGTERM must end a command that has not yet put its own
handler in place (a worker loading its model), where the kernel ignores a signal whose action is
the default for a PID namespace's init."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

# A subcommand that says it started, then works (a model's load) with no handler of its own.
SLOW_COMMAND = """
import sys, time, types
from services.commands import cli
slow = types.ModuleType("slow")
slow.add_arguments = lambda parser: None
def run(args):
    print("loading", flush=True)
    time.sleep(60)
slow.run = run
sys.modules["slow"] = slow
cli.SUBCOMMANDS["slow"] = "slow"
cli.HELPS["slow"] = "a slow start"
sys.exit(cli.main(["slow"]))
"""


def namespace_init_pid(unshare_pid: int) -> int:
    """The host PID of the process `unshare --fork` started (its only child)."""
    children = Path(f"/proc/{unshare_pid}/task/{unshare_pid}/children")
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        pids = children.read_text().split()
        if pids:
            return int(pids[0])
        time.sleep(0.05)
    raise AssertionError("unshare started no process")


def test_sigterm_ends_a_command_running_as_process_1_before_its_role_serves():
    root = Path(__file__).resolve().parents[2]
    process = subprocess.Popen(
        ["unshare", "--fork", "--pid", sys.executable, "-c", SLOW_COMMAND],
        cwd=root,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout.readline().strip() == "loading"
        os.kill(namespace_init_pid(process.pid), signal.SIGTERM)
        assert process.wait(timeout=10) == 128 + signal.SIGTERM
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
