"""Every vLLM name scalarlm uses, imported here and nowhere else in the package.

vLLM's stable surface is small (`LLM`, `SamplingParams`, the `vllm serve` CLI); we also use its engine,
argument parser, OpenAI serving and error helpers, whose module paths move between releases. Importing
them in one module makes a vLLM upgrade a one-file change, and `tests/unit/inference/test_vllm_api.py`
checks that each name below exists in the installed vLLM (the version every stack pins: 0.32.0).

Import this module only after `process_env.configure_vllm_process_env()` has run (it imports vLLM).
"""

from __future__ import annotations

from typing import Literal

from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.engine.arg_utils import AsyncEngineArgs
from vllm.entrypoints.launchers.api_server.app_state import init_app_state
from vllm.entrypoints.launchers.cli_args import make_arg_parser, validate_parsed_serve_args
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.openai.completion.protocol import CompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.handlers.validation import (  # vLLM's own message format
    _MAX_REPORTED_ERRORS,
    _format_error,
    clean_loc_for_param,
)
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.envs import enable_envs_cache
from vllm.lora.layers import BaseLayerWithLoRA
from vllm.lora.request import LoRARequest
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod, VocabParallelEmbedding
from vllm.model_executor.models.interfaces import supports_lora
from vllm.model_executor.models.registry import ModelRegistry
from vllm.platforms import current_platform
from vllm.reasoning import ReasoningParserManager
from vllm.renderers.inputs.preprocess import parse_model_prompt
from vllm.sampling_params import RequestOutputKind
from vllm.tool_parsers import ToolParserManager
from vllm.usage.usage_lib import UsageContext
from vllm.utils.argparse_utils import FlexibleArgumentParser
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.exceptions import EngineDeadError
from vllm.v1.metrics.loggers import PrometheusStatLogger

Device = Literal["cpu", "accelerator"]

__all__ = [
    "AsyncEngineArgs",
    "AsyncLLM",
    "BaseLayerWithLoRA",
    "ChatCompletionRequest",
    "CompletionRequest",
    "Device",
    "EngineDeadError",
    "ErrorInfo",
    "ErrorResponse",
    "FlexibleArgumentParser",
    "LoRARequest",
    "ModelRegistry",
    "PrometheusStatLogger",
    "ReasoningParserManager",
    "RequestOutputKind",
    "RoutedExperts",
    "SamplingParams",
    "ToolParserManager",
    "UnquantizedEmbeddingMethod",
    "UsageContext",
    "VllmConfig",
    "VocabParallelEmbedding",
    "_MAX_REPORTED_ERRORS",
    "_format_error",
    "clean_loc_for_param",
    "create_error_response",
    "current_platform",
    "current_platform_name",
    "enable_envs_cache",
    "engine_device",
    "init_app_state",
    "lora_servable",
    "make_arg_parser",
    "parse_model_prompt",
    "sanitize_message",
    "supports_lora",
    "unimportable_architecture",
    "validate_parsed_serve_args",
]


def engine_device() -> Device:
    """Where vLLM will run its engine, decided as vLLM decides it (its current platform): CPU or an accelerator."""
    return "cpu" if current_platform.is_cpu() else "accelerator"


def lora_servable(architectures: list[str]) -> bool:
    """Whether vLLM's model class for these `architectures` takes LoRA adapters (its `SupportsLoRA`; a class vLLM does
    not know: True, vLLM refuses it at load anyway). An engine with LoRA slots on one that does not fails to start
    (vLLM 0.32.0's StableLM: "does not support LoRA yet"). Its registry resolves the class as vLLM's loader does."""
    for architecture in architectures:
        model_class = ModelRegistry._try_load_model_cls(architecture)  # (the registry's lookup by name; no public one)
        if model_class is not None:
            return supports_lora(model_class)
    return True


def unimportable_architecture(architectures: list[str]) -> str | None:
    """The architecture vLLM implements itself (its registry lists it) but whose class cannot be imported here, when
    none of `architectures` can be: vLLM would fail to start on the checkpoint (vLLM 0.32.0's multimodal Gemma 3
    module imports transformers' torchvision image processor, which a CPU install lacks). None: one loads, or none is
    vLLM's."""
    listed = [a for a in architectures if a in ModelRegistry.models]
    if listed and all(ModelRegistry._try_load_model_cls(a) is None for a in listed):
        return listed[0]
    return None


def current_platform_name() -> str:
    """vLLM's name for the device type it detected ("cpu", "cuda" also on ROCm, ...; "none" when it found none)."""
    return current_platform.device_type or "none"
