"""Run a blocking refresh now and then every few seconds for as long as the app lives."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

logger = logging.getLogger(__name__)


@contextlib.asynccontextmanager
async def every(seconds: float, refresh: Callable[[], object], what: str,
                transient: tuple[type[BaseException], ...] = (OSError,)) -> AsyncIterator[None]:
    """Call `refresh` (in a thread) once now, then every `seconds` until the block exits.

    Errors of the `transient` kinds are logged and the loop goes on; a file or SLURM hiccup must not end it.
    """
    await asyncio.to_thread(refresh)

    async def loop() -> None:
        while True:
            await asyncio.sleep(seconds)
            try:
                await asyncio.to_thread(refresh)
            except transient as e:
                logger.warning("%s failed: %s", what, e)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
