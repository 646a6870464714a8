"""Split mode: the worker's own small HTTP app (`scalarlm serve --role worker`).

It serves the OpenAI routes the control plane's `RemoteBackend` forwards to (`GET /v1/models`,
`POST /v1/completions`, `POST /v1/chat/completions`), `GET /load` and `GET /health`, and its lifespan
runs the engine and the pull loop against the control plane's queue over HTTP.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scalarlm.checkpoint.keys import worker_key
from scalarlm.config import Settings
from scalarlm.inference.http_source import HttpWorkSource
from scalarlm.inference.worker import InProcessWorker
from pydantic import ValidationError

from scalarlm.protocol.backend import CLIENT_GONE, MODEL_HEADER, OpenAIReply, OpenAIRoute, unless_disconnected
from scalarlm.protocol.generate import ModelVersion

logger = logging.getLogger(__name__)


def _to_response(reply: OpenAIReply) -> Response:
    """An OpenAIReply as the HTTP response vLLM's server would send."""
    if reply.stream is not None:
        headers = {k: v for k, v in reply.headers.items() if k.lower() != "content-type"}
        return StreamingResponse(reply.stream, status_code=reply.status_code, media_type="text/event-stream",
                                 headers=headers)
    return JSONResponse(reply.body, status_code=reply.status_code, headers=reply.headers)


def _bad_json(message: str) -> JSONResponse:
    """vLLM's error body for a request that is not a JSON object."""
    return JSONResponse({"error": {"message": message, "type": "BadRequestError", "param": None, "code": 400}},
                        status_code=400)


class WorkerKeyGuard:
    """ASGI middleware: every route but /health needs the worker key (the control plane's requests carry it).

    Plain ASGI, not Starlette's BaseHTTPMiddleware, so streamed responses pass through untouched.
    """

    def __init__(self, app: Any, key: str) -> None:
        self.app = app
        self.expected = hashlib.sha256(key.encode()).digest()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health" and not self._authorized(scope):
            await _unauthorized()(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        header = next((v for k, v in scope["headers"] if k == b"authorization"), b"").decode("latin-1")
        scheme, _, token = header.partition(" ")
        presented = hashlib.sha256(token.strip().encode()).digest()
        return scheme.lower() == "bearer" and hmac.compare_digest(presented, self.expected)


def _unauthorized() -> JSONResponse:
    """401 in the OpenAI error shape, naming what to send."""
    message = ("this worker answers only its control plane: send 'Authorization: Bearer <worker key>' "
               "(server.worker_key_file, or $SCALARLM_HOME/internal/worker.key)")
    return JSONResponse({"error": {"message": message, "type": "authentication_error", "param": "authorization",
                                   "code": 401}}, status_code=401)  # fmt: skip


def requested_model(header: str | None, settings: Settings) -> ModelVersion | None:
    """The control plane's entry for the requested model, from its header; ValueError when it is not usable.

    Only checkpoints inside this worker's jobs directory (the volume it shares with the control plane) may
    be named, so the header cannot make the worker load arbitrary files.
    """
    if header is None:
        return None
    try:
        entry = ModelVersion.model_validate_json(header)
    except ValidationError as exc:
        raise ValueError(f"{MODEL_HEADER} header is not a model entry: {exc.errors()[0]['msg']}") from None
    if entry.kind == "base" or entry.path is None:
        return entry
    jobs = settings.jobs_dir.resolve()
    if not Path(entry.path).resolve().is_relative_to(jobs):
        raise ValueError(f"model '{entry.name}' path {entry.path} is outside this worker's jobs directory {jobs}: "
                         "the control plane and its workers must share SCALARLM_HOME")
    return entry


def create_worker_app(settings: Settings, worker: InProcessWorker | None = None) -> FastAPI:
    """The worker's FastAPI app; the engine starts in its lifespan and pulls from `settings.server.api_url`."""
    worker = worker or InProcessWorker(settings)

    key = worker_key(settings.home, settings.server.worker_key_file)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        source = HttpWorkSource(settings.server.api_url, key)
        await worker.start(source)
        gc.collect()  # the engine front end lives as long as the worker: out of the collector's sight (app.py)
        gc.freeze()
        try:
            yield
        finally:
            gc.unfreeze()
            await worker.stop()
            await source.aclose()

    app = FastAPI(title="scalarlm worker", lifespan=lifespan)
    app.state.worker = worker
    app.add_middleware(WorkerKeyGuard, key=key)

    async def forward(route: OpenAIRoute, request: Request) -> Response:
        try:
            body: Any = json.loads(await request.body())
        except ValueError as exc:
            return _bad_json(f"request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _bad_json("request body must be a JSON object")
        try:
            model = requested_model(request.headers.get(MODEL_HEADER), settings)
        except ValueError as exc:
            return _bad_json(str(exc))
        # The control plane closes its connection when its client leaves: end the engine's work on the request.
        return _to_response(await unless_disconnected(request.receive, worker.backend.openai(route, body, model),
                                                      CLIENT_GONE))

    @app.get("/v1/models")
    async def models() -> Response:
        return _to_response(await worker.backend.openai("models", {}))

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await forward("completions", request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await forward("chat/completions", request)

    @app.get("/load")
    async def load() -> dict[str, Any]:
        return worker.backend.load().model_dump()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = await worker.backend.healthy()
        return JSONResponse({"status": "up" if ok else "down"}, status_code=200 if ok else 503)

    return app


def run_worker(settings: Settings) -> int:
    """Serve the worker app with uvicorn on `server.host:server.worker_port` until SIGTERM/SIGINT."""
    import uvicorn

    logger.info("worker serving %s on http://%s:%d, pulling from %s", settings.model, settings.server.host,
                settings.server.worker_port, settings.server.api_url)
    uvicorn.run(create_worker_app(settings), host=settings.server.host, port=settings.server.worker_port,
                log_level=settings.log_level.lower(), timeout_graceful_shutdown=10)
    return 0
