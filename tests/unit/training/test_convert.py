"""The HF <-> megatron mapping as pure tensor code: bit-exact round trips (TP 1 and 2), layouts, arch checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scalarlm.cli.tiny_model import make_tiny_model
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training import hf_io
from scalarlm.training.convert import hf_tensor_names, hf_to_mcore, mcore_to_hf
from scalarlm.training.families import check_tensor_parallel, read_arch
from scalarlm.training.model import model_arch


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("qwen2") / "m", family="qwen2", heads=4, kv_heads=2, tie_embeddings=True
    )


def _load(model_dir: Path):
    return model_arch(model_dir), hf_io.load_weights(model_dir)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("which", ["llama", "qwen2"])
def test_round_trip_is_bit_exact(tiny_model_dir: Path, qwen2_dir: Path, which: str, tp: int) -> None:
    arch, hf = _load(tiny_model_dir if which == "llama" else qwen2_dir)
    shards = [hf_to_mcore(hf, arch, rank, tp) for rank in range(tp)]
    back = mcore_to_hf(shards, arch)
    assert set(back) == set(hf) == set(hf_tensor_names(arch))
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_qwen2_shape_is_read_from_config_and_weights(qwen2_dir: Path) -> None:
    arch, hf = _load(qwen2_dir)
    assert arch.qkv_bias and arch.tied_embeddings and (arch.num_heads, arch.num_kv_heads) == (4, 2)
    mcore = hf_to_mcore(hf, arch)
    assert "output_layer.weight" not in mcore  # tied: megatron shares the embedding
    qkv = mcore["decoder.layers.0.self_attention.linear_qkv.weight"]
    d = arch.head_dim
    # Group 0 holds query heads 0-1, then k_0, then v_0.
    q, k = hf["model.layers.0.self_attn.q_proj.weight"], hf["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(qkv[: 2 * d], q[: 2 * d]) and torch.equal(qkv[2 * d : 3 * d], k[:d])
    assert mcore["decoder.layers.0.self_attention.linear_qkv.bias"].shape == (arch.num_kv_heads * 4 * d,)


def test_tp_shards_hold_whole_kv_groups_and_split_gate_and_up(qwen2_dir: Path) -> None:
    arch, hf = _load(qwen2_dir)
    r0, r1 = (hf_to_mcore(hf, arch, r, 2) for r in range(2))
    full = hf_to_mcore(hf, arch)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    assert torch.equal(torch.cat([r0[name], r1[name]]), full[name])
    fc1 = "decoder.layers.1.mlp.linear_fc1.weight"
    ffn = arch.ffn_hidden_size
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    assert torch.equal(r1[fc1], torch.cat([gate[ffn // 2 :], up[ffn // 2 :]]))


def test_unsupported_models_and_layouts_are_rejected(tiny_model_dir: Path) -> None:
    config = hf_io.read_config(tiny_model_dir)
    names = hf_io.tensor_names(tiny_model_dir)
    with pytest.raises(InvalidRequest, match="not supported"):
        read_arch({**config, "architectures": ["GPT2LMHeadModel"]}, names)
    with pytest.raises(InvalidRequest, match="rope_type 'dynamic'"):
        read_arch({**config, "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, names)
    arch = read_arch(config, names)
    with pytest.raises(InvalidRequest, match="tensor_parallel_size 3"):
        check_tensor_parallel(arch, 3)


def test_gpt_oss_experts_are_deinterleaved_transposed_and_stacked_back(tmp_path: Path) -> None:
    """GPT-OSS stores expert e's gate and up interleaved by column in gate_up_proj[e] ([H, 2I], x @ W) and its down as
    [I, H]: megatron's fc1 is [gate; up] as [2I, H] (with the bias likewise), fc2 is [H, I]; back is bit-exact."""
    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS

    arch, hf = _load(make_tiny_model(tmp_path / "gpt-oss", **FAMILY_TINY_MODELS["gpt-oss"]))
    mcore = hf_to_mcore(hf, arch)
    src, dst = "model.layers.1.mlp.experts.", "decoder.layers.1.mlp.experts.local_experts.2."
    gate_up, bias = hf[src + "gate_up_proj"][2], hf[src + "gate_up_proj_bias"][2]
    assert torch.equal(mcore[dst + "linear_fc1.weight"], torch.cat([gate_up[:, 0::2].T, gate_up[:, 1::2].T]))
    assert torch.equal(mcore[dst + "linear_fc1.bias"], torch.cat([bias[0::2], bias[1::2]]))
    assert torch.equal(mcore[dst + "linear_fc2.weight"], hf[src + "down_proj"][2].T)
    assert torch.equal(mcore[dst + "linear_fc2.bias"], hf[src + "down_proj_bias"][2])
    sinks = mcore["decoder.layers.0.self_attention.core_attention.softmax_offset"]
    assert torch.equal(sinks, hf["model.layers.0.self_attn.sinks"])
    back = mcore_to_hf([mcore], arch)
    assert set(back) == set(hf) and all(torch.equal(back[name], tensor) for name, tensor in hf.items())
