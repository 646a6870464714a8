"""API keys: when `server.api_keys` is set, every queue and OpenAI route needs `Authorization: Bearer <key>`
(what the OpenAI client and scalarlm's client send). Health and Prometheus metrics stay open for probes."""

from __future__ import annotations

import hmac

from fastapi import Request

from scalarlm.protocol.errors import Unauthorized


def require_api_key(request: Request) -> None:
    """Dependency: pass when no keys are configured or the bearer token is one of them."""
    keys: list[str] = request.app.state.server.settings.server.api_keys
    if not keys:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not token:
        raise Unauthorized("missing API key: send 'Authorization: Bearer <key>'", param="authorization")
    # Compare against every key in constant time, so timing does not reveal a key's prefix.
    if not any(hmac.compare_digest(token.strip().encode(), key.encode()) for key in keys):
        raise Unauthorized("invalid API key", param="authorization")
