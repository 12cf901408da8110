"""Two processes binding one ipc:// path at the same instant: exactly one takes it.

The probe before the bind (`refuse_served_ipc_path`) saw the file absent or stale in both, both
bound, and the second's bind unlinked the first's socket file: the first served on, deaf. A lock
beside the path (`<path>.lock`) makes probe and bind one step per path.
"""

from __future__ import annotations

import fcntl
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import zmq

from shared import binding
from shared.binding import BindError, bind

NUM_ROUNDS = 200  # (before the lock, about one round in 60 bound twice)
SERVED = "another process serves this socket file"
BARRIER_TIMEOUT_S = 30


def leave_stale_socket_file(path: str) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as killed:
        killed.bind(path)
        killed.listen()


def bind_each_round(directory: str, barrier, results) -> None:
    """In each of two processes: bind the round's path when the other does, report, and keep
    the socket until both have reported (the winner's must be live for the loser's probe)."""
    context = zmq.Context()
    for round_index in range(NUM_ROUNDS):
        sock = context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        barrier.wait(BARRIER_TIMEOUT_S)
        try:
            bind(sock, f"ipc://{directory}/{round_index}.sock", "address")
            results.put((round_index, "bound"))
        except BindError as error:
            results.put((round_index, str(error)))
        barrier.wait(BARRIER_TIMEOUT_S)
        sock.close(linger=0)
    context.term()


def test_two_processes_binding_one_path_at_once_one_wins(tmp_path):
    for round_index in range(0, NUM_ROUNDS, 2):  # (half the rounds find a stale file)
        leave_stale_socket_file(f"{tmp_path}/{round_index}.sock")
    spawn = multiprocessing.get_context("spawn")
    barrier, results = spawn.Barrier(2), spawn.Queue()
    binders = [
        spawn.Process(target=bind_each_round, args=(str(tmp_path), barrier, results))
        for _ in range(2)
    ]
    for binder in binders:
        binder.start()
    outcomes: dict[int, list[str]] = {}
    for _ in range(2 * NUM_ROUNDS):
        round_index, outcome = results.get(timeout=BARRIER_TIMEOUT_S)
        outcomes.setdefault(round_index, []).append(outcome)
    for binder in binders:
        binder.join(BARRIER_TIMEOUT_S)
        assert binder.exitcode == 0
    both_bound = [index for index, seen in outcomes.items() if seen == ["bound", "bound"]]
    assert both_bound == [], f"{len(both_bound)} of {NUM_ROUNDS} rounds bound twice"
    for seen in outcomes.values():
        winner, loser = sorted(seen, key=lambda outcome: outcome != "bound")
        assert winner == "bound" and SERVED in loser, seen
    assert not list(tmp_path.glob("*.lock"))  # (none left behind)


def test_no_lock_file_is_left_beside_a_bound_or_refused_path(tmp_path):
    context = zmq.Context()
    try:
        address = f"ipc://{tmp_path}/scheduler.sock"
        live, newcomer = context.socket(zmq.PULL), context.socket(zmq.PULL)
        bind(live, address, "address")
        with pytest.raises(BindError, match=SERVED):
            bind(newcomer, address, "address")
        assert sorted(path.name for path in tmp_path.iterdir()) == ["scheduler.sock"]
    finally:
        context.destroy(linger=0)


HOLD_LOCK = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)
fcntl.flock(fd, fcntl.LOCK_EX)
print("locked", flush=True)
time.sleep(60)
"""


def test_a_binder_killed_holding_the_lock_leaves_the_path_bindable(tmp_path):
    """flock is the kernel's: a process that dies mid-bind (SIGKILL) lets it go."""
    path = f"{tmp_path}/scheduler.sock"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, f"{path}.lock"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        os.kill(holder.pid, signal.SIGKILL)
    finally:
        holder.wait(10)
    context = zmq.Context()
    try:
        bind(context.socket(zmq.PULL), f"ipc://{path}", "address")
        assert not Path(f"{path}.lock").exists()
    finally:
        context.destroy(linger=0)


def test_a_bind_waiting_on_a_lock_never_released_stops_with_a_clear_error(tmp_path, monkeypatch):
    """A binder stopped mid-bind (SIGSTOP, a debugger) holds the lock: the next one says so
    instead of waiting for good."""
    monkeypatch.setattr(binding, "IPC_LOCK_TIMEOUT_S", 0.2)
    path = f"{tmp_path}/scheduler.sock"
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    context = zmq.Context()
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with pytest.raises(BindError, match=r"cannot bind ipc://.*: .*another process is binding"):
            bind(context.socket(zmq.PULL), f"ipc://{path}", "address")
        assert not Path(path).exists()
    finally:
        os.close(fd)
        context.destroy(linger=0)


@pytest.mark.parametrize("kind", ["directory", "fifo", "symlink"])
def test_a_lock_path_that_is_not_a_plain_file_is_refused_and_kept(tmp_path, kind):
    """`<path>.lock` may be someone's: the bind refuses it rather than lock or remove it."""
    path = f"{tmp_path}/scheduler.sock"
    lock_path = Path(f"{path}.lock")
    if kind == "directory":
        lock_path.mkdir()
    elif kind == "fifo":
        os.mkfifo(lock_path)
    else:
        (tmp_path / "elsewhere").write_text("keep me")
        lock_path.symlink_to(tmp_path / "elsewhere")
    context = zmq.Context()
    try:
        with pytest.raises(BindError, match=r"cannot bind ipc://"):
            bind(context.socket(zmq.PULL), f"ipc://{path}", "address")
        assert lock_path.exists() or lock_path.is_symlink()
    finally:
        context.destroy(linger=0)
