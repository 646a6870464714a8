"""What routers receive, declared once as `Annotated` dependencies over the app's `ServerState`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Request

from scalarlm.config import Settings
from scalarlm.protocol.backend import InferenceBackend
from scalarlm.protocol.errors import EngineUnavailable
from scalarlm.queue import QueueService
from scalarlm.server.admission import Admission
from scalarlm.server.models import ModelCatalog
from scalarlm.server.prompt_check import PromptChecker
from scalarlm.server.telemetry import ServerMetrics


@dataclass
class ServerState:
    """Everything one app holds while it runs, built by its lifespan (no module globals)."""

    settings: Settings
    metrics: ServerMetrics
    catalog: ModelCatalog
    admission: Admission
    queue: QueueService | None = None
    prompts: PromptChecker | None = None
    backend: InferenceBackend | None = None
    backend_started: bool = False
    # Split mode: the key workers present to the queue's worker routes and this app presents to every worker.
    worker_key: str | None = None


def get_state(request: Request) -> ServerState:
    return request.app.state.server


def get_settings(request: Request) -> Settings:
    return get_state(request).settings


def get_queue(request: Request) -> QueueService:
    queue = get_state(request).queue
    if queue is None:
        raise EngineUnavailable("the request queue is not open yet")
    return queue


def get_backend(request: Request) -> InferenceBackend:
    backend = get_state(request).backend
    if backend is None:
        raise EngineUnavailable("no inference worker is available")
    return backend


def get_prompts(request: Request) -> PromptChecker:
    prompts = get_state(request).prompts
    if prompts is None:
        raise EngineUnavailable("the server is still starting")
    return prompts


StateDep = Annotated[ServerState, Depends(get_state)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
QueueDep = Annotated[QueueService, Depends(get_queue)]
BackendDep = Annotated[InferenceBackend, Depends(get_backend)]
PromptsDep = Annotated[PromptChecker, Depends(get_prompts)]
