"""API keys: who may call, and which tenant a call is counted under.

Keys come from a file (one `key [tenant]` per line, `#` comments) and/or the environment
variable SLOS_SERVE_API_KEYS (`key[:tenant]`, comma-separated); a key is looked up by its
hash, and the file is read again when it changes. A key without a tenant is
counted under "default". With no keys configured every call is accepted as tenant "default",
and the servers bind to 127.0.0.1 unless told otherwise, so an open server is never exposed by
accident.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from router.errors import Unauthorized

ENV_VAR = "SLOS_SERVE_API_KEYS"
DEFAULT_TENANT = "default"
UNKNOWN_TENANT = "unknown"
"""What a call no key names is counted under."""
KEY = re.compile(r"[\x21-\x7e]+")
COMMENT = re.compile(r"(^|\s)#.*")
RELOAD_S = 5.0
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"

logger = logging.getLogger(__name__)


@dataclass
class ApiKeys:
    tenants: Mapping[str, str] = field(default_factory=dict)
    """key -> tenant."""
    path: Path | None = None
    """The keys file, read again once it changed: a key revoked (a Kubernetes Secret edited)
    stops working within RELOAD_S, without a restart."""
    env: Mapping[str, str] | None = None
    """Where SLOS_SERVE_API_KEYS is read, with the file (None: the process environment)."""
    clock: Callable[[], float] = time.monotonic
    _by_digest: dict[bytes, str] = field(init=False, repr=False)
    """Keys by their SHA-256: one hash per call whatever the number of keys, and no timing
    that tells how much of a guess matches a key."""
    _stamp: tuple[int, int, int] | None = field(init=False, repr=False)
    _looked: float = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._take(self.tenants)
        self._stamp = None if self.path is None else _stamp(self.path)
        self._looked = self.clock()

    def _take(self, tenants: Mapping[str, str]) -> None:
        self.tenants = tenants
        self._by_digest = {_digest(key): tenant for key, tenant in tenants.items()}

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    @property
    def tenant_names(self) -> list[str]:
        """Every tenant a call can be counted under."""
        return sorted(set(self.tenants.values())) or [DEFAULT_TENANT]

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ApiKeys:
        """Keys from the file (if given) plus the environment variable (if set). A key given
        twice for two tenants, or one no client could send, stops the start naming it."""
        file = None if path is None else Path(path)
        return cls(read_keys(file, env), file, env)

    def _follow(self) -> None:
        """Take the keys file again if it changed (looked at once per RELOAD_S at most). A
        changed file that does not parse or holds no key (half-written, every key removed)
        leaves the keys in force, said once in the log: it neither opens the server, nor
        locks everyone out, nor leaves only SLOS_SERVE_API_KEYS's keys."""
        now = self.clock()
        if self.path is None or now - self._looked < RELOAD_S:
            return
        self._looked = now
        stamp = _stamp(self.path)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            tenants = read_keys(self.path, self.env, reloading=True)
        except ValueError as exc:
            logger.error("API keys not reloaded, those before stay in force: %s", exc)
            return
        self._take(tenants)
        logger.info("API keys reloaded from %s: %d key(s)", self.path, len(tenants))

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant, from an `Authorization: Bearer <key>` value."""
        self._follow()
        if not self.enabled:
            return DEFAULT_TENANT
        if not authorization:
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected Bearer <key>")
        tenant = self._by_digest.get(_digest(key.strip()))
        if tenant is None:
            raise Unauthorized("invalid API key")
        return tenant

    def bind_host(self, configured: str | None, server: str) -> str:
        """The address to listen on; says at start whether the server is open."""
        host = configured or (ALL_INTERFACES if self.enabled else LOOPBACK)
        if self.enabled:
            logger.info(
                "%s: API keys required (%d key(s)); listening on %s",
                server,
                len(self.tenants),
                host,
            )
        elif host == LOOPBACK:
            logger.warning("%s: no API keys configured; listening on %s only", server, host)
        else:
            logger.warning(
                "%s: no API keys configured and listening on %s: open to anyone", server, host
            )
        return host


def read_keys(
    path: Path | None, env: Mapping[str, str] | None, reloading: bool = False
) -> dict[str, str]:
    """key -> tenant, from the file and the variable. `reloading`: a file that holds no key
    is refused even when the variable holds some, as it is more likely being written than
    meant to revoke every key it held."""
    entries: dict[str, Entry] = {}
    if path is not None:
        try:
            text = path.read_text(encoding="utf-8-sig")  # an editor's BOM is no key
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
            raise ValueError(f"api_keys_file {str(path)!r}: {why}") from None
        entries = parse_key_file(text, str(path))
        if reloading and not entries:
            raise ValueError(f"api_keys_file {str(path)!r} holds no keys")
    raw = (os.environ if env is None else env).get(ENV_VAR, "")
    for key, entry in parse_key_env(raw).items():
        known = entries.setdefault(key, entry)
        if known.tenant != entry.tenant:
            raise ValueError(
                f"{entry.where} gives tenant {entry.tenant!r} the key {known.where} gives "
                f"tenant {known.tenant!r}: one key, one tenant"
            )
    if path is not None and not entries:
        # A keys file says keys are wanted: an empty one (every key revoked) must not
        # open the server to every caller.
        raise ValueError(
            f"api_keys_file {str(path)!r} holds no keys (nor does {ENV_VAR}); refusing to "
            "run without authentication: add a key, or drop api_keys_file to run open"
        )
    return {key: entry.tenant for key, entry in entries.items()}


@dataclass(frozen=True)
class Entry:
    """A key's tenant, and where it is given (a file's line, the variable's item): errors
    name that, never the key."""

    tenant: str
    where: str


def _stamp(path: Path) -> tuple[int, int, int] | None:
    """What changes when the file is rewritten or replaced (a Secret's symlink swapped)."""
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size, stat.st_ino


def parse_key_file(text: str, source: str) -> dict[str, Entry]:
    """`key [tenant]` per line; `#` starts a comment at a line's start or after a space (a
    key may hold one)."""
    entries: dict[str, Entry] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = COMMENT.sub("", line).split()
        if not words:
            continue
        where = f"{source}:{number}"
        if len(words) > 2:
            raise ValueError(f"{where}: expected `key [tenant]`, got {len(words)} words")
        key, tenant = words[0], words[1] if len(words) == 2 else DEFAULT_TENANT
        _check(key, tenant, where)
        if key in entries:
            raise ValueError(f"{where}: the key of {entries[key].where} again: one key, one line")
        entries[key] = Entry(tenant, where)
    return entries


def parse_key_env(raw: str) -> dict[str, Entry]:
    """`key[:tenant]` items, comma-separated, spaces around either part ignored."""
    entries: dict[str, Entry] = {}
    items = [item for item in raw.split(",") if item.strip()]
    for number, item in enumerate(items, start=1):
        key, _, tenant = (part.strip() for part in item.partition(":"))
        where = f"{ENV_VAR} item {number}"  # not the item itself: it holds a key
        if not key:
            raise ValueError(f"{where}: no key before the ':'")
        _check(key, tenant or DEFAULT_TENANT, where)
        if key in entries:
            raise ValueError(f"{where}: the key of {entries[key].where} again: one key, one item")
        entries[key] = Entry(tenant or DEFAULT_TENANT, where)
    if raw.strip() and not entries:
        raise ValueError(f"{ENV_VAR} is set but holds no key: unset it to run open")
    return entries


def _check(key: str, tenant: str, where: str) -> None:
    """A key a client can send in an HTTP header or gRPC metadata (visible ASCII, which
    their stacks pass unchanged), counted under a tenant named in one word, other than
    unauthorized calls' tenant."""
    if not KEY.fullmatch(key):
        raise ValueError(
            f"{where}: an API key is visible ASCII characters only (HTTP headers and gRPC "
            "metadata carry no others)"
        )
    if tenant.split() != [tenant]:
        raise ValueError(f"{where}: tenant {tenant!r} holds a space")
    if tenant == UNKNOWN_TENANT:
        raise ValueError(f"{where}: tenant {UNKNOWN_TENANT!r} is what calls with no key count as")


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()
