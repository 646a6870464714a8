"""Process-wide environment vLLM reads at import time, set in one place by the worker entry point."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def configure_vllm_process_env() -> None:
    """Set vLLM's process environment before `import vllm`; explicit user settings win.

    On a machine without an accelerator `VLLM_ENABLE_V1_MULTIPROCESSING=0` is set. Measured with vLLM 0.32: the
    `AsyncLLM` that `scalarlm serve` builds still runs its `EngineCore` in a child process (tests/integration/
    inference/test_multiprocess_swap.py), so `inference/reaper.py` keeps that child from outliving the server.
    Call this once, first thing, in the process that will build an engine.
    """
    # Our own loggers report per-request state; vLLM's per-request INFO lines would flood at 10k prompts.
    # Set before any vLLM import: vLLM configures its logger when first imported.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from scalarlm.inference.vllm_api import engine_device  # vLLM reads the variables below lazily

    if engine_device() == "cpu":
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    logger.debug("vLLM multiprocessing=%s", os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "default"))
