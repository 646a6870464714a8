"""The in-process inference worker: one engine, its OpenAI backend, and the pull loop."""

from __future__ import annotations

import logging
import os
import socket

from scalarlm.config import Settings
from scalarlm.inference.engine import Engine, start_engine
from scalarlm.inference.hot_swap import WeightsManager
from scalarlm.inference.openai_backend import VllmOpenAIBackend
from scalarlm.inference.pull_loop import PullLoop
from scalarlm.inference.reaper import EngineReaper
from scalarlm.inference.versions import ModelVersions
from scalarlm.protocol.backend import WorkSource

logger = logging.getLogger(__name__)


def default_worker_id() -> str:
    """A worker id unique on the cluster: host name and process id."""
    return f"{socket.gethostname()}-{os.getpid()}"


class InProcessWorker:
    """`EmbeddedWorker`: build the engine inside the running loop on `start`, pull work until `stop`."""

    def __init__(self, settings: Settings, worker_id: str | None = None, engine: Engine | None = None) -> None:
        """`engine`: an already running engine to use (and leave running on stop), e.g. a test's shared one."""
        self.settings = settings
        self.worker_id = worker_id or default_worker_id()
        self.versions = ModelVersions(settings.base_model_name)
        self.backend = VllmOpenAIBackend(settings)
        self.engine: Engine | None = engine
        self._owns_engine = engine is None
        self.pull_loop: PullLoop | None = None
        self.reaper: EngineReaper | None = None

    async def start(self, source: WorkSource) -> None:
        """Build the engine and the OpenAI serving objects, then start pulling from `source`."""
        if self.engine is None:
            self.reaper = EngineReaper()  # its processes must not outlive this one, even SIGKILLed
            try:
                self.engine = start_engine(self.settings)
            finally:
                self.reaper.watch()  # a failed start may leave processes behind too
        weights = WeightsManager(self.engine, self.settings, self.versions)
        await self.backend.attach(self.engine, self.versions, weights)
        self.pull_loop = PullLoop(self.engine, source, self.settings, self.worker_id, weights=weights)
        self.pull_loop.start()
        logger.info("worker %s pulling work", self.worker_id)

    async def stop(self) -> None:
        """Stop pulling (in-flight items finish and are posted), then shut the engine down."""
        if self.pull_loop is not None:
            await self.pull_loop.stop()
            self.pull_loop = None
        self.backend.detach()
        if self.engine is not None and self._owns_engine:
            self.engine.shutdown()
            self.engine = None
        if self.reaper is not None:
            self.reaper.close()
            self.reaper = None
