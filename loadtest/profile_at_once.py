"""Worker profiles measured the way a local cluster's workers share this machine: several
`tandem profile --threads 1` running at once, and their point-by-point median.

The shipped profiles were measured at some other time: on a shared machine the cores' speed
moves by more than the validation's bar within hours (a batch-1 decode step measured at 30 ms
one morning and 17 ms that afternoon, same machine kind, same command), so `plan_validate
--profile measure` profiles each configuration minutes before its cluster runs. Each of the
processes measures the whole grid, all at about the same point at the same time (same grid,
same order, same speed), and any one point of one process may have caught a bad moment of the
time slicing (three measured together read a batch-1 decode step at 15, 15 and 32 ms): the
median of the processes is the profile.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from services.planner.profile import ProfileError, WorkerProfile

PROFILE_TIMEOUT_S = 1200.0  # one process's whole grid; three at once on two cores take ~2 min


def measure_at_once(
    num_at_once: int,
    repeats: int,
    extra_args: Sequence[str] = (),
    timeout_s: float = PROFILE_TIMEOUT_S,
) -> WorkerProfile:
    """The median of `num_at_once` profiles measured at once, one torch thread each."""
    if num_at_once < 1 or repeats < 1:
        raise ProfileError(f"profiles at once and repeats must be >= 1: {num_at_once}, {repeats}")
    with tempfile.TemporaryDirectory(prefix="tandem-profiles-") as folder:
        paths = [Path(folder) / f"at{num_at_once}-{i}.json" for i in range(num_at_once)]
        note = f"{num_at_once} measured at once (plan_validate)"
        commands = [
            [sys.executable, "-m", "services.commands.cli", "profile", "--threads", "1"]
            + ["--repeats", str(repeats), "--note", note, "--out", str(path), *extra_args]
            for path in paths
        ]
        _run_together(commands, timeout_s)
        return WorkerProfile.median_of([WorkerProfile.load(path) for path in paths])


def _run_together(commands: list[list[str]], timeout_s: float) -> None:
    processes = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    failures = []
    try:
        for process in processes:
            try:
                _, stderr = process.communicate(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                failures.append(f"no profile within {timeout_s:g} s")
                continue
            if process.returncode != 0:
                failures.append(f"exit {process.returncode}: {stderr.strip()[-500:]}")
    finally:
        for process in processes:  # a timeout, or an interrupt: none is left running
            if process.poll() is None:
                process.kill()
                process.wait()
    if failures:
        raise ProfileError(f"tandem profile failed: {failures[0]}")


def brief(profile: WorkerProfile) -> str:
    """One line: the largest prefill step and the batch-1 decode steps measured."""
    decode = ", ".join(
        f"ctx {c} {t * 1e3:.0f} ms"
        for c, t in zip(profile.decode_contexts, profile.decode_seconds[0], strict=True)
    )
    return (
        f"prefill {profile.prefill_tokens[-1]} tok {profile.prefill_seconds[-1] * 1e3:.0f} ms; "
        f"decode batch {profile.decode_batch_sizes[0]}: {decode}"
    )
