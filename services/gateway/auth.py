"""API keys at the gateway's doors, each mapped to the tenant its requests are charged to.

Keys come from `--api-keys` / `TANDEM_API_KEYS` (comma-separated) and `--api-keys-file` (one per
line, `#` comments), each as `key` or `key=tenant`. With none, the doors are open. With some,
every `/v1` call over HTTP (`Authorization: Bearer <key>`, as OpenAI's clients send it) and
every RPC call (its `api_key`) must present one, or is answered 401 in OpenAI's error shape. A
key with a tenant charges its requests to that tenant whatever their `user` field says, so a
client cannot spend another's fair share; a bare key leaves the tenant to `user`. Keys are
compared in constant time. Health, readiness and metrics stay open for probes and scrapers, but
readiness names tenants (their fair-share accounts) only to a key that may see them
(`tenant_filter`): a tenant's key its own, a bare key (which may charge any tenant) all.
"""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from services.gateway.openai_protocol import ApiError

MIN_KEY_CHARS = 16
MAX_KEY_CHARS = 256  # what an RPC call's `api_key` carries (shared/wire_rpc.py)
_KEY = re.compile(r"[A-Za-z0-9._~+/-]+")  # printable, no separators or whitespace
_TENANT = re.compile(r"[A-Za-z0-9._@-]{1,256}")


class KeyConfigError(ValueError):
    """A key or tenant the gateway refuses; the message says which entry and why."""


@dataclass(frozen=True)
class Caller:
    tenant: str | None  # None: the request's `user` names it
    # A digest of the bare key presented (None: a key with a tenant, or no keys set).
    key_digest: str | None = field(default=None, compare=False)

    @property
    def owner(self) -> str:
        """Whose stored responses (`/v1/responses`) the caller reads and continues: its key's
        tenant; for a bare key, that key's own (until 2026-12-07 every bare key shared them,
        given an id); with no keys set, everyone's (""). (A tenant has no ':'.)"""
        if self.tenant is not None:
            return self.tenant
        return f"key:{self.key_digest}" if self.key_digest is not None else ""


@dataclass(frozen=True)
class ApiKeys:
    tenants: dict[str, str | None]  # key -> tenant

    @classmethod
    def parse(cls, entries: Iterable[str]) -> ApiKeys:
        return cls._parse((f"API key entry {n}", entry) for n, entry in enumerate(entries, 1))

    @classmethod
    def load(cls, listed: Iterable[str], path: str | None) -> ApiKeys:
        located = [(f"API key entry {n}", entry) for n, entry in enumerate(listed, 1)]
        if path is not None:
            try:
                text = Path(path).read_text(encoding="utf-8-sig")  # (a BOM is no key's)
            except (OSError, UnicodeDecodeError) as error:
                raise KeyConfigError(f"cannot read the API keys file {path}: {error}") from None
            located += [
                (f"line {n} of {path}", line)
                for n, line in enumerate(text.splitlines(), 1)
                if line.strip() and not line.strip().startswith("#")
            ]
        return cls._parse(located)

    @classmethod
    def _parse(cls, located: Iterable[tuple[str, str]]) -> ApiKeys:
        """`located`: (where an entry was given, for errors; the entry)."""
        tenants: dict[str, str | None] = {}
        for where, entry in located:
            key, sep, tenant = (part.strip() for part in entry.partition("="))
            if not MIN_KEY_CHARS <= len(key) <= MAX_KEY_CHARS or not _KEY.fullmatch(key):
                raise KeyConfigError(
                    f"{where}: a key is at least {MIN_KEY_CHARS} and at most {MAX_KEY_CHARS} "
                    "characters of letters, digits and ._~+/- (generate one with `openssl rand "
                    "-hex 24`)"
                )
            if sep and not _TENANT.fullmatch(tenant):
                raise KeyConfigError(f"{where}: the tenant after '=' must match {_TENANT.pattern}")
            if key in tenants:
                raise KeyConfigError(f"{where}: the same key is listed twice")
            tenants[key] = tenant if sep else None
        return cls(tenants)

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    def check(self, presented: str | None) -> Caller:
        """The caller a key stands for; ApiError 401 without a valid one (when keys are set)."""
        if not self.enabled:
            return Caller(None)
        if not presented:
            raise _unauthorized("You didn't provide an API key (Authorization: Bearer <key>).")
        matched = None
        for key, tenant in self.tenants.items():  # every key compared: no early exit to time
            if hmac.compare_digest(key.encode(), presented.encode()):
                digest = None if tenant is not None else _digest(key)
                matched = Caller(tenant, digest)
        if matched is None:
            raise _unauthorized("Incorrect API key provided.")
        return matched

    def tenant_filter(self, authorization: str | None) -> Callable[[str], bool]:
        """Whose accounts an open route (/ready) may show this caller. They named every tenant
        to anyone: the keys' tenants, and the `user` values bare-key clients sent (often an end
        user's email). With no keys set, everyone's, as every route is open; without a valid
        key, no one's; a tenant's key, its own; a bare key, which may charge any tenant, all."""
        if not self.enabled:
            return lambda tenant: True
        try:
            caller = self.check_header(authorization)
        except ApiError:  # a probe's answer still: not a 401
            return lambda tenant: False
        if caller.tenant is None:
            return lambda tenant: True
        return lambda tenant: tenant == caller.tenant

    def check_header(self, authorization: str | None) -> Caller:
        scheme, _, token = (authorization or "").partition(" ")
        return self.check(token.strip() if scheme.lower() == "bearer" else None)


def _digest(key: str) -> str:
    """A key's stand-in where it is kept as a name (a stored response's owner): not the key."""
    return hashlib.sha256(key.encode()).hexdigest()[:32]


def _unauthorized(message: str) -> ApiError:
    return ApiError(401, message, "invalid_request_error", code="invalid_api_key")


def tenant_of(caller: Caller, user: str | None) -> str:
    return caller.tenant or user or "default"
