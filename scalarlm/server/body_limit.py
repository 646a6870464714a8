"""ASGI middleware capping request bodies: 413 before reading when Content-Length is too big,
and 413 as soon as a streamed body passes the limit (nothing past the limit is buffered)."""

from __future__ import annotations

from collections.abc import Mapping

from starlette.exceptions import HTTPException
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from scalarlm.protocol.errors import PayloadTooLarge


class BodyLimitMiddleware:
    """Reject bodies larger than `default_limit` bytes, or the per-path limit in `limits`."""

    def __init__(self, app: ASGIApp, default_limit: int, limits: Mapping[str, int] | None = None) -> None:
        self.app = app
        self.default_limit = default_limit
        self.limits = dict(limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.limits.get(scope["path"], self.default_limit)
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            err = PayloadTooLarge(f"request body is {declared} bytes; the limit is {limit}", param="body")
            await JSONResponse(err.to_response().model_dump(), status_code=413)(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    # An HTTPException passes through FastAPI's body parsing unchanged; errors.py shapes it.
                    raise HTTPException(413, f"request body is larger than the limit of {limit} bytes")
            return message

        await self.app(scope, limited_receive, send)


def _content_length(scope: Scope) -> int | None:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
