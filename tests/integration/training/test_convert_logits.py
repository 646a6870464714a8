"""HF <-> megatron-core converter on real models: logits match transformers at TP=1 and TP=2 (mpirun), packed
documents do not attend to each other, and the TP-gathered mcore -> HF export is bit-exact."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_jobs import mpi_env, require_mpirun

from scalarlm.cli.tiny_model import make_tiny_model

CHECK = Path(__file__).with_name("convert_check.py")
TOLERANCE = 1e-4  # fp32 logits


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Llama with GQA (4 query heads over 2 KV groups, untied) and Qwen2 (qkv bias, tied embeddings)."""
    root = tmp_path_factory.mktemp("convert")
    return [
        make_tiny_model(root / "llama-gqa", family="llama", hidden=128, heads=4, kv_heads=2, seed=1),
        make_tiny_model(root / "qwen2-tied", family="qwen2", hidden=128, heads=2, kv_heads=2, tie_embeddings=True),
    ]


def _run(command: list[str]) -> list[dict]:
    proc = subprocess.run(command, env=mpi_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


def _assert_matches(results: list[dict], tp: int) -> None:
    assert [r["model"] for r in results] == ["llama-gqa", "qwen2-tied"]
    for r in results:
        assert r["tp"] == tp
        assert r["max_diff"] <= TOLERANCE, r
        assert r["packed_diff"] <= TOLERANCE, r
        assert r["roundtrip_exact"] is True, r


def test_logits_match_hf_at_tp1(models: list[Path]) -> None:
    _assert_matches(_run([sys.executable, str(CHECK), "1", *map(str, models)]), tp=1)


@pytest.mark.slow
def test_logits_match_hf_at_tp2_under_mpirun(models: list[Path]) -> None:
    require_mpirun()
    command = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(CHECK), "2", *map(str, models)]
    _assert_matches(_run(command), tp=2)
