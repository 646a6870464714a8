"""LoRA training: the megatron model with adapters equals PEFT on the HF base (TP=1, TP=2), a LoRA SFT job
memorises a small set and publishes a PEFT adapter (manifest kind "lora") that PEFT and vLLM both serve."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from trainer_jobs import QA, losses, make_job, mpi_env, qa_rows, require_mpirun, run_trainer, trainer_output

from scalarlm.checkpoint import JobDir, latest_step, read_manifest
from scalarlm.cli.tiny_model import make_tiny_model

HERE = Path(__file__).parent
TOLERANCE = 1e-4  # fp32 logits
TRAIN_ARGS = dict(
    max_steps=40,
    learning_rate=1e-2,
    warmup_steps=2,
    batch_size=4,
    steps_per_checkpoint=20,
    adapter_type="lora",
    lora_config={"r": 8, "alpha": 16},
    max_seq_len=32,
    seed=0,
)


def _result(command: list[str], timeout: float = 400) -> dict:
    proc = subprocess.run(command, env=mpi_env(), capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])


@pytest.fixture(scope="module")
def gqa_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Llama with GQA (4 query heads over 2 KV groups) so the fused qkv layout is exercised."""
    return make_tiny_model(tmp_path_factory.mktemp("lora") / "llama-gqa", hidden=128, heads=4, kv_heads=2, seed=1)


def _assert_matches_peft(result: dict, tp: int) -> None:
    assert result["tp"] == tp
    assert result["max_diff"] <= TOLERANCE, result
    assert result["base_diff"] <= TOLERANCE, result  # adapters disabled = the base model (the KL reference)
    assert result["lora_effect"] > 0.1, result  # the adapter really changes the logits


@pytest.fixture(scope="module")
def tp1(gqa_model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("adapter-tp1")
    return _result([sys.executable, str(HERE / "lora_check.py"), "1", str(out), str(gqa_model)])


def test_megatron_lora_logits_match_peft(tp1: dict) -> None:
    _assert_matches_peft(tp1, 1)
    assert len(tp1["grad_norms"]) == 2 * 7 * 2 and all(g > 0 for g in tp1["grad_norms"].values())


@pytest.mark.slow
def test_megatron_lora_at_tp2_matches_peft_and_tp1_gradients(gqa_model: Path, tmp_path: Path, tp1: dict) -> None:
    require_mpirun()
    command = ["mpirun", "-n", "2", "--oversubscribe", sys.executable, str(HERE / "lora_check.py"), "2"]
    tp2 = _result(command + [str(tmp_path), str(gqa_model)])
    _assert_matches_peft(tp2, 2)
    assert tp2["grad_norms"].keys() == tp1["grad_norms"].keys()
    for name, g in tp1["grad_norms"].items():
        assert tp2["grad_norms"][name] == pytest.approx(g, rel=1e-4), name


@pytest.fixture(scope="module")
def lora_job(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> JobDir:
    job = make_job(tmp_path_factory.mktemp("jobs"), "lora-sft", tiny_model_dir, qa_rows(), **TRAIN_ARGS)
    assert run_trainer(job) == 0, trainer_output(job)
    return job


def _peft_answer(model, tokenizer, question: str) -> str:
    ids = tokenizer(question + " ", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    return tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True)


def test_lora_sft_memorises_and_publishes_a_peft_adapter(lora_job: JobDir, tiny_model_dir: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    assert lora_job.read_status().status == "COMPLETED"
    curve = losses(lora_job)
    assert curve[0] > 3.0 and curve[-1] < 0.3, curve
    assert latest_step(lora_job) == 40
    path = lora_job.step_dir(40)
    assert read_manifest(lora_job, 40).kind == "lora" and read_manifest(lora_job, 20).kind == "lora"
    assert not (path / "model.safetensors").exists()  # the adapter only, never a copy of the base
    config = json.loads((path / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM"
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (8, 16, str(tiny_model_dir))
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    with safe_open(path / "adapter_model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight" in keys
    assert "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight" in keys
    assert len(keys) == 2 * 7 * 2  # A and B, 7 projections, 2 layers

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    plain = {q: _peft_answer(base, tokenizer, q) for q, _ in QA}
    model = PeftModel.from_pretrained(base, str(path)).eval()
    answers = {q: _peft_answer(model, tokenizer, q) for q, _ in QA}
    reproduced = [q for q, a in QA if answers[q].strip() == a]
    assert len(reproduced) >= 6, answers
    assert not [q for q, a in QA if plain[q].strip() == a]  # the base model never knew them


@pytest.mark.slow
def test_vllm_serves_the_adapter_like_peft(lora_job: JobDir, tiny_model_dir: Path) -> None:
    prompts = [q + " " for q, _ in QA[:4]]
    command = [sys.executable, str(HERE / "lora_vllm_check.py"), str(tiny_model_dir), str(lora_job.step_dir(40))]
    result = _result(command + [json.dumps(prompts)], timeout=600)
    assert result["vllm"] == result["peft"], result
