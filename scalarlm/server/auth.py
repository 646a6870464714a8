"""API keys: when keys are configured, every route but health and Prometheus metrics needs
`Authorization: Bearer <key>` (what the OpenAI client and scalarlm's client send), and a key must hold
the route's scope.

Keys come from `server.api_keys` (env `SCALARLM_API_KEYS`, comma-separated: every scope, no limits) and
from `server.api_keys_file`, one key a line: `<key> [scope1,scope2] [max_queued=N] [max_jobs=M]`
(`#` starts a comment). Only the SHA-256 digest of each key is kept in memory, and a presented key is
compared digest to digest with `hmac.compare_digest` against every configured key (constant time).

Scopes: `generate` (batch queue and OpenAI routes), `train` (/v1/megatron/*, /v1/train), `admin`
(clear_queue, and the worker routes get_work/finish_work: an operator key may run a worker, since a worker
sees every prompt and writes every result).

Split-mode workers present the worker key (`checkpoint.keys.worker_key`: a mounted Secret file or
`$SCALARLM_HOME/internal/worker.key`), which holds only the `worker` scope: get_work and finish_work, nothing
else. Like the notify key, it is checked only when operator keys are configured.

The control plane's own internal notify key (`$SCALARLM_HOME/internal/notify.key`, handed by the launchers to
the trainers they start) holds only the `internal` scope, valid on /v1/internal/published alone; an `admin`
key is accepted there too. `internal` cannot be given to a key in the keys file.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass
from pathlib import Path

from fastapi import Request

from scalarlm.protocol.errors import Forbidden, Unauthorized

logger = logging.getLogger(__name__)

SCOPES = frozenset({"generate", "train", "admin"})
# The trainer's scope: announce published steps, nothing else. An admin key holds it implicitly.
INTERNAL_SCOPE = "internal"
# A split-mode worker's scope: lease work and post results, nothing else. An admin key holds it implicitly.
WORKER_SCOPE = "worker"

# Routes (by their path template) needing a scope other than the one their prefix implies.
_ADMIN_ROUTES = frozenset({"/v1/generate/clear_queue"})
_WORKER_ROUTES = frozenset({"/v1/generate/get_work", "/v1/generate/finish_work"})
_INTERNAL_ROUTES = frozenset({"/v1/internal/published"})


class KeyFileError(ValueError):
    """A line of the keys file cannot be read."""


@dataclass(frozen=True)
class ApiKey:
    """One configured key: its digest, a printable id (digest prefix, for logs), scopes and limits."""

    digest: bytes
    scopes: frozenset[str]
    max_queued: int | None = None
    max_jobs: int | None = None

    @property
    def key_id(self) -> str:
        return self.digest.hex()[:12]

    def allows(self, scope: str) -> bool:
        """True when the key holds `scope` (an admin key also holds `internal` and `worker`)."""
        return scope in self.scopes or (scope in (INTERNAL_SCOPE, WORKER_SCOPE) and "admin" in self.scopes)


def digest(key: str) -> bytes:
    """The SHA-256 digest a key is stored and compared as."""
    return hashlib.sha256(key.encode()).digest()


def parse_key_line(line: str) -> ApiKey | None:
    """One keys-file line -> ApiKey (None for blank and comment lines)."""
    text = line.split("#", 1)[0].strip()
    if not text:
        return None
    key, *rest = text.split()
    scopes: frozenset[str] = SCOPES
    limits: dict[str, int] = {}
    for field in rest:
        name, eq, value = field.partition("=")
        if eq:
            if name not in ("max_queued", "max_jobs") or not value.isdigit():
                raise KeyFileError(f"unknown or bad limit {field!r} (use max_queued=N, max_jobs=M)")
            limits[name] = int(value)
        else:
            scopes = frozenset(s for s in field.split(",") if s)
            unknown = scopes - SCOPES
            if unknown:
                raise KeyFileError(f"unknown scope(s) {sorted(unknown)}; scopes are {sorted(SCOPES)}")
    return ApiKey(digest(key), scopes, limits.get("max_queued"), limits.get("max_jobs"))


class KeyRing:
    """The configured keys, as digests; no operator key means authentication is off."""

    def __init__(self, keys: list[ApiKey], internal_key: str | None = None, worker_key: str | None = None) -> None:
        self.keys = keys
        # Checked only when operator keys are configured: on their own they never turn authentication on.
        self.internal = [ApiKey(digest(k), frozenset({scope}))
                         for k, scope in ((internal_key, INTERNAL_SCOPE), (worker_key, WORKER_SCOPE)) if k]  # fmt: skip

    @classmethod
    def load(cls, api_keys: list[str], keys_file: Path | None, internal_key: str | None = None,
             worker_key: str | None = None) -> "KeyRing":
        """Keys from the settings list (full scope), the keys file (scoped, with limits), the internal notify key
        and the split-mode worker key."""
        keys = [ApiKey(digest(k), SCOPES) for k in api_keys if k]
        if keys_file is not None:
            for number, line in enumerate(keys_file.read_text().splitlines(), 1):
                try:
                    parsed = parse_key_line(line)
                except KeyFileError as e:
                    raise KeyFileError(f"{keys_file}:{number}: {e}") from None
                if parsed is not None:
                    keys.append(parsed)
        return cls(keys, internal_key, worker_key)

    @property
    def enabled(self) -> bool:
        return bool(self.keys)

    def find(self, token: str) -> ApiKey | None:
        """The key whose digest equals the token's; every key is compared, so timing reveals nothing."""
        presented = digest(token)
        found = None
        for key in [*self.keys, *self.internal]:
            if hmac.compare_digest(presented, key.digest):
                found = key
        return found


def required_scope(path_template: str) -> str:
    """The scope a route needs, from its path template."""
    if path_template in _INTERNAL_ROUTES:
        return INTERNAL_SCOPE
    if path_template in _ADMIN_ROUTES:
        return "admin"
    if path_template in _WORKER_ROUTES:
        return WORKER_SCOPE
    if path_template.startswith(("/v1/megatron", "/v1/train")):
        return "train"
    return "generate"


async def require_api_key(request: Request) -> None:
    """Dependency (async: no thread-pool hop per request): pass when auth is off, or the bearer key is known and
    holds the route's scope.

    The matched key is left on `request.state.api_key` for per-key limits.
    """
    ring: KeyRing = request.app.state.keys
    request.state.api_key = None
    if not ring.enabled:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'", param="authorization")
    key = ring.find(token.strip())
    if key is None:
        raise Unauthorized("invalid API key", param="authorization")
    route = request.scope.get("route")
    scope = required_scope(getattr(route, "path", request.url.path))
    if not key.allows(scope):
        logger.info("key %s lacks scope %r for %s", key.key_id, scope, request.url.path)
        raise Forbidden(f"this API key lacks the {scope!r} scope", param="authorization")
    request.state.api_key = key
