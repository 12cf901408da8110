"""CurveZMQ between services: every socket encrypted, every peer authenticated by its key.

A cluster has one keypair (`tandem keys` writes it): each service presents it, binding sockets
as CURVE servers and connecting ones as CURVE clients that verify the server's public key. A
binding socket accepts a client only if its public key is authorized: the cluster's own on the
cluster's sockets (scheduler, workers, streams, batch service), and on the gateway's RPC door
also those of RPC clients (`tandem keys --client NAME` adds one). An agent's key opens the door
it was given, where its API key is checked, and no socket behind it (every socket took it: an
agent could HELLO as a worker and be sent others' prompts, or SUBMIT as any tenant). A peer
with another key fails the handshake, its messages never reach the service, and the refusal is
logged with the key.

Keys come from a `tandem keys` directory (`--curve-keys-dir`, mounted from a secret in
containers) or from the environment: `TANDEM_CURVE_SECRET_KEY` (the cluster's secret key, Z85;
its public key is derived) and `TANDEM_CURVE_CLIENT_KEYS` (more authorized public keys). With
neither, sockets are plain: the default for a local cluster on ipc://.
"""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.asyncio
import zmq.auth
from zmq.utils import z85

CLUSTER = "cluster"  # the key files' base name: cluster.key and cluster.key_secret
AUTHORIZED = "authorized"  # the folder of accepted public keys
CLIENTS = "clients"  # RPC clients' keypairs, to hand to their owners
RPC_DOOR = "rpc"  # the ZAP domain of the one socket RPC clients' keys may open
CLUSTER_SOCKETS = "cluster"  # every other binding socket's


class CurveError(ValueError):
    """Keys that cannot be loaded or used; the message says which and why."""


@dataclass(frozen=True)
class CurveKeys:
    public: bytes  # Z85; the cluster's, presented and verified by every service
    secret: bytes
    authorized: frozenset[bytes]  # client public keys a binding socket accepts

    @classmethod
    def from_dir(cls, directory: str | Path) -> CurveKeys:
        root = Path(directory)
        try:
            public, secret = zmq.auth.load_certificate(root / f"{CLUSTER}.key_secret")
            authorized = {
                zmq.auth.load_certificate(path)[0]
                for path in sorted((root / AUTHORIZED).glob("*.key"))
            }
        except (OSError, ValueError) as error:
            raise CurveError(f"cannot load CurveZMQ keys from {root}: {error}") from None
        if secret is None:
            raise CurveError(f"{root / f'{CLUSTER}.key_secret'} holds no secret key")
        return cls(public, secret, frozenset(authorized | {public}))

    @classmethod
    def from_secret(cls, secret: str, client_keys: tuple[str, ...] = ()) -> CurveKeys:
        keys = [secret, *client_keys]
        if any(len(key) != 40 for key in keys):
            raise CurveError("CurveZMQ keys are 40 characters of Z85 (see `tandem keys`)")
        try:
            public = zmq.curve_public(secret.encode())
        except (zmq.ZMQError, ValueError) as error:
            raise CurveError(f"the CurveZMQ secret key is not valid Z85: {error}") from None
        for number, key in enumerate(client_keys, 1):  # a typo would lock its client out unsaid
            if not _is_z85_key(key):
                raise CurveError(f"client key {number} is not a CurveZMQ public key (Z85)")
        return cls(public, secret.encode(), frozenset({public, *(k.encode() for k in client_keys)}))


def _is_z85_key(key: str) -> bool:
    try:
        return len(z85.decode(key.encode())) == 32
    except (KeyError, ValueError, struct.error):  # a character outside Z85; a group past 2**32
        return False


def load_keys(
    directory: str | None, secret: str | None, client_keys: tuple[str, ...] = ()
) -> CurveKeys | None:
    """The keys a service's settings name, or None for plain sockets."""
    if directory is not None and secret is not None:
        raise CurveError("give CurveZMQ keys as a directory or a secret key, not both")
    if directory is not None:
        keys = CurveKeys.from_dir(directory)
        extra = CurveKeys.from_secret(keys.secret.decode(), client_keys).authorized
        return CurveKeys(keys.public, keys.secret, keys.authorized | extra)
    if secret is not None:
        return CurveKeys.from_secret(secret, client_keys)
    if client_keys:
        raise CurveError("CurveZMQ client keys without the cluster's keys")
    return None


class Security:
    """One ZeroMQ context's sockets under `keys` (or plain when None). A context that binds
    CURVE sockets needs `start` (its authenticator) before the first bind."""

    def __init__(self, keys: CurveKeys | None, log):
        self.keys = keys
        self.log = log
        self._authenticator = None

    @property
    def enabled(self) -> bool:
        return self.keys is not None

    def start(self, context: zmq.Context) -> None:
        if self.keys is None or self._authenticator is not None:
            return
        if isinstance(context, zmq.asyncio.Context):
            from zmq.auth.asyncio import AsyncioAuthenticator

            self._authenticator = AsyncioAuthenticator(context)
        else:
            from zmq.auth.thread import ThreadAuthenticator

            self._authenticator = ThreadAuthenticator(context)
        self._authenticator.start()
        for domain in (CLUSTER_SOCKETS, RPC_DOOR):  # (the authenticator asks by the domain)
            self._authenticator.configure_curve_callback(domain, credentials_provider=self)

    def callback(self, domain: str, client_key: bytes) -> bool:
        """The authenticator asks: may this client key into a socket of this domain?"""
        if self.keys is None:
            allowed = False
        elif domain == RPC_DOOR:
            allowed = client_key in self.keys.authorized
        else:
            allowed = client_key == self.keys.public
        if not allowed:
            self.log.warning(
                "peer refused: unknown CurveZMQ key", client_key=client_key.decode(), domain=domain
            )
        return allowed

    def server(self, socket: zmq.Socket, domain: str = CLUSTER_SOCKETS) -> zmq.Socket:
        """Before `bind`: encrypts and lets in the clients `domain` authorizes: the cluster's
        key only, or on the RPC door (`RPC_DOOR`) RPC clients' keys too."""
        if self.keys is not None:
            assert self._authenticator is not None, "start the context's authenticator first"
            socket.curve_secretkey = self.keys.secret
            socket.curve_publickey = self.keys.public
            socket.curve_server = True
            socket.zap_domain = domain.encode()
        return socket

    def client(self, socket: zmq.Socket) -> zmq.Socket:
        """Before `connect`: encrypts and talks only to a server holding the cluster's key."""
        if self.keys is not None:
            socket.curve_secretkey = self.keys.secret
            socket.curve_publickey = self.keys.public
            socket.curve_serverkey = self.keys.public
        return socket

    def stop(self) -> None:
        if self._authenticator is not None:
            self._authenticator.stop()
            self._authenticator = None


@dataclass(frozen=True)
class ClientKeys:
    """An RPC client's keypair and the gateway's (the cluster's) public key."""

    public: bytes
    secret: bytes
    server_public: bytes

    def apply(self, socket: zmq.Socket) -> zmq.Socket:
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.server_public
        return socket

    @classmethod
    def from_dir(cls, directory: str | Path, name: str) -> ClientKeys:
        root = Path(directory)
        try:
            public, secret = zmq.auth.load_certificate(root / CLIENTS / f"{name}.key_secret")
            server_public, _ = zmq.auth.load_certificate(root / f"{CLUSTER}.key")
        except (OSError, ValueError) as error:
            raise CurveError(f"cannot load client {name!r}'s keys from {root}: {error}") from None
        if secret is None:  # (its public key file, renamed): no socket could use it
            raise CurveError(f"{root / CLIENTS / f'{name}.key_secret'} holds no secret key")
        return cls(public, secret, server_public)


def generate(directory: str | Path, clients: tuple[str, ...] = ()) -> list[Path]:
    """Writes the cluster's keypair (if there is none yet) and one per named client; each
    public key is also copied into `authorized/`. Returns the files written. Names are checked
    before anything is written, and a secret key is never readable by others, not even for a
    moment or when writing fails half-way."""
    for name in clients:
        _check_client_name(name)
    root = Path(directory)
    written = []
    try:
        (root / AUTHORIZED).mkdir(parents=True, exist_ok=True)
        (root / CLIENTS).mkdir(exist_ok=True)
        if not (root / f"{CLUSTER}.key_secret").exists():
            written += _write_keypair(root, CLUSTER, root / AUTHORIZED)
        for name in clients:
            written += _write_keypair(root / CLIENTS, name, root / AUTHORIZED)
        for path in root.rglob("*.key_secret"):  # (also those an older version left open)
            path.chmod(0o600)
    except OSError as error:
        raise CurveError(f"cannot write CurveZMQ keys into {root}: {error}") from None
    return written


def _check_client_name(name: str) -> None:
    if not name.isidentifier():
        raise CurveError(f"client name {name!r}: letters, digits and _ only, not a digit first")
    if name == CLUSTER:  # its public key would replace the cluster's in authorized/
        raise CurveError(f"client name {name!r}: the cluster's own keys have that name")


def _write_keypair(folder: Path, name: str, authorized: Path) -> list[Path]:
    """`name.key` and `name.key_secret` in `folder`, made in a private (0700) folder beside
    them and moved in once the secret is the owner's only (zmq.auth writes it under the umask,
    readable by all); the secret goes last, as its presence means a whole keypair."""
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    with tempfile.TemporaryDirectory(dir=folder, prefix=".new-") as private:
        made_public, made_secret = zmq.auth.create_certificates(private, name)
        os.chmod(made_secret, 0o600)
        os.replace(made_public, public)
        os.replace(made_secret, secret)
    shutil.copy(public, authorized / f"{name}.key")
    return [public, secret]
