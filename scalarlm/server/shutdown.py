"""Graceful shutdown: on SIGTERM stop admitting (503 with `Retry-After`), let in-flight requests finish
for at most `server.shutdown_seconds`, then exit through the app's lifespan (which stops the worker and
returns its leased items to the queue).

`DrainMiddleware` counts requests in flight and refuses new ones once draining; `GracefulServer` is a
uvicorn server whose first SIGTERM/SIGINT starts the drain instead of closing the listener at once
(a second signal exits at once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import FrameType

import uvicorn
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from scalarlm.protocol.errors import EngineUnavailable

logger = logging.getLogger(__name__)

# What a refused client is told: by then another replica (or this one, restarted) should answer.
DRAIN_RETRY_AFTER_SECONDS = 5


@dataclass
class Drain:
    """Requests in flight, and whether (and since when) the server is draining."""

    in_flight: int = 0
    draining_since: float | None = None

    @property
    def draining(self) -> bool:
        return self.draining_since is not None

    def start(self) -> None:
        """Stop admitting new requests (idempotent)."""
        if self.draining_since is None:
            self.draining_since = time.monotonic()


class DrainMiddleware:
    """Answer 503 to every new HTTP request once draining; count the ones in flight."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            err = EngineUnavailable("the server is shutting down; retry on another replica or after restart",
                                    retry_after=DRAIN_RETRY_AFTER_SECONDS)
            headers = {"Retry-After": str(DRAIN_RETRY_AFTER_SECONDS), "Connection": "close"}
            await JSONResponse(err.to_response().model_dump(), status_code=503, headers=headers)(scope, receive, send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


class GracefulServer(uvicorn.Server):
    """uvicorn server that drains for up to `drain_seconds` on the first exit signal."""

    def __init__(self, config: uvicorn.Config, drain: Drain, drain_seconds: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.drain_seconds = drain_seconds

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """First signal: start draining; a second one: exit now (as uvicorn does)."""
        if self.drain.draining or not self.started:
            super().handle_exit(sig, frame)
            return
        logger.info("signal %d: draining (%d requests in flight, at most %.0f s)", sig, self.drain.in_flight,
                    self.drain_seconds)
        self.drain.start()

    async def on_tick(self, counter: int) -> bool:
        """Exit once draining and nothing is in flight, or the drain time is up."""
        if self.drain.draining_since is not None:
            waited = time.monotonic() - self.drain.draining_since
            if self.drain.in_flight == 0 or waited >= self.drain_seconds:
                if self.drain.in_flight:
                    logger.warning("drain time up with %d requests in flight; closing", self.drain.in_flight)
                self.should_exit = True
        return await super().on_tick(counter)
