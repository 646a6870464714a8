"""scripts/gpu_check.sh / bench/gpu_check.py: the GPU run (marked `gpu`, skipped without one), its clean skip
without CUDA, and its plumbing end to end on CPU (a tiny model; the figures mean nothing)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest
from deploy_files import REPO

SCRIPT = REPO / "scripts" / "gpu_check.sh"


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _run(args: list[str], timeout: float, **env: str) -> tuple[int, dict, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("SCALARLM_")}
    done = subprocess.run(args, capture_output=True, text=True, timeout=timeout, cwd=REPO, env=clean | env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return done.returncode, (json.loads(lines[-1]) if lines else {}), done.stdout[-2000:] + done.stderr[-4000:]


def test_model_is_qwen3_0_6b_shaped():
    spec = importlib.util.spec_from_file_location("gpu_check", REPO / "bench" / "gpu_check.py")
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)  # no torch import at module level: cheap
    facts = gpu_check.layout(gpu_check.QWEN3_0_6B)
    # Qwen3-0.6B: 0.44B in the layers + the tied 151936 x 1024 embedding as the LM head.
    assert 0.55e9 < facts["matmul_params"] < 0.65e9 and facts["layers"] == 28 and facts["attn_width"] == 2048


@pytest.mark.skipif(_has_cuda(), reason="this machine has a GPU: the gpu-marked test runs the check")
def test_without_cuda_the_check_skips_cleanly():
    code, report, out = _run(["bash", str(SCRIPT)], timeout=120, PYTHON=sys.executable)
    assert code == 0 and report == {"ok": False, "skipped": report.get("skipped")}, out
    assert "no CUDA device" in report["skipped"]
    code, report, out = _run([sys.executable, "-m", "bench.gpu_check"], timeout=120)
    assert code == 0 and report["ok"] is False and "no CUDA device" in report["skipped"], out


@pytest.mark.slow
def test_cpu_smoke_runs_the_whole_plumbing(tmp_path):
    args = [sys.executable, "-m", "bench.gpu_check", "--cpu-smoke", "--steps", "6", "--batch", "2",
            "--seq-len", "256", "--grpo-steps", "4", "--work", str(tmp_path)]  # fmt: skip
    code, report, out = _run(args, timeout=900)
    assert code == 0 and report["ok"], out
    assert report["scalarlm"]["optimizer"] == "torch-adamw"  # CPU: the GPU run needs megatron's
    assert set(report["scalarlm"]["publish_s"]) == {"3", "6"} and report["hf_trainer"]["tokens_per_s"] > 0
    resume = report["resume"]
    assert resume["stopped_status"] == "QUEUED" and resume["final_status"] == "COMPLETED"
    assert resume["max_loss_diff_vs_uninterrupted"] < 1e-4  # fp32 on CPU: the same curve
    grpo = report["grpo"]
    assert grpo["status"] == "COMPLETED" and grpo["steps"] == 4 and grpo["losses_finite"]
    # 2 groups of 8 rows per step, each row a quarter block of prompt and an eighth to half a block of completion
    assert 16 * (256 // 4 + 256 // 8) <= grpo["row_tokens_per_step"] <= 16 * (256 // 4 + 256 // 2 + 2)
    assert grpo["publish_s"] >= 0 and (tmp_path / "jobs" / "grpo" / "checkpoints" / "step-4").is_dir()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU (scripts/gpu_check.sh; see docs/gpu.md)")
def test_gpu_check_on_cuda():
    code, report, out = _run(["bash", str(SCRIPT)], timeout=900, PYTHON=sys.executable)
    assert code == 0 and report["ok"] and report["check"] == "gpu", out
    assert report["scalarlm"]["optimizer"] == "megatron-distributed"
    assert report["resume"]["steps_after_resume"] and report["total_s"] < 8 * 60
    assert report["grpo"]["losses_finite"] and report["grpo"]["steps"] == 10
