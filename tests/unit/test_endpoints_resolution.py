"""A name's lookup never holds a worker's loop for long: `needs_ipv6` asks DNS at most once per
name per interval and waits a small bound for the answer.

A prefill worker opens its socket to a decode worker's KV address (and a worker to a gateway's
stream address) in its loop when a job first names it; a lookup that waited out a DNS timeout
held every job of the worker for seconds, on every connect to a name that did not answer.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import zmq

from shared import endpoints
from shared.endpoints import needs_ipv6

DNS_TIMEOUT_S = 2.0  # (what a resolver that does not answer costs, made short)
STALL_LIMIT_S = 0.5  # (the bound, with room for a busy machine)


def answer(families: list[int]) -> list[tuple]:
    ips = {socket.AF_INET: "10.0.0.7", socket.AF_INET6: "fd00::7"}
    return [(family, socket.SOCK_STREAM, 6, "", (ips[family], 0)) for family in families]


@pytest.fixture
def fresh_cache(monkeypatch):
    monkeypatch.setattr(endpoints, "_resolved", {})
    monkeypatch.setattr(endpoints, "_lookups", {})
    yield
    for lookup in list(endpoints._lookups.values()):  # (none left to write into the next test's)
        lookup.join()


@pytest.fixture
def slow_dns(monkeypatch, fresh_cache):
    """getaddrinfo that answers `families[name]` only once `answering` is set (or after
    DNS_TIMEOUT_S); the names it was asked, in a list."""
    asked: list[str] = []
    answering = threading.Event()
    families: dict[str, list[int]] = {}

    def getaddrinfo(host, *args, **kwargs):
        asked.append(host)
        answering.wait(DNS_TIMEOUT_S)
        if not families.get(host):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return answer(families[host])

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield asked, answering, families
    answering.set()  # (lets a lookup still waiting end)


def timed_needs_ipv6(address: str) -> tuple[bool, float]:
    start = time.monotonic()
    needed = needs_ipv6(address)
    return needed, time.monotonic() - start


def wait_for_answer(name: str) -> None:
    deadline = time.monotonic() + 5
    while name not in endpoints._resolved:
        assert time.monotonic() < deadline, "the lookup never recorded its answer"
        time.sleep(0.01)


def test_a_name_dns_does_not_answer_holds_a_connect_only_the_bound(slow_dns):
    asked, _, _ = slow_dns
    for _ in range(3):
        needed, took = timed_needs_ipv6("tcp://decode-7.tandem:6000")
        assert took < STALL_LIMIT_S
        assert needed  # (none yet: with IPv6 on, libzmq reaches it whichever address it gets)
    assert asked == ["decode-7.tandem"]  # (one lookup in flight, not one per connect)


def test_an_answer_that_comes_after_the_bound_is_kept_for_the_next_connect(slow_dns):
    asked, answering, families = slow_dns
    families["decode-7.tandem"] = [socket.AF_INET]
    assert needs_ipv6("tcp://decode-7.tandem:6000")
    answering.set()
    wait_for_answer("decode-7.tandem")
    assert not needs_ipv6("tcp://decode-7.tandem:6000")
    assert asked == ["decode-7.tandem"]


def test_a_name_that_does_not_resolve_is_asked_once_per_interval(slow_dns, monkeypatch):
    asked, answering, _ = slow_dns
    answering.set()  # (answers at once: "no such name")
    for _ in range(5):
        assert needs_ipv6("tcp://not-published-yet:6000")
    assert asked == ["not-published-yet"]
    monkeypatch.setattr(endpoints, "ANSWER_TTL_S", 0.0)  # (the interval over)
    assert needs_ipv6("tcp://not-published-yet:6000")
    assert asked == ["not-published-yet"] * 2


def test_a_refresh_dns_does_not_answer_keeps_the_last_answer(slow_dns, monkeypatch):
    """A name with A and AAAA records keeps IPv4 (IPv6 on would take its AAAA first and miss
    a peer bound to an IPv4 address) while its refresh waits on DNS."""
    asked, answering, families = slow_dns
    families["gateway"] = [socket.AF_INET, socket.AF_INET6]
    answering.set()
    assert not needs_ipv6("tcp://gateway:5600")
    answering.clear()
    monkeypatch.setattr(endpoints, "ANSWER_TTL_S", 0.0)
    needed, took = timed_needs_ipv6("tcp://gateway:5600")
    assert not needed and took < STALL_LIMIT_S
    assert asked == ["gateway"] * 2


def test_lookups_in_flight_are_bounded(slow_dns, monkeypatch):
    """Names come from peers' addresses: a thread each, for names DNS never answers, is
    bounded all the same."""
    asked, _, _ = slow_dns
    monkeypatch.setattr(endpoints, "MAX_LOOKUPS_IN_FLIGHT", 2)
    monkeypatch.setattr(endpoints, "LOOKUP_TIMEOUT_S", 0.01)
    for index in range(4):
        assert needs_ipv6(f"tcp://peer-{index}:6000")
    assert asked == ["peer-0", "peer-1"]


def test_names_kept_are_bounded(monkeypatch, fresh_cache):
    monkeypatch.setattr(socket, "getaddrinfo", lambda *args, **kwargs: answer([socket.AF_INET]))
    monkeypatch.setattr(endpoints, "MAX_NAMES_KEPT", 3)
    for index in range(5):
        assert not needs_ipv6(f"tcp://peer-{index}:6000")
    assert list(endpoints._resolved) == ["peer-2", "peer-3", "peer-4"]  # (the oldest go)


def refusing_resolver(host, *args, **kwargs):
    """getaddrinfo's refusals that come before any query: a label too long for IDNA
    (UnicodeError, from the real encoding), an embedded NUL (ValueError), else no such name."""
    host.encode("idna")
    if "\x00" in host:
        raise ValueError("embedded null character")
    raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")


@pytest.mark.parametrize(
    "address",
    ["tcp://bad\x00name:6000", f"tcp://{'a' * 70}.example:6000", "tcp://-:6000",
     "tcp://:6000", "tcp://", "ipc:///tmp/x.sock", "tcp://[:6000", "tcp://a;:6000"],
)  # fmt: skip
def test_a_name_no_resolver_takes_is_answered_without_error(address, fresh_cache, monkeypatch):
    """An address from the wire: a name getaddrinfo refuses is one with no address yet, not an
    exception in the worker's step."""
    monkeypatch.setattr(socket, "getaddrinfo", refusing_resolver)
    assert needs_ipv6(address) in (True, False)
    assert not endpoints._lookups  # (each lookup ended, none left waiting)


def test_with_ipv6_on_a_name_with_only_an_ipv4_address_is_reached(fresh_cache):
    """The 'none yet' answer is safe for a name that later resolves to IPv4 only: libzmq asks
    for IPv4-mapped addresses (AI_V4MAPPED) and reaches a peer bound to an IPv4 address."""
    try:
        found = socket.getaddrinfo("localhost", None, socket.AF_UNSPEC, socket.SOCK_STREAM)
    except OSError:
        pytest.skip("localhost does not resolve here")
    if {family for family, *_ in found} != {socket.AF_INET}:
        pytest.skip("localhost has an IPv6 address here")
    context = zmq.Context()
    try:
        pull, push = context.socket(zmq.PULL), context.socket(zmq.PUSH)
        for sock in (pull, push):
            sock.setsockopt(zmq.LINGER, 0)
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        push.setsockopt(zmq.IPV6, 1)
        push.connect(f"tcp://localhost:{port}")
        push.send(b"reached")
        assert pull.poll(2_000) and pull.recv() == b"reached"
    finally:
        context.destroy(linger=0)


def test_ip_addresses_every_interface_and_interface_names_ask_no_resolver(monkeypatch):
    def getaddrinfo(*args, **kwargs):
        raise AssertionError("looked up")

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    monkeypatch.setattr(endpoints, "_interface_names", lambda: {"eth0"})
    assert needs_ipv6("tcp://*:6000") and needs_ipv6("tcp://[::1]:6000")
    assert not needs_ipv6("tcp://10.0.0.7:6000") and not needs_ipv6("tcp://eth0:6000")
