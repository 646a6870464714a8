"""The control plane: `create_app(settings, worker=None)` builds the FastAPI app.

Its lifespan opens the durable queue, then either starts the in-process worker (embedded default)
and uses its backend, or (role `api`) forwards OpenAI requests to the workers in
`settings.server.worker_urls` over HTTP. This package never imports vLLM, torch, or the inference
and training packages: engines are reached only through the protocols of `scalarlm.protocol.backend`.
"""

from __future__ import annotations

import asyncio
import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI

from scalarlm.config import Settings
from scalarlm.protocol.backend import EmbeddedWorker
from scalarlm.queue import QueueService, RequestQueue
from scalarlm.server.admission import Admission
from scalarlm.server.auth import KeyRing, require_api_key
from scalarlm.server.body_limit import BodyLimitMiddleware
from scalarlm.server.deps import ServerState
from scalarlm.server.errors import install_error_handlers
from scalarlm.server.models import ModelCatalog
from scalarlm.server.prompt_check import PromptChecker
from scalarlm.server.remote_backend import RemoteBackend
from scalarlm.server.jobs import TrainingJobs
from scalarlm.checkpoint.keys import worker_key
from scalarlm.launcher.base import notify_key
from scalarlm.server.limits import KeyUsage
from scalarlm.server.shutdown import Drain, DrainMiddleware
from scalarlm.server.routers import catalog, console, generate, health, metrics, openai, operator, sessions, training
from scalarlm.server.routers import tinker
from scalarlm.server.sessions import RLSessions
from scalarlm.server.telemetry import HttpMetricsMiddleware, ServerMetrics

logger = logging.getLogger(__name__)

UPLOAD_PATH = "/v1/generate/upload"


def create_app(settings: Settings, worker: EmbeddedWorker | None = None) -> FastAPI:
    """Build the control plane app; `worker` is the in-process worker of the embedded default."""
    state = ServerState(
        settings=settings,
        metrics=ServerMetrics(),
        catalog=ModelCatalog(settings),
        admission=Admission(settings.server.admit_factor),
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async with (state.catalog.staging_cleared(), _running(state, worker), app.state.training.supervising(),
                    state.catalog.polling()):
            yield

    app = FastAPI(title="scalarlm", version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.training = TrainingJobs(settings)
    app.state.sessions = RLSessions(app.state.training, state.catalog)
    # Trainers announce published steps with the internal notify key the launchers hand them; split-mode workers
    # (no in-process worker) lease work with the worker key, which this app also presents to them.
    state.worker_key = worker_key(settings.home, settings.server.worker_key_file) if worker is None else None
    app.state.keys = KeyRing.load(settings.server.api_keys, settings.server.api_keys_file, notify_key(settings.home),
                                  state.worker_key)
    app.state.usage = KeyUsage.open(settings.home / "usage.sqlite")  # per-key counts survive a restart
    app.state.drain = Drain()
    state.metrics.live.http_in_flight = lambda: app.state.drain.in_flight  # a drain waits for these
    install_error_handlers(app)
    routers = (generate.router, openai.router, training.router, training.alias_router, sessions.router, catalog.router,
               operator.router)
    for router in routers:
        app.include_router(router, dependencies=[Depends(require_api_key)])
    app.include_router(tinker.router)  # its own key check: the tinker SDK sends X-API-Key
    for router in (health.router, metrics.router, console.router, tinker.open_router):  # open to probes and scrapers; the console holds no data
        app.include_router(router)
    # Added innermost first: metrics count every answer, including 413s and the 503s of a draining server.
    app.add_middleware(DrainMiddleware, drain=app.state.drain)
    app.add_middleware(
        BodyLimitMiddleware,
        default_limit=settings.upload.max_request_bytes,
        limits={UPLOAD_PATH: settings.upload.max_upload_bytes},
    )
    app.add_middleware(HttpMetricsMiddleware, metrics=state.metrics)
    return app


def _served_length(state: ServerState) -> int | None:
    """The context length the engines serve: the backend's (the embedded engine's; split mode: the shortest any
    worker of `worker_urls` reported), else the shortest any pulling worker reported with its get_work."""
    if state.backend is not None:
        return state.backend.load().max_model_len
    workers = state.queue.workers.values() if state.queue is not None else []
    lengths = [seen.request.load.max_model_len for seen in workers
               if seen.request.load is not None and seen.request.load.max_model_len is not None]  # fmt: skip
    return min(lengths, default=None)


@asynccontextmanager
async def _running(state: ServerState, worker: EmbeddedWorker | None) -> AsyncIterator[None]:
    """Open the queue and the engine side for the app's lifetime; close them in reverse order."""
    settings = state.settings
    settings.home.mkdir(parents=True, exist_ok=True)
    queue = await asyncio.to_thread(RequestQueue, settings.queue_path, settings.generate.lease_seconds)
    state.queue = QueueService(
        queue,
        max_lease_batch=settings.generate.max_lease_batch,
        models=state.catalog.versions,
    )
    remote: RemoteBackend | None = None
    worker_started = False
    housekeeping: asyncio.Task[None] | None = None
    try:
        state.prompts = await asyncio.to_thread(
            PromptChecker.from_model_dir, settings.model, settings.engine.max_model_len
        )
        if worker is not None:
            # The in-process worker that held these leases died with the previous process.
            await state.queue.requeue_all_leased()
            await worker.start(state.queue)
            worker_started = True
            state.backend = worker.backend
        elif settings.server.worker_urls:
            remote = RemoteBackend(settings.server.worker_urls, default_max_num_seqs=settings.engine.max_num_seqs,
                                   api_key=state.worker_key)
            await remote.start()
            state.backend = remote
        state.backend_started = True
        state.prompts.engine_limit = lambda: _served_length(state)  # prompts are checked against what is served
        housekeeping = asyncio.create_task(
            state.queue.housekeeping(settings.generate.result_retention_seconds, settings.generate.housekeeping_interval)
        )
        state.metrics.bind(queue, state.backend.load if state.backend is not None else None, state.queue.workers)
        logger.info("control plane ready: queue %s, %s", settings.queue_path, _describe(worker, settings))
        # What start-up built (the engine front end, torch, vLLM) lives as long as the server: out of the garbage
        # collector's sight, a full collection no longer stalls the event loop for a third of a second (as vLLM's
        # own server does; docs/architecture.md, "Long-lived heap").
        gc.collect()
        gc.freeze()
        yield
    finally:
        gc.unfreeze()  # an app embedded in a longer-lived process leaves its heap collectable again
        if housekeeping is not None:
            housekeeping.cancel()
            await asyncio.gather(housekeeping, return_exceptions=True)
        state.backend = None
        if worker_started:
            await worker.stop()
            # Whatever the stopped worker still held goes back to the queue now, not at lease expiry.
            returned = await state.queue.requeue_all_leased()
            if returned:
                logger.info("returned %d leased items to the queue", returned)
        if remote is not None:
            await remote.close()
        state.metrics.bind(None, None)
        state.queue.close()
        state.queue = None


def _describe(worker: EmbeddedWorker | None, settings: Settings) -> str:
    if worker is not None:
        return "embedded worker"
    if settings.server.worker_urls:
        return f"workers at {', '.join(settings.server.worker_urls)}"
    return "no inference worker (OpenAI routes answer 503)"
