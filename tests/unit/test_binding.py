"""The addresses services listen on: an ipc:// address's directory is made before the bind, and
an address another program holds is a BindError naming the setting (one line, exit status 2, at
the command), with real sockets."""

from __future__ import annotations

import socket
import stat

import pytest
import zmq

from services.scheduler.service import SchedulerConfig, SchedulerService
from shared.config import ConfigError


def test_the_scheduler_binds_an_ipc_address_whose_directory_does_not_exist_yet(tmp_path):
    """The defaults are ipc:///tmp/tandem/*.sock and nothing made /tmp/tandem: `tandem
    scheduler` with its defaults died on a ZMQError."""
    directory = tmp_path / "not" / "yet"
    config = SchedulerConfig(address=f"ipc://{directory}/scheduler.sock", indexes="python")
    service = SchedulerService(config, zmq.Context())
    try:
        assert (directory / "scheduler.sock").exists()
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700  # others' processes stay out
    finally:
        service.socket.close(linger=0)
        service.context.term()


def test_a_taken_address_is_a_bind_error_naming_the_setting(taken_port):
    from shared.binding import BindError, bind

    context = zmq.Context()
    sock = context.socket(zmq.ROUTER)
    try:
        with pytest.raises(BindError) as refused:
            bind(sock, f"tcp://127.0.0.1:{taken_port}", "stream_address")
    finally:
        sock.close(linger=0)
        context.term()
    assert str(refused.value) == (
        f"stream_address (--stream-address / TANDEM_STREAM_ADDRESS): cannot bind "
        f"tcp://127.0.0.1:{taken_port}: Address already in use"
    )
    assert isinstance(refused.value, ConfigError)  # the command's exit status 2


def test_ports_are_checked_before_another_program_binds_them(taken_port, tmp_path):
    from shared.binding import BindError, check_address, check_tcp_port

    with pytest.raises(BindError, match=f"--port: cannot listen on 127.0.0.1:{taken_port}: "):
        check_tcp_port("127.0.0.1", taken_port, "--port")
    with pytest.raises(BindError, match=r"rpc_address \(--rpc-address / TANDEM_RPC_ADDRESS\)"):
        check_address(f"tcp://127.0.0.1:{taken_port}", "rpc_address")
    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]
    check_tcp_port("127.0.0.1", free_port, "--port")  # free: no complaint
    check_address("tcp://127.0.0.1:*", "rpc_address")  # any free port: nothing to check
    check_address(f"ipc://{tmp_path}/a/b.sock", "stream_address")
    assert (tmp_path / "a").is_dir()


def test_a_host_that_resolves_to_no_address_is_a_bind_error_naming_the_setting():
    """It passed the check silently: a standalone gateway logged "gateway ready", then uvicorn
    exited 3 with "ERROR: [Errno -2] Name or service not known"."""
    from shared.binding import BindError, check_address, check_tcp_port

    with pytest.raises(BindError, match=r"^--host: 'no-such-host\.invalid' resolves to no address"):
        check_tcp_port("no-such-host.invalid", 8000, "--host")
    # A ZeroMQ address's host may be an interface name Python cannot resolve: left to the bind.
    check_address("tcp://no-such-host.invalid:5555", "address")
