"""Process-wide environment that vLLM and OpenMP read when they load, set in one place by the entry points."""

from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)

# How many times an idle OpenMP thread spins before it sleeps (libgomp's default: 300,000).
OPENMP_SPIN_COUNT = "10000"


def configure_openmp_env() -> None:
    """Shorten OpenMP's busy wait for the whole `scalarlm serve` process tree; a user's own setting wins.

    Call it before anything loads torch (libgomp reads the variable once, when it loads): the engine core and the
    trainers the server launches inherit it. A thread that spins long after its work takes a core that something
    else on the host needs: a CPU engine beside a CPU session trainer, or the engine's weight swap while a step
    trains. The measurements are in docs/architecture.md ("Async RL sessions").
    """
    if "OMP_WAIT_POLICY" not in os.environ:  # PASSIVE / ACTIVE chosen by the user: theirs to keep
        os.environ.setdefault("GOMP_SPINCOUNT", OPENMP_SPIN_COUNT)


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
