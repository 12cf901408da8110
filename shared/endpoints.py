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

import dataclasses
import ipaddress
import os
import secrets
import socket
import threading
import time

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
    IPv6-only cluster; IPv4 peers still connect); a name with no IPv4 address (none yet, or
    none known within LOOKUP_TIMEOUT_S: with the option, libzmq still reaches one that later
    resolves to IPv4 only). Not an IPv4 address, a name with one, or an interface name (libzmq
    would take its IPv6 address, which IPv4 peers could not reach)."""
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


# A name's lookup never holds the caller long: a worker opens its socket to a peer's name (a
# decode worker's KV address, a gateway's stream one) in its loop, and a lookup that waited out
# a DNS timeout held every job of the worker for seconds. Invariants: at most one lookup of a
# name in flight, in a thread of its own; only the caller that starts a name's first lookup
# waits for it, at most LOOKUP_TIMEOUT_S; an answer is used for ANSWER_TTL_S, then asked again
# (which finds a name published since), the last answer standing meanwhile. Until a name's
# first answer comes it counts as one with no IPv4 address (IPv6 on: libzmq asks for
# IPv4-mapped addresses, and so reaches one that turns out IPv4 only).
LOOKUP_TIMEOUT_S = 0.25  # (a resolver that answers at all answers in milliseconds)
ANSWER_TTL_S = 30.0
MAX_NAMES_KEPT = 1024  # (names come from peers' addresses: bounded all the same)
MAX_LOOKUPS_IN_FLIGHT = 32  # (threads waiting on a resolver that does not answer)


@dataclasses.dataclass(frozen=True)
class _Answer:
    has_ipv4: bool
    at: float  # time.monotonic() when it came


_resolved: dict[str, _Answer] = {}  # by name, oldest first
_lookups: dict[str, threading.Thread] = {}  # in flight, by name
_lock = threading.Lock()  # (for both: connects come from more than one thread)


def _has_ipv4_address(name: str) -> bool:
    """Whether `name` resolves to an IPv4 address, as far as is known within
    LOOKUP_TIMEOUT_S (a DNS lookup at most once per ANSWER_TTL_S)."""
    with _lock:
        known = _resolved.get(name)
        if known is not None and time.monotonic() - known.at < ANSWER_TTL_S:
            return known.has_ipv4
        lookup = _start_lookup(name)
        if known is not None:  # a refresh: the last answer stands meanwhile, at once
            return known.has_ipv4
    if lookup is not None:
        lookup.join(LOOKUP_TIMEOUT_S)
    with _lock:
        known = _resolved.get(name)
    return known is not None and known.has_ipv4


def _start_lookup(name: str) -> threading.Thread | None:
    """A new lookup of `name` (under `_lock`); None if one is in flight already, or too many."""
    if name in _lookups or len(_lookups) >= MAX_LOOKUPS_IN_FLIGHT:
        return None
    lookup = threading.Thread(target=_look_up, args=(name,), name="dns-lookup", daemon=True)
    _lookups[name] = lookup
    lookup.start()
    return lookup


def _look_up(name: str) -> None:
    found: list = []
    try:
        found = socket.getaddrinfo(name, None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except (OSError, UnicodeError, ValueError):  # gaierror; a label too long for IDNA; a NUL
        pass
    finally:  # (whatever it raised, the name is in flight no more: it is asked again later)
        answer = _Answer(any(family == socket.AF_INET for family, *_ in found), time.monotonic())
        with _lock:
            _resolved.pop(name, None)  # (re-inserted last: the oldest answer is dropped first)
            if len(_resolved) >= MAX_NAMES_KEPT:
                del _resolved[next(iter(_resolved))]
            _resolved[name] = answer
            _lookups.pop(name, None)


def _forget_lookups_after_fork() -> None:
    """A forked child has none of its parent's threads: their lookups would stay 'in flight'
    for good, and a lock one of them held, held."""
    global _lock
    _lock = threading.Lock()
    _lookups.clear()


os.register_at_fork(after_in_child=_forget_lookups_after_fork)
