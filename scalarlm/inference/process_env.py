"""Process-wide environment vLLM reads at import time, set in one place by the worker entry point."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def configure_vllm_process_env() -> None:
    """Set vLLM's process environment before `import vllm`; explicit user settings win.

    On a machine without an accelerator the engine runs in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`):
    it starts in ~3 s instead of ~20 s and shares the caller's event loop. Call this once, first thing,
    in the process that will build an engine.
    """
    # Our own loggers report per-request state; vLLM's per-request INFO lines would flood at 10k prompts.
    # Set before any vLLM import: vLLM configures its logger when first imported.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from scalarlm.inference.vllm_api import engine_device  # vLLM reads the variables below lazily

    if engine_device() == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    logger.debug("vLLM multiprocessing=%s", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"))
