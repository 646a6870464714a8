"""Build a stock vLLM `AsyncLLM` from Settings, the way `vllm serve` does, with a load-tracking stat logger."""

from __future__ import annotations

import itertools
import json
import logging
from argparse import Namespace
from dataclasses import dataclass, field
from pathlib import Path

from scalarlm.config import CPU_KV_CACHE_BYTES, CPU_MAX_MODEL_LEN, Settings, gpu_memory_split
from scalarlm.inference.load import LoadTracker, stat_logger_factory
from scalarlm.inference.worker_extension import WORKER_EXTENSION
from scalarlm.inference.vllm_api import (
    AsyncEngineArgs,
    AsyncLLM,
    Device,
    FlexibleArgumentParser,
    ReasoningParserManager,
    ToolParserManager,
    UsageContext,
    enable_envs_cache,
    engine_device,
    lora_servable,
    make_arg_parser,
    unimportable_architecture,
    validate_parsed_serve_args,
)

logger = logging.getLogger(__name__)


@dataclass
class Engine:
    """A running engine with the `vllm serve` arguments it was built from and its load tracker."""

    llm: AsyncLLM
    args: Namespace
    load: LoadTracker
    # LoRA adapter ids handed out for this engine (vLLM caches adapters by id: never reuse one).
    lora_ids: itertools.count = field(default_factory=lambda: itertools.count(1))

    @property
    def max_model_len(self) -> int:
        """The context length the engine enforces."""
        return int(self.llm.model_config.max_model_len)

    def shutdown(self) -> None:
        """Stop the engine and free its memory (with vLLM's configured grace period, as `vllm serve` does)."""
        self.llm.shutdown(timeout=self.llm.vllm_config.shutdown_timeout)


def memory_cli_args(settings: Settings, device: Device) -> list[str]:
    """The flags that size vLLM's memory on `device`.

    On an accelerator vLLM sizes its KV cache from `--gpu-memory-utilization` (this node's share of each GPU,
    see `config.gpu_memory_split`) unless the user pins `kv_cache_bytes`: vLLM ignores the fraction for the
    KV cache whenever `--kv-cache-memory-bytes` is given. vLLM's CPU backend needs the byte size.
    """
    eng = settings.engine
    if device == "cpu":
        return ["--kv-cache-memory-bytes", str(eng.kv_cache_bytes or CPU_KV_CACHE_BYTES)]
    argv = ["--gpu-memory-utilization", str(gpu_memory_split(settings).vllm)]
    if eng.kv_cache_bytes is not None:
        argv += ["--kv-cache-memory-bytes", str(eng.kv_cache_bytes)]
    return argv


def checkpoint_config(path: str | Path) -> dict | None:
    """A local checkpoint's config.json (None: not a local directory, or no readable config)."""
    try:
        return json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None


def checkpoint_experts(path: str | Path) -> int:
    """How many experts a local checkpoint's layers have (0: a dense model, or no readable config)."""
    config = checkpoint_config(path) or {}
    return int(config.get("num_experts") or config.get("num_local_experts") or config.get("n_routed_experts") or 0)


def longrope_switch(config: dict, max_model_len: int) -> str | None:
    """Why served outputs differ from transformers' (and the trainer's) on a `longrope` model (Phi-3.5-mini,
    Phi-4-mini) whose `max_model_len` passes its original context, or None. vLLM 0.32 then rotates every request with
    the long factors; transformers and the trainer use the short ones for a sequence up to the original context."""
    params = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if (params.get("rope_type") or params.get("type")) not in ("longrope", "su"):
        return None
    original = config.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
    if not original or max_model_len <= int(original):
        return None
    return (f"max_model_len {max_model_len} is past the model's original context ({original}): vLLM serves every "
            f"request with longrope's long factors, while transformers and the trainer rotate a sequence of up to "
            f"{original} tokens with the short ones (RL logprobs will differ); set engine.max_model_len to {original} "
            f"to serve as they do")  # fmt: skip


def engine_max_model_len(settings: Settings, device: Device) -> int:
    """`engine.max_model_len`, or where it is None: CPU_MAX_MODEL_LEN on CPU, -1 on an accelerator (vLLM's auto-fit:
    the model's own context if its KV cache fits in the engine's memory, else the longest that does)."""
    if settings.engine.max_model_len is not None:
        return settings.engine.max_model_len
    return CPU_MAX_MODEL_LEN if device == "cpu" else -1


def cpu_rotary_args(config: dict, device: Device) -> list[str]:
    """vLLM flags that keep a multi-latent attention model (DeepSeek-V3, Moonlight: `kv_lora_rank`) exact on CPU.
    vLLM 0.32.0's CPU rotary kernel mis-rotates MLA's [tokens, heads, rope dims] queries (probed: greedy tokens differ
    from transformers' from the first one on; yarn's rotary class is plain PyTorch and unaffected), so on CPU the
    rotary op runs vLLM's PyTorch path instead (every other custom op as before)."""
    if device != "cpu" or not config.get("kv_lora_rank"):
        return []
    return ["--compilation-config", json.dumps({"custom_ops": ["all", "-rotary_embedding"]})]


def model_impl_args(config: dict) -> list[str]:
    """`--model-impl transformers` for a checkpoint whose vLLM class cannot be imported here (vLLM 0.32.0's multimodal
    Gemma 3 needs torchvision, which a CPU install lacks): vLLM's Transformers backend serves it, on transformers' own
    modules (text prompts measured equal to transformers). Elsewhere vLLM picks its own implementation."""
    architecture = unimportable_architecture(list(config.get("architectures") or []))
    if architecture is None:
        return []
    logger.warning("vLLM's %s cannot be imported here (see vLLM's error above): serving it with vLLM's Transformers "
                   "backend", architecture)  # fmt: skip
    return ["--model-impl", "transformers"]


def lora_enabled(settings: Settings, device: Device) -> bool:
    """Whether the engine gets LoRA slots: `engine.enable_lora`, except for a mixture-of-experts model on CPU. vLLM
    0.32.0's LoRA wrapper of the fused-MoE layer runs Triton kernels, which the CPU build lacks: the EngineCore died
    on its first forward (measured, "triton.language has no attribute float32"). Nor for a model whose vLLM class
    takes no adapters (`lora_servable`: StableLM), on which vLLM would not start with LoRA slots. An engine without
    slots serves each adapter merged into the base (`hot_swap.WeightsManager`)."""
    if not settings.engine.enable_lora:
        return False
    architectures = list((checkpoint_config(settings.model) or {}).get("architectures") or [])
    if not lora_servable(architectures):
        logger.warning("LoRA is off for %s: vLLM's %s serves no adapters", settings.model, architectures)
        return False
    if device == "cpu" and checkpoint_experts(settings.model):
        logger.warning("LoRA is off for %s: a mixture-of-experts model on CPU (vLLM's MoE LoRA layer needs Triton)",
                       settings.model)  # fmt: skip
        return False
    return True


def engine_dtype(settings: Settings, device: Device) -> str:
    """`engine.dtype`, or where it is None: float32 on CPU, vLLM's "auto" (the checkpoint's dtype) on an accelerator."""
    return settings.engine.dtype or ("float32" if device == "cpu" else "auto")


def serve_cli_args(settings: Settings, device: Device | None = None) -> list[str]:
    """The `vllm serve` flags equivalent to our settings on `device` (default: where vLLM will run)."""
    eng = settings.engine
    device = device or engine_device()
    argv = [
        "--model", settings.model,
        "--served-model-name", settings.base_model_name,
        "--dtype", engine_dtype(settings, device),
        "--max-model-len", str(engine_max_model_len(settings, device)),
        "--max-num-seqs", str(eng.max_num_seqs),
        *memory_cli_args(settings, device),
        "--tensor-parallel-size", str(eng.tensor_parallel_size),
        "--seed", str(eng.seed),
        # Our pull loop and backend stamp their own fingerprint (model + weights version) on responses.
        "--fingerprint-mode", "none",
        # Methods the hot-swap calls on the workers after reload_weights (inference/worker_extension.py).
        "--worker-extension-cls", WORKER_EXTENSION,
    ]  # fmt: skip
    if eng.enforce_eager:
        argv.append("--enforce-eager")
    config = checkpoint_config(settings.model) or {}
    argv += cpu_rotary_args(config, device) + model_impl_args(config)
    if lora_enabled(settings, device):
        argv += ["--enable-lora", "--max-loras", str(eng.max_loras), "--max-lora-rank", str(eng.max_lora_rank)]
    if eng.tool_call_parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", eng.tool_call_parser]
    if eng.reasoning_parser is not None:
        argv += ["--reasoning-parser", eng.reasoning_parser]
    return argv


def parse_serve_args(settings: Settings, device: Device | None = None) -> Namespace:
    """Parse our settings with vLLM's own `vllm serve` argument parser (defaults and checks included)."""
    parser = make_arg_parser(FlexibleArgumentParser(prog="scalarlm-worker"))
    args = parser.parse_args(serve_cli_args(settings, device))
    validate_parsed_serve_args(args)
    for setting, name, known in (("tool_call_parser", args.tool_call_parser, ToolParserManager.list_registered()),
                                 ("reasoning_parser", args.reasoning_parser, ReasoningParserManager.list_registered())):
        if name and name not in known:  # refused before the engine loads, naming vLLM's choices
            raise ValueError(f"engine.{setting} {name!r} is not one of vLLM's: {', '.join(sorted(known))}")
    return args


def start_engine(settings: Settings) -> Engine:
    """Build the `AsyncLLM` (call inside the running event loop: vLLM starts its output task there)."""
    args = parse_serve_args(settings)
    config = checkpoint_config(settings.model) or {}
    note = longrope_switch(config, engine_max_model_len(settings, engine_device()))
    if note:
        logger.warning("%s: %s", settings.model, note)
    engine_args = AsyncEngineArgs.from_cli_args(args)
    vllm_config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    tracker = LoadTracker(max_num_seqs=vllm_config.scheduler_config.max_num_seqs)
    llm = AsyncLLM.from_vllm_config(
        vllm_config=vllm_config,
        usage_context=UsageContext.OPENAI_API_SERVER,
        stat_loggers=[stat_logger_factory(tracker)],
        enable_log_requests=engine_args.enable_log_requests,
        disable_log_stats=engine_args.disable_log_stats,
    )
    # As vLLM's engine core does after its start: freeze vLLM's env lookups, which its per-token
    # bookkeeping would otherwise re-read from os.environ (~15% of the front end's CPU).
    enable_envs_cache()
    # what the engine serves: our setting, or what vLLM chose for -1 (its core reports the fitted length at start)
    tracker.max_model_len = int(llm.model_config.max_model_len)
    logger.info("vLLM engine up: model %s served as %s", settings.model, settings.base_model_name)
    return Engine(llm=llm, args=args, load=tracker)
