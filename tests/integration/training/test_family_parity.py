"""Every trainer family, proven equal to Hugging Face: one parametrized test over the FAMILIES registry.

For each tiny model of `FAMILY_TINY_MODELS` (one per family, plus variants): megatron-core logits equal
transformers' at TP=1 and TP=2 (mpirun, gloo) in fp32 (and every parameter's gradient at TP=1, where transformers
names its parameters as the checkpoint does), on a random batch, on packed documents, and on one 600-token
sequence (past the llama3 model's original context, far longer than Mistral's sliding window); a training step's
per-token cross-entropy, computed at the loss positions only, equals HF's on the packed documents; the TP-gathered
mcore -> HF export is bit-exact; in training mode both apply the same dropouts; the megatron LoRA forward equals PEFT
with the same adapter weights (on every family but the MoE ones and StableLM, whose LoRA is refused). Each TP size
runs all models in one process (or one mpirun), once per module.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from parity import forward_tolerance
from trainer_jobs import mpi_env, require_mpirun

from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS
from scalarlm.training.families import BY_NAME, FAMILY_LIST
from scalarlm.training.model import model_arch

HERE = Path(__file__).parent
MODELS = sorted(FAMILY_TINY_MODELS)
TPS = [1, pytest.param(2, marks=pytest.mark.slow)]
# transformers 5 holds these families' experts fused under names of its own, which the converter cannot map back
EXPERTS_FUSED_BY_TRANSFORMERS = {"qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "deepseek_v2", "olmoe",
                                 "granitemoe"}  # fmt: skip


def _command(tp: int, script: str, *args: str) -> list[str]:
    if tp == 1:
        return [sys.executable, str(HERE / script), "1", *args]
    require_mpirun()
    return ["mpirun", "-n", str(tp), "--oversubscribe", sys.executable, str(HERE / script), str(tp), *args]


def _results(command: list[str]) -> dict[str, dict]:
    proc = subprocess.run(command, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {row["model"]: row for row in rows}


@pytest.fixture(scope="module")
def logits(family_models: dict[str, Path]) -> dict[int, dict[str, dict]]:
    """Per TP size, computed on first use: convert_check.py's result for every model."""
    cache: dict[int, dict[str, dict]] = {}

    def get(tp: int) -> dict[str, dict]:
        if tp not in cache:
            cache[tp] = _results(_command(tp, "convert_check.py", *map(str, family_models.values())))
        return cache[tp]

    return get  # type: ignore[return-value]


@pytest.fixture(scope="module")
def lora(family_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    cache: dict[int, dict[str, dict]] = {}

    def get(tp: int) -> dict[str, dict]:
        if tp not in cache:
            out = tmp_path_factory.mktemp(f"adapters-tp{tp}")
            cache[tp] = _results(_command(tp, "lora_check.py", str(out), *map(str, family_models.values())))
        return cache[tp]

    return get


def test_every_family_has_a_tiny_model(family_models: dict[str, Path]) -> None:
    covered = {model_arch(path).family for path in family_models.values()}
    assert covered == {family.name for family in FAMILY_LIST}


# The dropouts a tiny model's checkpoint trains with, applied in one training-mode forward (its 2 layers): Seed-OSS's
# 0.1 on the attention probabilities and on both residual branches (none on the embeddings); StarCoder2's and
# GPT-NeoX's (`hidden_dropout`) also on the embeddings; phi-2's `resid_pdrop` on both branches.
DROPOUTS = {"seed-oss": {"attention 0.1": 2, "hidden 0.1": 4}, "starcoder2": {"attention 0.1": 2, "hidden 0.1": 5},
            "gpt-neox-sequential": {"attention 0.1": 2, "hidden 0.1": 5}, "phi": {"hidden 0.1": 4}}  # fmt: skip


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_logits_match_hf(logits, model: str, tp: int) -> None:
    r = logits(tp)[model]
    assert r["tp"] == tp
    if model == "gpt-oss" and tp > 1:  # megatron trains experts with biases only unsplit: refused by name
        assert "tensor_parallel_size 2 is not supported for gpt_oss" in r["refused"], r
        return
    assert "refused" not in r, r
    if tp == 1:  # every parameter's gradient = HF's: measured <= 3.9e-6 (Gemma) relative to the largest
        if FAMILY_TINY_MODELS[model]["family"] in EXPERTS_FUSED_BY_TRANSFORMERS:
            assert r["grad_diff"] is None, r  # (test_moe_parity checks their gradients its own ways)
        else:
            assert r["grad_diff"] <= 2e-5, r
            assert r["scalar_grad_diff"] is None or r["scalar_grad_diff"] <= 1e-4, r  # (summed over a layer)
    tolerance = forward_tolerance(r["logit_scale"])  # fp32; Gemma's logits are ~3x larger than Llama's
    assert r["max_diff"] <= tolerance, r
    assert r["packed_diff"] <= tolerance, r  # packed documents do not attend to each other
    assert r["long_diff"] <= tolerance, r
    assert r["roundtrip_exact"] is True, r
    # A training step's loss-position cross-entropy (the output layer on those 12 positions only) is HF's.
    assert r["loss_diff"] <= tolerance and r["loss_rows"] == 12, r
    if tp == 1:
        # In training mode each side applies the same dropouts (where, p, how many: `DROPOUTS`); the rest of the
        # families none, and nothing else differs from eval mode.
        assert r["dropout_ours"] == r["dropout_hf"], r
        if model in DROPOUTS:
            assert r["dropout_hf"] == DROPOUTS[model] and r["train_vs_eval"] > 0.1, r
        else:
            assert r["dropout_hf"] == {} and r["train_vs_eval"] == 0.0, r
    if model == "llama3":
        # megatron's own llama3 scaling (hard-coded low/high_freq_factor, 8192 context) differs at these positions
        assert r["builtin_rope_diff"] > 0.1, r


@pytest.mark.parametrize("tp", TPS)
@pytest.mark.parametrize("model", MODELS)
def test_lora_matches_peft(lora, family_models: dict[str, Path], model: str, tp: int) -> None:
    r = lora(tp)[model]
    assert r["tp"] == tp
    if BY_NAME[model_arch(family_models[model]).family].lora_refusal:  # by name: DeepSeek's latent attention
        assert "adapter_type 'lora' is not supported" in r["refused"], r
        return
    if model == "gpt-oss" and tp > 1:  # as its training (above)
        assert "tensor_parallel_size 2 is not supported for gpt_oss" in r["refused"], r
        return
    tolerance = forward_tolerance(r["logit_scale"])  # fp32; Gemma's logits are ~3x larger than Llama's
    assert r["max_diff"] <= tolerance, r
    assert r["base_diff"] <= tolerance, r  # adapters disabled = the base model (the KL reference)
    # the adapter really changes the logits, far beyond the bound (Granite's logits / 16 move the least: 0.029)
    assert r["lora_effect"] > 100 * tolerance, r
    if tp > 1:  # the adapters' gradients after the trainer's TP all-reduce = TP=1's (MoE: under sequence parallelism)
        one = lora(1)[model]["grad_norms"]
        assert r["grad_norms"].keys() == one.keys()
        assert all(r["grad_norms"][name] == pytest.approx(g, rel=1e-4) for name, g in one.items()), (r, one)
    if model.startswith("gpt-neox"):  # PEFT's names for its modules (vLLM's Transformers backend loads them)
        assert r["target_modules"] == ["query_key_value", "dense", "dense_h_to_4h", "dense_4h_to_h"], r
    elif model == "phi":
        assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "dense", "fc1", "fc2"], r
    elif model_arch(family_models[model]).fused_qkv:
        assert r["target_modules"] == ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"]  # what vLLM loads
    if model_arch(family_models[model]).num_experts:  # a mixture-of-experts model: its attention (EXPERT_LORA)
        assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"], r
    if model == "granite4":  # Granite 4.0's MLP modules, under their own names (what vLLM loads and PEFT wraps)
        assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "input_linear", "output_linear"], r
    # An ungated MLP's one input projection and its down projection: StarCoder2's c_fc and c_proj, Arcee's up_proj
    # and down_proj (the default targets' gate_proj has nothing to adapt there).
    if model == "starcoder2":
        assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "c_fc", "c_proj"], r
    if model == "arcee":
        assert r["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj", "down_proj"], r
