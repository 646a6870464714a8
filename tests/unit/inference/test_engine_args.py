"""The `vllm serve` flags built from settings size vLLM's memory as docs/deploy.md says, on CPU and on GPUs.

The device is a parameter of the pure argv builder (vLLM's own platform decides it at run time), so the
accelerator case is checked here on CPU: the flags, then vLLM's own parser and `AsyncEngineArgs` reading them.
"""

from __future__ import annotations

import pytest

from scalarlm.inference.process_env import configure_vllm_process_env

configure_vllm_process_env()

from scalarlm.config import (  # noqa: E402
    CPU_KV_CACHE_BYTES,
    DEDICATED_VLLM_SHARE,
    SHARED_HEADROOM,
    SHARED_TRAINER_SHARE,
    SHARED_VLLM_SHARE,
    Settings,
    gpu_memory_split,
)
from scalarlm.inference.engine import parse_serve_args, serve_cli_args  # noqa: E402
from scalarlm.inference.vllm_api import AsyncEngineArgs, engine_device  # noqa: E402


def _settings(tmp_path, role: str = "worker", launcher: str = "local", **engine) -> Settings:
    return Settings(
        model=str(tmp_path), home=tmp_path, server={"role": role}, training={"launcher": launcher}, engine=engine
    )


def _flag(argv: list[str], name: str) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else None


def _engine_args(settings: Settings, device: str) -> AsyncEngineArgs:
    return AsyncEngineArgs.from_cli_args(parse_serve_args(settings, device))


def test_cpu_gets_an_explicit_kv_cache_size(tmp_path):
    argv = serve_cli_args(_settings(tmp_path), device="cpu")
    assert _flag(argv, "--kv-cache-memory-bytes") == str(CPU_KV_CACHE_BYTES) == str(1 << 30)
    assert "--gpu-memory-utilization" not in argv
    assert _engine_args(_settings(tmp_path), "cpu").kv_cache_memory_bytes == 1 << 30


def test_cpu_keeps_a_user_kv_cache_size(tmp_path):
    settings = _settings(tmp_path, kv_cache_bytes=3 << 30)
    assert _engine_args(settings, "cpu").kv_cache_memory_bytes == 3 << 30


def test_accelerator_kv_cache_follows_gpu_memory_utilization(tmp_path):
    argv = serve_cli_args(_settings(tmp_path), device="accelerator")
    assert "--kv-cache-memory-bytes" not in argv
    assert _flag(argv, "--gpu-memory-utilization") == str(DEDICATED_VLLM_SHARE)
    args = _engine_args(_settings(tmp_path), "accelerator")
    assert args.kv_cache_memory_bytes is None and args.gpu_memory_utilization == DEDICATED_VLLM_SHARE


def test_accelerator_user_settings_win(tmp_path):
    settings = _settings(tmp_path, gpu_memory_utilization=0.6, kv_cache_bytes=8 << 30)
    args = _engine_args(settings, "accelerator")
    assert args.gpu_memory_utilization == 0.6 and args.kv_cache_memory_bytes == 8 << 30


@pytest.mark.parametrize(
    ("role", "launcher", "vllm", "trainer"),
    [
        ("worker", "local", DEDICATED_VLLM_SHARE, 0.0),
        ("api", "local", DEDICATED_VLLM_SHARE, 0.0),
        ("embedded", "slurm", DEDICATED_VLLM_SHARE, 0.0),
        ("embedded", "local", SHARED_VLLM_SHARE, SHARED_TRAINER_SHARE),
    ],
)
def test_shared_gpus_get_the_stated_split(tmp_path, role, launcher, vllm, trainer):
    settings = _settings(tmp_path, role=role, launcher=launcher)
    assert tuple(gpu_memory_split(settings)) == (vllm, trainer)
    assert _engine_args(settings, "accelerator").gpu_memory_utilization == vllm


def test_split_adds_up_with_headroom(tmp_path):
    assert SHARED_VLLM_SHARE + SHARED_TRAINER_SHARE + SHARED_HEADROOM == pytest.approx(1.0)
    split = gpu_memory_split(_settings(tmp_path, role="embedded", gpu_memory_utilization=0.3))
    assert split.vllm == 0.3 and split.trainer == pytest.approx(1.0 - SHARED_HEADROOM - 0.3)


def test_default_device_is_vllms_platform(tmp_path):
    """With no device given, the argv follows vLLM's current platform (CPU on this box)."""
    assert serve_cli_args(_settings(tmp_path)) == serve_cli_args(_settings(tmp_path), device=engine_device())


def test_a_latent_attention_model_on_cpu_rotates_with_vllms_pytorch_path(tmp_path):
    """vLLM's CPU rotary kernel mis-rotates MLA's queries: an MLA checkpoint (`kv_lora_rank`) on CPU gets the rotary
    op off its custom ops (the served tokens = transformers': `test_family_serving.py`'s moonlight); other models and
    accelerators keep vLLM's defaults."""
    import json

    assert "--compilation-config" not in serve_cli_args(_settings(tmp_path), device="cpu")  # no config.json
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DeepseekV3ForCausalLM"], "kv_lora_rank": 512}))
    assert "--compilation-config" not in serve_cli_args(_settings(tmp_path), device="accelerator")
    args = _engine_args(_settings(tmp_path), "cpu")
    assert args.compilation_config.custom_ops == ["all", "-rotary_embedding"]


def test_a_checkpoint_whose_vllm_class_cannot_be_imported_is_served_by_the_transformers_backend(tmp_path):
    """vLLM 0.32.0's multimodal Gemma 3 imports transformers' torchvision image processor, which this CPU install lacks
    (scripts/install.sh removes PyPI's CUDA torchvision): vLLM would not start on it, its Transformers backend serves
    it (served = transformers: `test_family_serving.py`'s gemma3-mm). A class that imports keeps vLLM's choice."""
    import importlib.util
    import json

    from scalarlm.inference.vllm_api import ModelRegistry

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForConditionalGeneration"]}))
    unimportable = ModelRegistry._try_load_model_cls("Gemma3ForConditionalGeneration") is None
    assert unimportable or importlib.util.find_spec("torchvision") is not None
    assert (_flag(serve_cli_args(_settings(tmp_path), device="cpu"), "--model-impl") == "transformers") == unimportable
    assert _engine_args(_settings(tmp_path), "cpu").model_impl == ("transformers" if unimportable else "auto")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Gemma3ForCausalLM"]}))
    assert "--model-impl" not in serve_cli_args(_settings(tmp_path), device="cpu")
