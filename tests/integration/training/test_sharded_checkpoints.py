"""Real checkpoints: sharded safetensors in bf16 and fp16 load in the trainer with megatron logits equal to HF's, and
at TP=2 each rank reads only its slices (counted by the loader, not mocked)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from sharded_models import model_arch, sharded_tiny_model
from trainer_jobs import mpi_env, require_mpirun

from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS
from scalarlm.training import hf_io
from scalarlm.training.convert import hf_to_mcore
from scalarlm.training.shard_load import load_rank_params

CHECK = Path(__file__).with_name("sharded_check.py")
TOLERANCE = 1e-4  # fp32 compute on bf16/fp16 weights: HF upcasts the same stored values


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Llama with GQA (4 query heads over 2 KV groups) in bf16, Qwen2 (qkv bias, tied embeddings) in fp16."""
    root = tmp_path_factory.mktemp("sharded")
    return [
        sharded_tiny_model(root, "llama-bf16", "bfloat16", family="llama", heads=4, kv_heads=2, seed=1),
        sharded_tiny_model(root, "qwen2-fp16", "float16", family="qwen2", heads=2, kv_heads=2, tie_embeddings=True),
    ]


def _expected_rank_bytes(model_dir: Path, tp: int) -> int:
    """Norms whole, every other tensor 1/tp of it (a tied model's saved lm_head is read like the embedding)."""
    total = 0
    with hf_io.Weights(model_dir, None) as w:
        for name in w:
            numel = 1
            for n in w.shape(name):
                numel *= n
            size = 2 if w.source_dtype(name) in (torch.bfloat16, torch.float16) else 4
            total += numel * size // (1 if "norm" in name else tp)
    return total


@pytest.fixture(scope="module")
def more_families(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Phi-3 (HF-fused qkv_proj and gate_up_proj: a rank reads three/two ranges of one tensor), Qwen3 (q/k norms)."""
    root = tmp_path_factory.mktemp("sharded-more")
    return [sharded_tiny_model(root, f"{name}-bf16", "bfloat16", **FAMILY_TINY_MODELS[name]) for name in ("phi3", "qwen3")]


def test_a_tp2_rank_reads_only_its_slices_and_gets_the_full_conversions_shard(
    models: list[Path], more_families: list[Path]
) -> None:
    for model_dir in models + more_families:
        assert len(list(model_dir.glob("*.safetensors"))) > 2, "the fixture must be sharded"
        arch = model_arch(model_dir)
        full = hf_io.load_weights(model_dir)
        for rank in range(2):
            params, read = load_rank_params(model_dir, arch, rank, 2)
            expected = hf_to_mcore(full, arch, rank, 2)
            assert set(params) == set(expected)
            assert all(p.dtype == torch.float32 and torch.equal(p, expected[k]) for k, p in params.items())
            assert read["bytes_read"] == _expected_rank_bytes(model_dir, 2), (model_dir.name, read)
            assert read["bytes_read"] < 0.55 * read["stored_bytes"]


def _run(command: list[str]) -> list[dict]:
    proc = subprocess.run(command, env=mpi_env(), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _assert_parity(results: list[dict], models: list[Path], tp: int) -> None:
    assert [r["model"] for r in results] == [m.name for m in models]
    for r, model_dir in zip(results, models):
        assert r["tp"] == tp and r["max_diff"] <= TOLERANCE and r["packed_diff"] <= TOLERANCE, r
        assert r["roundtrip_exact"] is True, r
        assert [load["rank"] for load in r["loads"]] == list(range(tp))
        for load in r["loads"]:
            assert load["exact"] is True, r
            assert load["bytes_read"] == _expected_rank_bytes(model_dir, tp), r


def test_sharded_bf16_and_fp16_logits_match_hf_at_tp1(models: list[Path]) -> None:
    _assert_parity(_run([sys.executable, str(CHECK), "1", *map(str, models)]), models, tp=1)


@pytest.mark.slow
def test_sharded_logits_match_hf_at_tp2_and_each_rank_reads_half(models: list[Path]) -> None:
    require_mpirun()
    command = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(CHECK), "2", *map(str, models)]
    _assert_parity(_run(command), models, tp=2)


def test_a_split_the_loader_cannot_slice_falls_back_to_whole_tensors(models: list[Path]) -> None:
    """2 KV groups over 4 ranks do not split into whole groups: the loader reads whole tensors, same result."""
    model_dir = models[0]
    arch = model_arch(model_dir)
    params, read = load_rank_params(model_dir, arch, 1, 4)
    expected = hf_to_mcore(hf_io.load_weights(model_dir), arch, 1, 4)
    assert set(params) == set(expected) and all(torch.equal(params[k], expected[k]) for k in expected)
    assert read["bytes_read"] >= read["stored_bytes"]  # whole tensors (the tie check reads lm_head once more)
