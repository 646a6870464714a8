"""A base model the trainer would refuse is a 400 at `POST /v1/megatron/train` naming the problem, before anything
is written or started: unsupported architecture, unknown RoPE type, a tensor no rule maps, a LoRA target the family
cannot place, a tensor-parallel size that does not split it. The check reads config.json and the safetensors
headers only (the control plane imports no torch)."""

from __future__ import annotations

import json
import shutil
import textwrap
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from scalarlm.config import Settings
from scalarlm.launcher import LocalLauncher
from scalarlm.server.app import create_app
from scalarlm.server.jobs import TrainingJobs

from sdk_payloads import STAND_IN_TRAINER, post_train, sdk_archive  # helper module next to this file


def _edit_config(model: Path, **changes) -> None:
    config = json.loads((model / "config.json").read_text())
    config.update(changes)
    (model / "config.json").write_text(json.dumps(config))


def _add_tensor(model: Path, name: str) -> None:
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(model / "model.safetensors")
    weights[name] = torch.ones(64)
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Callable[[Path], tuple[TestClient, Settings]]]:
    """serve(model_dir) -> (client, settings) of a real app whose launcher would start a stand-in trainer."""
    trainer = tmp_path / "stand_in_trainer.py"
    trainer.write_text(textwrap.dedent(STAND_IN_TRAINER))
    clients = []

    def start(model: Path) -> tuple[TestClient, Settings]:
        settings = Settings(home=tmp_path / "home", model=str(model), training={"poll_seconds": 0.2})
        app = create_app(settings)
        app.state.training = TrainingJobs(settings, {"local": LocalLauncher(settings, entry=[str(trainer)])})
        client = TestClient(app).__enter__()
        clients.append(client)
        return client, settings

    yield start
    for client in clients:
        client.__exit__(None, None, None)


def _copy(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest)
    return dest


def _refused(client: TestClient, settings: Settings, params: dict, *words: str) -> None:
    response = post_train(client, sdk_archive(), {"max_steps": 2, **params})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    for word in words:
        assert word in error["message"], error
    jobs = list(settings.jobs_dir.iterdir()) if settings.jobs_dir.exists() else []
    assert jobs == []  # nothing written, nothing launched
    assert client.get("/v1/megatron/list_models").json()["models"][1:] == []


def test_unmapped_tensor_is_named(serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir, tmp_path / "extra-tensor")
    _add_tensor(model, "model.layers.0.self_attn.q_norm.weight")  # a Qwen3 tensor in a Llama checkpoint
    _refused(*serve(model), {}, "model.layers.0.self_attn.q_norm.weight", "map to nothing")


def test_unknown_rope_type_is_named(serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir, tmp_path / "dynamic")
    _edit_config(model, rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
    _refused(*serve(model), {}, "rope_type 'dynamic'")


@pytest.mark.parametrize(
    ("architecture", "words"),
    [("GPT2LMHeadModel", ("GPT2LMHeadModel", "not supported")),
     ("GraniteMoeSharedForCausalLM", ("GraniteMoeSharedForCausalLM", "shared MLP beside the experts")),
     # a text-only checkpoint labelled multimodal: the text model's names are not where Gemma 3 4B-27B keeps them
     ("Gemma3ForConditionalGeneration", ("gemma3_mm checkpoint map to nothing", "model.embed_tokens.weight")),
     ("PhimoeForCausalLM", ("PhimoeForCausalLM", "sparsemixer routing")),
     ("Mistral3ForConditionalGeneration", ("multimodal Mistral 3", "Magistral", "MistralForCausalLM checkpoints")),
     ("Qwen3_5ForCausalLM", ("Qwen3_5ForCausalLM", "gated DeltaNet", "Qwen3-Next")),
     ("Gemma4ForConditionalGeneration", ("Gemma 4 is not supported yet",))],
)  # fmt: skip
def test_unsupported_architecture_is_named(serve, tiny_model_dir: Path, tmp_path: Path, architecture: str,
                                           words: tuple[str, ...]) -> None:  # fmt: skip
    model = _copy(tiny_model_dir, tmp_path / architecture)
    _edit_config(model, architectures=[architecture])
    _refused(*serve(model), {}, *words)


def test_granite4_hybrid_mamba_layers_are_named(serve, family_models: dict[str, Path], tmp_path: Path) -> None:
    """granite-4.0-h-*'s layout (Mamba-2 layers among the attention ones) on the supported granite4 tiny model."""
    model = _copy(family_models["granite4"], tmp_path / "granite-4.0-h")
    _edit_config(model, layer_types=["mamba", "attention"])
    _refused(*serve(model), {}, "layer_types ['mamba']", "Mamba-2 layers", "granite-4.0-micro")


def test_unsupported_activation_and_bias_are_named(serve, tiny_model_dir: Path, tmp_path: Path) -> None:
    model = _copy(tiny_model_dir, tmp_path / "gelu")
    _edit_config(model, hidden_act="gelu")
    client, settings = serve(model)
    _refused(client, settings, {}, "hidden_act 'gelu'")
    _edit_config(model, hidden_act="silu", mlp_bias=True)
    _refused(client, settings, {}, "mlp_bias")


def test_lora_targets_and_tensor_parallel_are_checked_for_the_family(serve, family_models: dict[str, Path]) -> None:
    client, settings = serve(family_models["phi3"])
    _refused(client, settings, {"adapter_type": "lora", "lora_config": {"target_modules": ["q_proj", "v_proj"]}},
             "qkv_proj")  # fmt: skip
    _refused(client, settings, {"adapter_type": "full", "tensor_parallel_size": 3, "gpus": 3}, "tensor_parallel_size 3 must divide the model")
    response = post_train(client, sdk_archive(), {"max_steps": 2})  # default targets: Phi-3's fused modules
    assert response.status_code == 200, response.text
