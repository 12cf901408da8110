"""ZeroMQ tcp:// endpoints over IPv6: which sockets need ZeroMQ's IPv6 option, and tcp://
addresses written with an IPv6 host in brackets.

libzmq reads a tcp:// host as IPv4 unless the socket has `zmq.IPV6` set: without it an IPv6
literal (`tcp://[::1]:5555`) cannot be bound ("No such device") and is connected to never,
silently, and a name with only AAAA records (an IPv6-only Kubernetes cluster) reaches nothing.

The option is not set on every socket, as it is not harmless: with it libzmq resolves a name to
its IPv6 address before its IPv4 one and binds an interface name to its IPv6 address, so with
`::1 localhost` in /etc/hosts (Debian's, Fedora's) a worker told `tcp://localhost:5555` no
longer reached a scheduler bound to `tcp://0.0.0.0:5555`. It is set where the address needs it
(`needs_ipv6`), which leaves every address that worked over IPv4 as it was. Every bind
(`shared.binding.bind`) and connect (`connect`, or `set_ipv6` before `wire.connect_refusal`)
asks here, so no socket is left out (tests/unit/test_ipv6_endpoints.py checks).

A kernel without IPv6 needs nothing more: libzmq, failing to make an IPv6 socket
(EAFNOSUPPORT), binds and connects over IPv4 instead, and with IPv6 only disabled (the
`disable_ipv6` sysctl) a `tcp://*` bind takes IPv4 connections as before.
"""

from __future__ import annotations

import ipaddress
import secrets
import socket

import zmq

TCP_PREFIX = "tcp://"


def tcp_host(address: str) -> str | None:
    """The host of a `tcp://host:port` address, brackets removed (of a ZeroMQ source address,
    `tcp://source;host:port`, the destination's); None for another transport."""
    if not address.startswith(TCP_PREFIX):
        return None
    host = address[len(TCP_PREFIX) :].rpartition(":")[0].rpartition(";")[2]
    return host.removeprefix("[").removesuffix("]")


def ip_version(host: str) -> int | None:
    """4 or 6 for an IP address (`10.0.0.7`, `::1`, `fe80::1%eth0`), None for a name."""
    try:
        return ipaddress.ip_address(host).version
    except ValueError:
        return None


def needs_ipv6(address: str) -> bool:
    """Whether a socket bound or connected to `address` needs ZeroMQ's IPv6 option: an IPv6
    host; `*`, every interface (with it, IPv6 ones too: an IPv4-only bind is unreachable in an
    IPv6-only cluster; IPv4 peers still connect); a name with no IPv4 address (none yet: with
    the option, libzmq still reaches one that later resolves to IPv4 only). Not an IPv4
    address, a name with one, or an interface name (libzmq would take its IPv6 address, which
    IPv4 peers could not reach)."""
    host = tcp_host(address)
    if not host:
        return False
    version = ip_version(host)
    if host == "*" or version == 6:
        return True
    if version == 4 or host in _interface_names():
        return False
    return not _has_ipv4_address(host)


def set_ipv6(sock: zmq.Socket, address: str) -> zmq.Socket:
    """Sets ZeroMQ's IPv6 option on `sock` as `address` needs it; before its bind or connect."""
    sock.setsockopt(zmq.IPV6, int(needs_ipv6(address)))
    return sock


def connect(sock: zmq.Socket, address: str) -> None:
    """`sock.connect(address)`, IPv6 enabled where the address needs it."""
    set_ipv6(sock, address).connect(address)


# A ROUTER identity is at most 255 bytes, and one starting with a zero byte is libzmq's own kind.
ROUTING_ID_PREFIX = "tandem:"
MAX_ROUTING_ID_PEER_ID = 200  # bytes of the peer id kept in it (the rest: prefix and nonce)


def routing_id(peer_id: str) -> bytes:
    """A DEALER's routing id, one per process: the peer id (readable in the scheduler's log)
    and a random nonce, so that two processes under one peer id (a restarted worker whose old
    self lingers) never take over each other's messages at a ROUTER_HANDOVER ROUTER. Set on a
    socket before it connects (`set_routing_id`), it stays the same across reconnects: a
    ROUTER without it names each new connection anew, and what it sent to the old name after
    a brief cut was dropped until the peer said who it was again."""
    name = peer_id.encode(errors="replace")[:MAX_ROUTING_ID_PEER_ID].decode(errors="ignore")
    return f"{ROUTING_ID_PREFIX}{name}:{secrets.token_hex(8)}".encode()


def set_routing_id(sock: zmq.Socket, peer_id: str) -> zmq.Socket:
    """Gives `sock` (a DEALER, before it connects) its `routing_id`."""
    sock.setsockopt(zmq.ROUTING_ID, routing_id(peer_id))
    return sock


def tcp_address(host: str, port: int | str) -> str:
    """`tcp://host:port`, an IPv6 host in brackets (`tcp://[::1]:8001`) as libzmq and URLs
    write it; a host given in brackets is kept so."""
    if ip_version(host) == 6:
        host = f"[{host}]"
    return f"{TCP_PREFIX}{host}:{port}"


def host_ip(hostname: str) -> str:
    """The IP address `hostname` resolves to: its IPv4 one, or where it has none (an IPv6-only
    container or pod) its IPv6 one. OSError (socket.gaierror) when it resolves to neither."""
    try:
        return socket.gethostbyname(hostname)  # (IPv4 only)
    except OSError:
        found = socket.getaddrinfo(hostname, None, socket.AF_INET6, socket.SOCK_STREAM)
        return str(found[0][4][0])


def _interface_names() -> set[str]:
    try:
        return {name for _, name in socket.if_nameindex()}
    except OSError:
        return set()


# Names resolved, and whether to an IPv4 address: a worker opens a socket to a peer's name again
# after closing it idle, in its loop, which a lookup each time would hold up as long as DNS took.
# (A name that did not resolve is asked again: it may be one not yet published.)
_resolved: dict[str, bool] = {}
MAX_NAMES_KEPT = 1024  # (names come from peers' addresses: bounded all the same)


def _has_ipv4_address(name: str) -> bool:
    """Whether `name` resolves to an IPv4 address (a DNS lookup, the first time)."""
    known = _resolved.get(name)
    if known is not None:
        return known
    try:
        found = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError):  # gaierror; a label too long for IDNA
        return False
    has_ipv4 = any(family == socket.AF_INET for family, *_ in found)
    if len(_resolved) < MAX_NAMES_KEPT:
        _resolved[name] = has_ipv4
    return has_ipv4
