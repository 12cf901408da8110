"""CPU time by role of a process tree: a real child process, busy for a known while."""

from __future__ import annotations

import subprocess
import sys
import time

from loadtest.process_cpu import CLIENT, cpu_seconds_by_role, difference, role_of

# Burns 0.3 s of CPU, says so, then sleeps.
BUSY = (
    "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\n"
    "print('done', flush=True)\ntime.sleep(60)"
)


def test_role_of_reads_the_tandem_subcommand():
    assert role_of(["python", "-m", "services.commands.cli", "gateway", "--port", "1"]) == "gateway"
    assert role_of(["python", "-m", "services.commands.cli"]) == "other"
    assert role_of(["bash", "-c", "true"]) == "other"


def test_a_busy_child_is_counted_under_its_role():
    command = [sys.executable, "-c", BUSY, "services.commands.cli", "gateway"]
    child = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        before = cpu_seconds_by_role(child.pid)
        assert child.stdout.readline() == "done\n"
        time.sleep(0.2)
        after = cpu_seconds_by_role(child.pid)
    finally:
        child.kill()
        child.wait()
    assert set(after) == {"gateway", CLIENT}
    assert 0.3 <= after["gateway"] < 5.0  # its burn, and the interpreter's start
    used = difference(before, after)
    assert used["gateway"] <= after["gateway"] and used[CLIENT] >= 0.0
