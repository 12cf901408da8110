"""CPU time of a local cluster's processes by role, and of the load client (this process): what
the services beside the workers take of a machine whose cores they all share. A worker profile
is measured with workers alone; on a local cluster the gateway, the scheduler and the client
run on the same cores, most busily while tokens stream.

Linux and macOS through psutil; a process that ends between two readings drops out of the later
one, so take readings while the cluster runs.
"""

from __future__ import annotations

from collections import Counter

import psutil

CLI_MODULE = "services.commands.cli"
CLIENT = "client"


def role_of(cmdline: list[str]) -> str:
    """The `tandem` subcommand a process runs (`up` for the supervisor), else "other"."""
    if CLI_MODULE in cmdline:
        index = cmdline.index(CLI_MODULE) + 1
        if index < len(cmdline):
            return cmdline[index]
    return "other"


def cpu_seconds_by_role(root_pid: int) -> Counter[str]:
    """User plus system CPU seconds of the process `root_pid` and its descendants, by role, and
    of this process under `CLIENT`."""
    totals: Counter[str] = Counter()
    root = psutil.Process(root_pid)
    for process in [root, *root.children(recursive=True)]:
        try:
            role = role_of(process.cmdline())
            times = process.cpu_times()
        except psutil.Error:  # ended meanwhile
            continue
        totals[role] += times.user + times.system
    own = psutil.Process().cpu_times()
    totals[CLIENT] += own.user + own.system
    return totals


def difference(before: Counter[str], after: Counter[str]) -> dict[str, float]:
    """CPU seconds each role used between two readings."""
    return {role: after[role] - before.get(role, 0.0) for role in after}
