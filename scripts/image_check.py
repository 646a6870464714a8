"""Build-time check of an installed scalarlm: every module imports, and vLLM accepts the engine we would build.

The images run it as their last build step, and tests/unit/deploy/test_image_check.py runs it in the
development venv, so an image whose vLLM, torch or megatron-core does not fit our code fails at `docker build`,
not on the cluster. It needs no GPU and no network. A build machine has no GPU, and vLLM's argument parser
needs a platform, so the Dockerfiles run it with `VLLM_TARGET_DEVICE=cpu` (vLLM's CPU platform, present in
every vLLM build): the engine flags are built for both devices (CPU: a KV cache byte size; accelerator: the
GPU memory share, no byte size) and read by vLLM's own `vllm serve` parser and `AsyncEngineArgs`, and on the
CPU platform the full engine config is built for a tiny Qwen3 config. Prints one JSON line; fails loudly.
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import sys
import tempfile
import time
from pathlib import Path


def import_every_module() -> list[str]:
    """Import each scalarlm module (entry-point `__main__` modules aside, which would run)."""
    import scalarlm

    names = [m.name for m in pkgutil.walk_packages(scalarlm.__path__, "scalarlm.") if not m.name.endswith("__main__")]
    for name in names:
        importlib.import_module(name)
    return names


def write_tiny_config(directory: Path) -> Path:
    """A tiny Qwen3 config.json (no weights: building an engine config reads only the config)."""
    from transformers import Qwen3Config

    Qwen3Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=1024, tie_word_embeddings=True,
    ).save_pretrained(directory)  # fmt: skip
    return directory


def check_engine_args(model_dir: Path) -> dict[str, object]:
    """Parse our engine flags for each device with vLLM's parser; build the full config where vLLM can."""
    from scalarlm.config import CPU_KV_CACHE_BYTES, load_settings
    from scalarlm.inference.engine import parse_serve_args
    from scalarlm.inference.vllm_api import AsyncEngineArgs, current_platform_name, engine_device

    settings = load_settings(model=str(model_dir), engine={"max_model_len": 256, "max_num_seqs": 4})
    out: dict[str, object] = {"platform": current_platform_name()}
    for device in ("cpu", "accelerator"):
        args = AsyncEngineArgs.from_cli_args(parse_serve_args(settings, device))
        want = CPU_KV_CACHE_BYTES if device == "cpu" else None
        if args.kv_cache_memory_bytes != want:
            raise SystemExit(f"{device}: kv_cache_memory_bytes {args.kv_cache_memory_bytes}, expected {want}")
        out[f"{device}_gpu_memory_utilization"] = args.gpu_memory_utilization
    if current_platform_name() == "cpu":
        config = AsyncEngineArgs.from_cli_args(parse_serve_args(settings, engine_device())).create_engine_config()
        out["engine_config_kv_bytes"] = config.cache_config.kv_cache_memory_bytes
        out["engine_config_max_model_len"] = config.model_config.max_model_len
    return out


def main() -> int:
    started = time.perf_counter()
    from scalarlm.inference.process_env import configure_vllm_process_env

    configure_vllm_process_env()
    import megatron.core
    import mpi4py
    import vllm

    modules = import_every_module()
    with tempfile.TemporaryDirectory() as tmp:
        engine = check_engine_args(write_tiny_config(Path(tmp)))
    report = {
        "ok": True,
        "modules": len(modules),
        "vllm": vllm.__version__,
        "megatron_core": megatron.core.__version__,
        "mpi4py": mpi4py.__version__,
        **engine,
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
