"""ZeroMQ over IPv6 (`shared.endpoints`): which addresses turn ZeroMQ's IPv6 option on, binds
through `shared.binding.bind` that take an IPv6 address, and the tcp:// addresses tandem writes
with an IPv6 host in brackets. libzmq read every tcp:// host as IPv4: `tcp://[::1]:5555` could
not be bound ("No such device"), and a name with only AAAA records reached nothing."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import zmq

from shared import endpoints
from shared.binding import bind
from shared.endpoints import needs_ipv6, set_ipv6, tcp_address, tcp_host


def has_ipv6_loopback() -> bool:
    """Whether this machine has ::1 (a container may have IPv6 off)."""
    path = Path("/proc/net/if_inet6")
    return path.exists() and any(line.startswith("0" * 31 + "1 ") for line in path.open())


needs_ipv6_loopback = pytest.mark.skipif(not has_ipv6_loopback(), reason="no IPv6 loopback")


@pytest.mark.parametrize(
    ("address", "host"),
    [
        ("tcp://[::1]:5555", "::1"),
        ("tcp://::1:5555", "::1"),  # (libzmq takes it unbracketed too: $(POD_IP) in a manifest)
        ("tcp://[fe80::1%eth0]:5555", "fe80::1%eth0"),
        ("tcp://10.0.0.7:5555", "10.0.0.7"),
        ("tcp://*:5555", "*"),
        ("tcp://sched:5555", "sched"),
        ("tcp://10.0.0.2;[fd00::7]:5555", "fd00::7"),  # a source address, then the peer's
        ("ipc:///tmp/tandem/s.sock", None),
        ("inproc://s", None),
    ],
)
def test_the_host_of_an_address(address, host):
    assert tcp_host(address) == host


@pytest.mark.parametrize(
    "address",
    ["tcp://[::1]:5555", "tcp://::1:5555", "tcp://[::]:5555", "tcp://[fd00::7]:5601",
     "tcp://[fe80::1%eth0]:5555", "tcp://*:5555", "tcp://*:*"],
)  # fmt: skip
def test_an_ipv6_host_or_every_interface_needs_ipv6(address):
    """`*` too: bound IPv4-only it was out of reach in an IPv6-only cluster (dual-stack, IPv4
    peers still connect; on a kernel without IPv6 libzmq binds IPv4 alone)."""
    assert needs_ipv6(address)


@pytest.mark.parametrize(
    "address",
    ["tcp://127.0.0.1:5555", "tcp://0.0.0.0:5555", "ipc:///tmp/tandem/s.sock", "inproc://s",
     "tcp://:5555"],
)  # fmt: skip
def test_ipv4_addresses_and_other_transports_keep_ipv4(address):
    assert not needs_ipv6(address)


def resolving(monkeypatch, addresses: dict[str, list[int]]) -> list[str]:
    """getaddrinfo as a resolver that knows each name's address families, and nothing else;
    the names it was asked, in a list."""
    asked = []

    def getaddrinfo(host, port, family=0, *args, **kwargs):
        asked.append(host)
        found = [f for f in addresses.get(host, []) if family in (f, socket.AF_UNSPEC)]
        if not found:
            raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        ips = {socket.AF_INET: "10.0.0.7", socket.AF_INET6: "fd00::7"}
        return [(f, socket.SOCK_STREAM, 6, "", (ips[f], 0)) for f in found]

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(endpoints, "_resolved", {})
    monkeypatch.setattr(endpoints, "_lookups", {})
    monkeypatch.setattr(endpoints, "LOOKUP_TIMEOUT_S", 10.0)  # (answers at once: wait for it)
    return asked


def test_a_name_with_only_ipv6_addresses_needs_ipv6(monkeypatch):
    """An IPv6-only Kubernetes cluster: `tandem-scheduler` has AAAA records, no A."""
    resolving(monkeypatch, {"tandem-scheduler": [socket.AF_INET6]})
    assert needs_ipv6("tcp://tandem-scheduler:5555")


def test_a_name_with_an_ipv4_address_keeps_ipv4(monkeypatch):
    """IPv6 on for `localhost` (::1 first, in most /etc/hosts) missed a peer bound to
    0.0.0.0 or 127.0.0.1, which reached it before."""
    resolving(monkeypatch, {"localhost": [socket.AF_INET, socket.AF_INET6]})
    assert not needs_ipv6("tcp://localhost:5555")


def test_a_name_not_resolving_yet_needs_ipv6(monkeypatch):
    """(A Service's DNS name before it exists: with IPv6 on, libzmq reaches it whichever
    address it gets; with it off, never an IPv6 one.)"""
    asked = resolving(monkeypatch, {})
    assert needs_ipv6("tcp://tandem-scheduler:5555")
    monkeypatch.setattr(endpoints, "ANSWER_TTL_S", 0.0)  # (asked again once its answer is old)
    assert needs_ipv6("tcp://tandem-scheduler:5555") and len(asked) == 2


def test_a_name_is_looked_up_once(monkeypatch):
    """A worker opens its socket to a gateway's name again after closing it idle, in its
    loop: a lookup each time would hold the loop as long as DNS took."""
    asked = resolving(monkeypatch, {"gateway": [socket.AF_INET], "sched": [socket.AF_INET6]})
    for _ in range(3):
        assert not needs_ipv6("tcp://gateway:5600") and needs_ipv6("tcp://sched:5555")
    assert asked == ["gateway", "sched"]


def test_an_interface_name_keeps_ipv4(monkeypatch):
    """libzmq with IPv6 on binds an interface name to the interface's IPv6 address, which IPv4
    peers (reaching it before) cannot reach."""
    resolving(monkeypatch, {})
    monkeypatch.setattr(endpoints, "_interface_names", lambda: {"lo", "eth0"})
    assert not needs_ipv6("tcp://eth0:5555")


def test_the_option_is_set_on_the_socket():
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    try:
        assert set_ipv6(sock, "tcp://[::1]:5555").getsockopt(zmq.IPV6) == 1
        assert set_ipv6(sock, "tcp://127.0.0.1:5555").getsockopt(zmq.IPV6) == 0
    finally:
        sock.close(linger=0)
        context.term()


def test_an_address_of_an_ipv6_host_is_bracketed():
    assert tcp_address("::1", 8001) == "tcp://[::1]:8001"
    assert tcp_address("fd00::7", "5601") == "tcp://[fd00::7]:5601"
    assert tcp_address("[::1]", 8001) == "tcp://[::1]:8001"  # (bracketed already)
    assert tcp_address("127.0.0.1", 8001) == "tcp://127.0.0.1:8001"
    assert tcp_address("gateway", 8001) == "tcp://gateway:8001"


@needs_ipv6_loopback
@pytest.mark.parametrize("address", ["tcp://[::1]:*", "tcp://[::]:*", "tcp://::1:*"])
def test_a_service_binds_an_ipv6_address(address):
    """Every service binds through `bind`: `--address tcp://[::1]:5555` was a BindError,
    "No such device"."""
    context = zmq.Context()
    server, client = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    try:
        bind(server, address, "address")
        port = server.last_endpoint.decode().rpartition(":")[2]
        endpoints.connect(client, f"tcp://[::1]:{port}")
        client.send(b"hello")
        assert server.poll(5000) and server.recv() == b"hello"
    finally:
        server.close(linger=0)
        client.close(linger=0)
        context.term()


@needs_ipv6_loopback
def test_a_bind_to_every_interface_takes_ipv6_and_ipv4_peers():
    """`tcp://*:5555` was bound on IPv4 alone: no IPv6 peer could connect."""
    context = zmq.Context()
    server = context.socket(zmq.PULL)
    clients = [context.socket(zmq.PUSH) for _ in range(2)]
    try:
        bind(server, "tcp://*:*", "address")
        port = server.last_endpoint.decode().rpartition(":")[2]
        for client, host in zip(clients, ("[::1]", "127.0.0.1"), strict=True):
            endpoints.connect(client, f"tcp://{host}:{port}")
            client.send(host.encode())
        received = set()
        while len(received) < 2 and server.poll(5000):
            received.add(server.recv())
        assert received == {b"[::1]", b"127.0.0.1"}
    finally:
        server.close(linger=0)
        for client in clients:
            client.close(linger=0)
        context.term()


def test_up_gives_the_gateway_an_rpc_address_with_brackets(monkeypatch):
    """`tandem up --host ::1 --rpc-port N` passed `tcp://::1:N` to the gateway and the batch
    service: libzmq reads it, but nothing else does (`tcp://[::1]:N` is the form)."""
    from tests.unit.test_cli import _flag, _spawned_argvs

    monkeypatch.setattr("services.commands.up.check_tcp_port", lambda *args: None)  # (unbound)
    argvs = _spawned_argvs(monkeypatch, ["--host", "::1", "--rpc-port", "8001"], {})
    assert _flag(argvs["gateway"], "--rpc-address") == "tcp://[::1]:8001"
    assert _flag(argvs["batch"], "--gateway-rpc-address") == "tcp://[::1]:8001"


# Where a bind or connect may be called directly: the helpers themselves, `wire.connect_refusal`
# (`PeerSockets` calls `set_ipv6` first; the scheduler's probe of a peer's address, closed at
# once, needs no option: ZeroMQ's check of an address's form is the same either way), and what
# is no ZeroMQ socket.
DIRECT_CALLS_ALLOWED = {
    "shared/endpoints.py": {"connect"},
    "shared/binding.py": {"bind"},  # (and `check_tcp_port`'s Python socket)
    "shared/wire.py": {"connect"},
    "services/batch/store.py": {"connect"},  # sqlite3
}


def test_every_bind_and_connect_goes_through_the_helpers():
    """A socket bound or connected directly misses ZeroMQ's IPv6 option: one service left out
    would leave an IPv6 cluster half working."""
    import ast

    root = Path(__file__).resolve().parents[2]
    direct = []
    for path in sorted([*root.glob("services/**/*.py"), *root.glob("shared/**/*.py")]):
        name = path.relative_to(root).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), name)):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("bind", "connect")
                and node.func.attr not in DIRECT_CALLS_ALLOWED.get(name, set())
            ):
                direct.append(f"{name}:{node.lineno} .{node.func.attr}()")
    assert direct == [], "use shared.binding.bind / shared.endpoints.connect"
