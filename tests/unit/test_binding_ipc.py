"""An ipc:// address another process serves is refused, not stolen, with real sockets.

ZeroMQ's ipc bind unlinks whatever file is at the path and takes it: a second scheduler (or a
second `tandem up` on the same run directory) took the live one's path, its peers connected to
the newcomer, and the live one kept running, deaf. A socket file nobody listens on (its process
was killed) is still replaced, as before.
"""

from __future__ import annotations

import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
import zmq

from shared.binding import BindError, bind, check_address

RECEIVE_TIMEOUT_MS = 2_000
START_TIMEOUT_S = 20  # (without the fix, the second scheduler serves on: this fails it)


def tandem(*argv: str) -> list[str]:
    return [sys.executable, "-m", "services.commands.cli", *argv]


@pytest.fixture
def context():
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def pull(context: zmq.Context) -> zmq.Socket:
    sock = context.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


def send_from_new_peer(context: zmq.Context, address: str, payload: bytes) -> zmq.Socket:
    """A peer that connects now, as a client started after the second bind would; kept by the
    caller until the message is received (collected, it would close and drop it)."""
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    push.connect(address)
    push.send(payload)
    return push


def leave_stale_socket_file(path: Path) -> None:
    """What a killed process leaves behind: the socket file, nobody listening on it."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as killed:
        killed.bind(str(path))
        killed.listen()
    assert path.is_socket()


def receives(sock: zmq.Socket, payload: bytes) -> bool:
    if not sock.poll(RECEIVE_TIMEOUT_MS):
        return False
    assert sock.recv() == payload
    return True


def test_zeromq_alone_lets_a_second_bind_steal_the_path_of_a_live_one(context, tmp_path):
    """The failure, without `bind`: the first socket never hears from a peer that connects after
    the second bind, and nothing tells it."""
    address = f"ipc://{tmp_path}/scheduler.sock"
    live, newcomer = pull(context), pull(context)
    live.bind(address)
    newcomer.bind(address)  # no error: the live one's file is unlinked under it
    _peer = send_from_new_peer(context, address, b"hello")
    assert receives(newcomer, b"hello")
    assert not live.poll(100)


def test_a_path_another_socket_serves_is_refused_and_the_live_one_keeps_it(context, tmp_path):
    address = f"ipc://{tmp_path}/scheduler.sock"
    live, newcomer = pull(context), pull(context)
    bind(live, address, "address")
    with pytest.raises(BindError) as refused:
        bind(newcomer, address, "address")
    assert str(refused.value) == (
        f"address (--address / TANDEM_ADDRESS): cannot bind {address}: Address already in use "
        "(another process serves this socket file: an earlier tandem still running?)"
    )
    _peer = send_from_new_peer(context, address, b"still here")
    assert receives(live, b"still here")


def test_a_socket_file_nobody_listens_on_is_replaced(context, tmp_path):
    path = tmp_path / "scheduler.sock"
    leave_stale_socket_file(path)
    address = f"ipc://{path}"
    restarted = pull(context)
    bind(restarted, address, "address")
    _peer = send_from_new_peer(context, address, b"back")
    assert receives(restarted, b"back")


def test_a_file_that_is_not_a_socket_is_refused_and_kept(context, tmp_path):
    """ZeroMQ would unlink it: a mistyped address must not delete someone's file."""
    path = tmp_path / "notes.txt"
    path.write_text("keep me")
    with pytest.raises(BindError, match=r"cannot bind ipc://.*notes\.txt: .*not a socket"):
        bind(pull(context), f"ipc://{path}", "address")
    assert path.read_text() == "keep me"


def test_a_directory_at_the_path_is_refused(context, tmp_path):
    (tmp_path / "run").mkdir()
    with pytest.raises(BindError, match="not a socket"):
        bind(pull(context), f"ipc://{tmp_path}/run", "address")
    assert (tmp_path / "run").is_dir()


def test_the_check_before_a_later_bind_refuses_a_served_path_too(context, tmp_path):
    """The gateway and the worker check their addresses before the model loads; the worker's
    bind came a minute later, the gateway's inside its web server (a traceback)."""
    address = f"ipc://{tmp_path}/stream.sock"
    live = pull(context)
    bind(live, address, "stream_address")
    with pytest.raises(BindError, match=r"^stream_address .*: Address already in use \(another"):
        check_address(address, "stream_address")
    stale = tmp_path / "stale.sock"
    leave_stale_socket_file(stale)
    check_address(f"ipc://{stale}", "stream_address")
    assert stale.is_socket()  # (left for the bind to replace)


def test_the_wildcard_address_is_not_probed(context, tmp_path, monkeypatch):
    """`ipc://*` asks ZeroMQ for a fresh path: a file named `*` where we run is not it."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "*").write_text("")
    sock = pull(context)
    bind(sock, "ipc://*", "address")
    assert sock.getsockopt_string(zmq.LAST_ENDPOINT).startswith("ipc://")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract sockets are Linux's")
def test_an_abstract_address_in_use_is_refused_by_the_kernel(context):
    """`ipc://@name` has no file to unlink: the kernel refuses the second bind itself."""
    address = f"ipc://@tandem-test-{uuid.uuid4().hex}"
    live, newcomer = pull(context), pull(context)
    bind(live, address, "address")
    with pytest.raises(BindError, match=f"cannot bind {address}: Address already in use"):
        bind(newcomer, address, "address")
    _peer = send_from_new_peer(context, address, b"still here")
    assert receives(live, b"still here")


def test_a_listener_too_busy_to_accept_is_not_taken_for_a_stale_file(context, tmp_path):
    """Its backlog full, a live listener makes a connect fail at once ("try again"), not refuse."""
    path = tmp_path / "busy.sock"
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as busy,
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as waiting,
    ):
        busy.bind(str(path))
        busy.listen(0)
        waiting.connect(str(path))  # (never accepted: it fills the backlog)
        with pytest.raises(BindError, match="another process serves this socket file"):
            bind(pull(context), f"ipc://{path}", "address")


def test_a_second_scheduler_on_the_path_of_a_live_one_stops_in_one_line(tmp_path):
    """The operator's view, two real `tandem scheduler` processes: the second exits 2 with one
    line naming the setting and the address; the first keeps its socket file."""
    address = f"ipc://{tmp_path}/scheduler.sock"
    argv = tandem("scheduler", "--address", address, "--indexes", "python")
    first = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for line in first.stdout:  # (bound by then; EOF, if it stopped, fails below)
            if "scheduler listening" in line:
                break
        assert first.poll() is None
        second = subprocess.run(argv, capture_output=True, text=True, timeout=START_TIMEOUT_S)
        assert second.returncode == 2
        assert second.stderr == (
            f"tandem scheduler: configuration error: address (--address / TANDEM_ADDRESS): "
            f"cannot bind {address}: Address already in use (another process serves this "
            "socket file: an earlier tandem still running?)\n"
        )
        assert first.poll() is None
        assert (tmp_path / "scheduler.sock").is_socket()
    finally:
        first.terminate()
        first.wait(START_TIMEOUT_S)


def test_a_socket_closed_a_moment_ago_in_this_process_gives_its_path_up(context, tmp_path):
    """ZeroMQ closes a listener on its I/O thread, after `close()` returns: a service restarted
    in-process on its own path met its predecessor's listener about one time in three."""
    address = f"ipc://{tmp_path}/restarted.sock"
    for _ in range(100):
        sock = pull(context)
        bind(sock, address, "address")
        sock.close(linger=0)
