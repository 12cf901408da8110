"""The addresses a service listens on: readied before the bind, refused in one line when taken.

Every ZeroMQ bind goes through `bind`: an `ipc://` address gets its directory made first (the
defaults live in /tmp/tandem, which nothing else creates), a tcp:// one ZeroMQ's IPv6 option
where it needs it (`shared.endpoints`), and a bind that fails (the port in
use, an address not this machine's) is a `BindError` naming the setting, which the `tandem`
command prints as one line with exit status 2 instead of a traceback. An `ipc://` socket file
is probed first (`refuse_served_ipc_path`): ZeroMQ's bind unlinks whatever is at the path and
takes it, so a second scheduler on the same path took it from the live one, whose peers then
reached the newcomer while it ran on, deaf. Probe and bind are one step per path
(`ipc_path_lock`): two binds started at the same instant both found the file absent or stale,
and both bound. TCP ports that another
program binds for us (uvicorn, `tandem up`'s gateway) are checked beforehand with
`check_tcp_port` (`check_address` for a ZeroMQ one): free now, or refused the same way (as is a
host that resolves to no address).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import stat
import time
from collections.abc import Iterator

import zmq

from shared.config import ConfigError, env_name, flag_name
from shared.endpoints import set_ipv6

IPC_PREFIX = "ipc://"
IPC_PROBE_TIMEOUT_S = 0.2  # (a local connect: answered at once, refused or accepted)
# A listener must answer this many probes this far apart to count as served: a ZeroMQ socket
# closed in this process a moment ago closes its listener on its I/O thread, a little later,
# and a service restarted in-process on its own path was refused about one time in three.
IPC_PROBE_ATTEMPTS = 3
IPC_PROBE_INTERVAL_S = 0.02
# A binder holds its path's lock through its probes and bind: well under a second.
IPC_LOCK_TIMEOUT_S = 5.0
IPC_LOCK_POLL_S = 0.005


class BindError(ConfigError):
    """An address a service is told to listen on that it cannot take; the message names the
    setting. A ConfigError: the fix is another value for it (or stopping what holds it)."""


def describe(*names: str) -> str:
    """`name (--name / TANDEM_NAME)`, for each setting named, as ConfigError messages say it."""
    return ", ".join(f"{name} ({flag_name(name)} / {env_name(name)})" for name in names)


def ensure_ipc_dir(address: str) -> None:
    """Makes the directory of an `ipc://` socket file (private to this user, as `tandem up`'s
    run directory is); other addresses, and Linux's abstract `ipc://@name`, need none."""
    if not address.startswith(IPC_PREFIX):
        return
    path = address[len(IPC_PREFIX) :]
    directory = os.path.dirname(path)
    if path.startswith("@") or not directory:
        return
    os.makedirs(directory, mode=0o700, exist_ok=True)


def refuse_served_ipc_path(address: str) -> None:
    """BindError-ready OSError if the file of an `ipc://` address is one ZeroMQ's bind must not
    unlink: a socket another process accepts connections on, or not a socket at all. A socket
    file nobody listens on (its process was killed) passes, for the bind to replace. Abstract
    `ipc://@name` needs no probe (the kernel refuses a name in use), nor `ipc://*` (a fresh
    path). Two binds started at the same instant can still both pass: the probe narrows the
    window to the moment between it and the bind: `bind` holds `ipc_path_lock` across both."""
    if not address.startswith(IPC_PREFIX):
        return
    path = address[len(IPC_PREFIX) :]
    if path.startswith("@") or path == "*":
        return
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise OSError(errno.ENOTSOCK, "the path exists and is not a socket file")
    if ipc_listener_stays(path):
        raise OSError(
            errno.EADDRINUSE,
            f"{os.strerror(errno.EADDRINUSE)} (another process serves this socket file: "
            "an earlier tandem still running?)",
        )


def ipc_listener_stays(path: str) -> bool:
    """Whether `ipc_listener_answers` every probe of IPC_PROBE_ATTEMPTS: one closing goes
    quiet in between (the refusal takes the whole interval, a free path one probe)."""
    for attempt in range(IPC_PROBE_ATTEMPTS):
        if attempt:
            time.sleep(IPC_PROBE_INTERVAL_S)
        if not ipc_listener_answers(path):
            return False
    return True


def ipc_listener_answers(path: str) -> bool:
    """Whether a process listens on the Unix socket file `path`: a plain connect, closed at
    once (a ZeroMQ listener sees a peer leave before its greeting, and forgets it). An error
    other than "refused" or "gone" (no permission to connect) is raised for the caller."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(IPC_PROBE_TIMEOUT_S)
        # (connect_ex: a Python socket's errno to sort, and no ZeroMQ connect to route through
        # `shared.endpoints`)
        error = probe.connect_ex(path)
    if error in (errno.ECONNREFUSED, errno.ENOENT):
        return False  # nobody listens (or the file went between the stat and the connect)
    if error in (0, errno.EAGAIN, errno.ETIMEDOUT):
        return True  # accepted, or a listener whose backlog is full: busy, not gone
    raise OSError(error, os.strerror(error))


def ipc_lock_path(address: str) -> str | None:
    """The lock file beside an `ipc://` address's socket file; None where there is no file to
    race for (another transport, abstract `ipc://@name`, a fresh `ipc://*`)."""
    if not address.startswith(IPC_PREFIX):
        return None
    path = address[len(IPC_PREFIX) :]
    return None if path.startswith("@") or path == "*" else f"{path}.lock"


@contextlib.contextmanager
def ipc_path_lock(address: str) -> Iterator[None]:
    """Held across a bind's probe and bind, so that of two binds of one path at once the second
    probes after the first has bound (and is refused). Only for that moment, not the socket's
    life: `bind` cannot see the socket closed, and the probe, not the lock, says whether the
    path is served (by any process, an older tandem's too). An advisory lock (flock) on
    `<path>.lock`, which the kernel releases when its holder dies; removed by its holder when
    done, so none are left beside the socket files. OSError when it is not a plain file (it is
    left alone) or another binder holds it for IPC_LOCK_TIMEOUT_S (stopped mid-bind)."""
    lock_path = ipc_lock_path(address)
    if lock_path is None:
        yield
        return
    fd = _lock_file(lock_path)
    try:
        yield
    finally:
        # (Still holding it: a waiter that then gets the lock sees it gone.)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(lock_path)
        os.close(fd)


def _lock_file(lock_path: str) -> int:
    """A descriptor holding the flock of the file now at `lock_path` (made if absent)."""
    deadline = time.monotonic() + IPC_LOCK_TIMEOUT_S
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.EEXIST, f"{lock_path} exists and is not a plain file")
            if _try_flock(fd) and _is_at(fd, lock_path):
                return fd
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # held, or unlinked by its last holder after our open: try the new one
        if time.monotonic() > deadline:
            raise OSError(
                errno.EADDRINUSE,
                f"{os.strerror(errno.EADDRINUSE)} (another process is binding this socket file "
                f"and holds {lock_path}: stopped?)",
            )
        time.sleep(IPC_LOCK_POLL_S)


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _is_at(fd: int, path: str) -> bool:
    """Whether the open file `fd` is still the one at `path`."""
    try:
        at_path = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (opened.st_dev, opened.st_ino) == (at_path.st_dev, at_path.st_ino)


def bind(sock: zmq.Socket, address: str, setting: str) -> None:
    """`sock.bind(address)`, the address being the value of the config field `setting`; IPv6
    enabled where the address needs it (`shared.endpoints`)."""
    try:
        ensure_ipc_dir(address)
        with ipc_path_lock(address):
            refuse_served_ipc_path(address)
            set_ipv6(sock, address).bind(address)
    except zmq.ZMQError as error:  # (its strerror repeats the address)
        raise BindError(
            f"{describe(setting)}: cannot bind {address}: {zmq.strerror(error.errno)}"
        ) from None
    except OSError as error:  # the ipc:// directory or socket file
        reason = error.strerror or str(error)
        raise BindError(f"{describe(setting)}: cannot bind {address}: {reason}") from None


def check_address(address: str, setting: str) -> None:
    """Before a bind made where a BindError would not reach the command (the gateway binds in
    its web server's start-up, which prints a traceback of whatever it raises): the ipc://
    directory made, a tcp:// port checked free. A host ZeroMQ resolves and Python cannot (an
    interface name) is left to the bind."""
    if not address.startswith("tcp://"):
        try:
            ensure_ipc_dir(address)
            refuse_served_ipc_path(address)
        except OSError as error:
            reason = error.strerror or str(error)
            raise BindError(f"{describe(setting)}: cannot bind {address}: {reason}") from None
        return
    host, _, port = address[len("tcp://") :].rpartition(":")
    if port.isdigit() and int(port) > 0:  # (`*` or 0: any free port)
        host = host.strip("[]")
        try:
            probe_listen("0.0.0.0" if host == "*" else host, int(port), describe(setting))
        except socket.gaierror:
            return  # (an interface name: ZeroMQ's bind resolves it, or says why not)


def check_tcp_port(host: str, port: int, what: str) -> None:
    """BindError (naming `what`: a flag, or `describe(...)`) if a TCP server could not listen
    on host:port now: the port held by another listener, the host not this machine's, or a
    name that resolves to no address (it passed, and a gateway logged "gateway ready" before
    uvicorn exited 3 on it). Bound and released at once, with SO_REUSEADDR as servers set it,
    so a port a stopped server left in TIME_WAIT passes."""
    try:
        probe_listen(host, port, what)
    except socket.gaierror:
        try:  # (a name of the other family than the probe's: left to the real bind)
            socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        except socket.gaierror as error:
            raise BindError(f"{what}: {host!r} resolves to no address: {error.strerror}") from None


def probe_listen(host: str, port: int, what: str) -> None:
    """`check_tcp_port`'s probe; socket.gaierror for a host Python cannot resolve."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except socket.gaierror:  # (an OSError too: a name, each caller judges it)
            raise
        except OSError as error:
            reason = error.strerror or str(error)
            if error.errno == errno.EADDRINUSE:
                reason += " (another server, or an earlier tandem still running?)"
            raise BindError(f"{what}: cannot listen on {host_port(host, port)}: {reason}") from None


def host_port(host: str, port: int) -> str:
    """host:port, an IPv6 host in brackets (as a URL needs it)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
