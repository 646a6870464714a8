"""Every `engine` setting (and the served model's name) reaches vLLM: through the `vllm serve` argv we build, read
back by vLLM's own parser and `AsyncEngineArgs`, as the worker starts its engine.

Memory sizing (`kv_cache_bytes`, `gpu_memory_utilization`) has its own tests in test_engine_args.py.
"""

from __future__ import annotations

from scalarlm.inference.process_env import configure_vllm_process_env

configure_vllm_process_env()

from scalarlm.config import Settings  # noqa: E402
from scalarlm.inference.engine import parse_serve_args  # noqa: E402
from scalarlm.inference.vllm_api import AsyncEngineArgs  # noqa: E402


def _engine_args(tmp_path, device: str = "cpu", **sections) -> AsyncEngineArgs:
    settings = Settings(model=str(tmp_path), home=tmp_path, **sections)
    return AsyncEngineArgs.from_cli_args(parse_serve_args(settings, device))


def test_engine_settings_are_the_engine_args_vllm_reads(tmp_path) -> None:
    engine = dict(max_model_len=96, dtype="bfloat16", max_num_seqs=7, tensor_parallel_size=2, seed=11,
                  enforce_eager=False, enable_lora=True, max_loras=3, max_lora_rank=32)  # fmt: skip
    args = _engine_args(tmp_path, served_model_name="served-tiny", engine=engine)
    assert (args.model, args.served_model_name) == (str(tmp_path), ["served-tiny"])
    assert (args.max_model_len, args.dtype, args.max_num_seqs) == (96, "bfloat16", 7)
    assert (args.tensor_parallel_size, args.seed, args.enforce_eager) == (2, 11, False)
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 32)


def test_defaults_and_lora_off(tmp_path) -> None:
    args = _engine_args(tmp_path, engine={"enable_lora": False, "max_loras": 9})
    assert args.enforce_eager is True and args.dtype == "float32" and args.max_model_len == 512
    assert not args.enable_lora and args.max_loras != 9  # no LoRA: vLLM's own default, ours not passed
    assert args.served_model_name == [tmp_path.name]  # no served_model_name: the model directory's name
    # no dtype: float32 on CPU (above), the checkpoint's own on an accelerator, where the trainer trains in bf16
    assert _engine_args(tmp_path, "accelerator").dtype == "auto"
    assert _engine_args(tmp_path, "accelerator", engine={"dtype": "float16"}).dtype == "float16"
    # no max_model_len: 512 on CPU (above), vLLM's auto-fit on an accelerator (the model's own context if its KV
    # cache fits, else the longest that does); a given one on either
    assert _engine_args(tmp_path, "accelerator").max_model_len == -1
    assert _engine_args(tmp_path, "accelerator", engine={"max_model_len": 4096}).max_model_len == 4096


def test_a_mixture_of_experts_model_on_cpu_gets_no_lora_slots(tmp_path) -> None:
    """vLLM 0.32.0's MoE LoRA layer runs Triton kernels, which killed the CPU EngineCore on its first forward: a MoE
    base on CPU starts without LoRA (none can be trained for it); the same model on an accelerator keeps them."""
    import json

    from scalarlm.inference.engine import lora_enabled

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 4}))
    args = _engine_args(tmp_path, engine={"enable_lora": True})
    assert not args.enable_lora
    settings = Settings(model=str(tmp_path), home=tmp_path)
    assert not lora_enabled(settings, "cpu") and lora_enabled(settings, "accelerator")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Glm4MoeForCausalLM"], "n_routed_experts": 4}))
    assert not lora_enabled(settings, "cpu")  # GLM-4.5 names its expert count n_routed_experts
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert lora_enabled(settings, "cpu")
    # vLLM 0.32.0's StableLM takes no adapters (its engine would not start with LoRA slots), on any device
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["StableLmForCausalLM"]}))
    assert not lora_enabled(settings, "cpu") and not lora_enabled(settings, "accelerator")


def test_tool_call_and_reasoning_parsers_reach_vllm_and_unknown_ones_are_refused(tmp_path) -> None:
    """OpenAI tool calling (`--enable-auto-tool-choice --tool-call-parser`) and a thinking model's reasoning parser
    are vLLM's own flags; a name vLLM does not know is refused before the engine loads, naming its choices."""
    import pytest

    settings = Settings(model=str(tmp_path), home=tmp_path, engine={"tool_call_parser": "hermes",
                                                                    "reasoning_parser": "qwen3"})  # fmt: skip
    args = parse_serve_args(settings, "cpu")
    assert (args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser) == (True, "hermes", "qwen3")
    plain = parse_serve_args(Settings(model=str(tmp_path), home=tmp_path), "cpu")
    assert not plain.enable_auto_tool_choice and not plain.tool_call_parser and not plain.reasoning_parser
    for setting, value in (("tool_call_parser", "nope"), ("reasoning_parser", "qwen9")):
        with pytest.raises(ValueError, match=f"engine.{setting} '{value}' is not one of vLLM's: .*hermes|qwen3"):
            parse_serve_args(Settings(model=str(tmp_path), home=tmp_path, engine={setting: value}), "cpu")


def test_a_longrope_model_served_past_its_original_context_is_warned_about() -> None:
    """vLLM 0.32 picks longrope's long factors for every request once max_model_len passes the original context
    (Phi-4-mini: 4096); transformers and the trainer keep the short ones up to it. The worker logs why, and the fix."""
    from scalarlm.inference.engine import longrope_switch

    phi4 = {"original_max_position_embeddings": 4096, "rope_scaling": {"type": "longrope", "short_factor": [1.0]}}
    message = longrope_switch(phi4, 8192)
    assert message is not None and "set engine.max_model_len to 4096" in message and "long factors" in message
    assert longrope_switch(phi4, 4096) is None
    phi35 = {"rope_parameters": {"rope_type": "longrope", "original_max_position_embeddings": 4096}}
    assert longrope_switch(phi35, 4097) is not None
    yarn = {"rope_parameters": {"rope_type": "yarn", "original_max_position_embeddings": 64}}
    assert longrope_switch(yarn, 512) is None
    assert longrope_switch({}, 512) is None
