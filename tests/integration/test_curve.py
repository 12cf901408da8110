"""CurveZMQ: keys written and loaded, wrong settings refused, and a real scheduler process that
answers a peer holding the cluster's key and refuses (and logs) every other."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import zmq
import zmq.auth

from services.worker.config import WorkerConfig
from shared import wire
from shared.config import ConfigError, config_from_args
from shared.curve import ClientKeys, CurveError, CurveKeys, Security, generate, load_keys
from shared.logs import get_logger


@pytest.fixture
def keys_dir(tmp_path):
    generate(tmp_path / "keys", clients=("agent",))
    return tmp_path / "keys"


def test_keys_round_trip_through_files_and_the_environment(keys_dir):
    from_files = CurveKeys.from_dir(keys_dir)
    agent = ClientKeys.from_dir(keys_dir, "agent")
    assert agent.public in from_files.authorized and from_files.public in from_files.authorized
    assert agent.server_public == from_files.public
    from_env = load_keys(None, from_files.secret.decode(), (agent.public.decode(),))
    assert from_env == from_files  # the same secret derives the same public key
    assert (keys_dir / "cluster.key_secret").stat().st_mode & 0o077 == 0  # owner only


@pytest.mark.parametrize(
    "environ,needle",
    [
        ({"TANDEM_CURVE_SECRET_KEY": "short"}, "40 characters"),
        ({"TANDEM_CURVE_KEYS_DIR": "/nonexistent/keys"}, "cannot load CurveZMQ keys"),
        ({"TANDEM_CURVE_CLIENT_KEYS": "x" * 40}, "without the cluster's keys"),
        ({"TANDEM_CURVE_KEYS_DIR": "/k", "TANDEM_CURVE_SECRET_KEY": "y" * 40}, "not both"),
        # Given empty (a Secret made from an unset variable): was read as unset, in clear.
        ({"TANDEM_CURVE_SECRET_KEY": ""}, "TANDEM_CURVE_SECRET_KEY is given but empty"),
        ({"TANDEM_CURVE_KEYS_DIR": " none "}, "TANDEM_CURVE_KEYS_DIR is given but empty"),
    ],
)
def test_wrong_curve_settings_are_refused_at_start_up(environ, needle):
    with pytest.raises(ConfigError, match=needle):
        config_from_args(WorkerConfig, environ=environ)


def test_a_client_name_must_be_plain(tmp_path):
    with pytest.raises(CurveError, match="client name"):
        generate(tmp_path, clients=("../evil",))


@pytest.fixture
def scheduler(keys_dir, tmp_path):
    address = f"ipc://{tmp_path}/scheduler.sock"
    log = tmp_path / "scheduler.log"
    process = subprocess.Popen(
        [sys.executable, "-m", "services.commands.cli", "scheduler", "--address", address,
         "--curve-keys-dir", str(keys_dir)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env=dict(os.environ, TANDEM_LOG_FORMAT="json"),
    )  # fmt: skip
    deadline = time.monotonic() + 30
    while "scheduler listening" not in log.read_text():
        assert process.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.1)
    yield address, log
    process.terminate()
    process.wait(10)


def say_hello(address: str, secure) -> wire.Message | None:
    """HELLO from a DEALER set up by `secure`; the answer, or None after 3 s of silence."""
    context = zmq.Context()
    socket = secure(context.socket(zmq.DEALER))
    socket.setsockopt(zmq.LINGER, 0)
    socket.connect(address)
    hello = wire.Hello(schema_version=wire.SCHEMA_VERSION, role="gateway", peer_id="g",
                       model="smollm2", address="ipc:///nowhere/g", num_kv_blocks=0, block_size=0,
                       max_num_seqs=0)  # fmt: skip
    wire.send(socket, hello)
    answer = wire.recv(socket) if socket.poll(3000) else None
    socket.close()
    context.term()
    return answer


def with_keys(public: bytes, secret: bytes, server: bytes):
    def secure(socket: zmq.Socket) -> zmq.Socket:
        socket.curve_publickey, socket.curve_secretkey, socket.curve_serverkey = (
            public,
            secret,
            server,
        )
        return socket

    return secure


def test_only_a_peer_with_the_clusters_key_gets_in(scheduler, keys_dir):
    address, log = scheduler
    cluster = CurveKeys.from_dir(keys_dir)
    answer = say_hello(address, Security(cluster, get_logger()).client)
    assert isinstance(answer, wire.HelloAck) and answer.accepted

    stranger_public, stranger_secret = zmq.curve_keypair()
    assert say_hello(address, with_keys(stranger_public, stranger_secret, cluster.public)) is None
    assert say_hello(address, lambda socket: socket) is None  # no encryption at all
    impostor_public, _ = zmq.curve_keypair()  # expects another server: refuses ours
    assert say_hello(address, with_keys(cluster.public, cluster.secret, impostor_public)) is None
    # An RPC client's key opens the gateway's RPC door only: it let an agent HELLO as a
    # worker (and be sent others' prompts) or SUBMIT as any tenant, past its API key.
    agent = ClientKeys.from_dir(keys_dir, "agent")
    assert say_hello(address, agent.apply) is None
    time.sleep(0.5)
    text = log.read_text()
    assert "peer refused: unknown CurveZMQ key" in text and stranger_public.decode() in text
    assert agent.public.decode() in text


def test_the_rpc_door_closes_with_curve_on(keys_dir, tmp_path):
    """Its authenticator's socket was left open, and the context's term waited for it for
    ever: a gateway with CurveZMQ and an RPC door hung on shutdown until killed."""
    import asyncio
    import threading

    from services.gateway.rpc import RpcServer

    async def start_and_close() -> None:
        server = RpcServer(None, f"ipc://{tmp_path}/rpc.sock", curve=CurveKeys.from_dir(keys_dir))
        await server.start()
        await server.close()

    # (In a thread of its own: a hang blocks the thread, which the test then finds alive.)
    closing = threading.Thread(target=asyncio.run, args=(start_and_close(),), daemon=True)
    closing.start()
    closing.join(10)
    assert not closing.is_alive(), "the RPC door's close hung"
