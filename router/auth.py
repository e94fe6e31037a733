"""API keys: who may call, and which tenant a call is counted under.

Keys come from a file (one `key [tenant]` per line, `#` comments) and/or the environment
variable SLOS_SERVE_API_KEYS (`key[:tenant]`, comma-separated). A key without a tenant is
counted under "default". With no keys configured every call is accepted as tenant "default",
and the servers bind to 127.0.0.1 unless told otherwise, so an open server is never exposed by
accident.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from router.errors import Unauthorized

ENV_VAR = "SLOS_SERVE_API_KEYS"
DEFAULT_TENANT = "default"
UNKNOWN_TENANT = "unknown"
"""What a call no key names is counted under."""
LOOPBACK = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ApiKeys:
    tenants: Mapping[str, str] = field(default_factory=dict)
    """key -> tenant."""

    @property
    def enabled(self) -> bool:
        return bool(self.tenants)

    @property
    def tenant_names(self) -> list[str]:
        """Every tenant a call can be counted under."""
        return sorted(set(self.tenants.values())) or [DEFAULT_TENANT]

    @classmethod
    def load(cls, path: str | Path | None = None, env: Mapping[str, str] | None = None) -> ApiKeys:
        """Keys from the file (if given) plus the environment variable (if set)."""
        tenants: dict[str, str] = {}
        if path is not None:
            try:
                text = Path(path).read_text()
            except OSError as exc:
                raise ValueError(f"api_keys_file {str(path)!r}: {exc.strerror}") from None
            tenants.update(parse_key_file(text, str(path)))
        raw = (os.environ if env is None else env).get(ENV_VAR, "")
        tenants.update(parse_key_env(raw))
        if path is not None and not tenants:
            # A keys file says keys are wanted: an empty one (every key revoked) must not
            # open the server to every caller.
            raise ValueError(
                f"api_keys_file {str(path)!r} holds no keys (nor does {ENV_VAR}); refusing to "
                "start without authentication: add a key, or drop api_keys_file to run open"
            )
        return cls(tenants)

    def authenticate(self, authorization: str | None) -> str:
        """The caller's tenant, from an `Authorization: Bearer <key>` value."""
        if not self.enabled:
            return DEFAULT_TENANT
        if not authorization:
            raise Unauthorized("missing API key: send Authorization: Bearer <key>")
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise Unauthorized("malformed Authorization header: expected Bearer <key>")
        key = key.strip()
        for known, tenant in self.tenants.items():
            if hmac.compare_digest(known.encode(), key.encode()):
                return tenant
        raise Unauthorized("invalid API key")

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


def parse_key_file(text: str, source: str) -> dict[str, str]:
    tenants: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), start=1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        if len(words) > 2:
            raise ValueError(f"{source}:{number}: expected `key [tenant]`, got {len(words)} words")
        tenants[words[0]] = words[1] if len(words) == 2 else DEFAULT_TENANT
    return tenants


def parse_key_env(raw: str) -> dict[str, str]:
    tenants: dict[str, str] = {}
    for item in raw.split(","):
        key, _, tenant = item.strip().partition(":")
        if key:
            tenants[key] = tenant or DEFAULT_TENANT
    return tenants
