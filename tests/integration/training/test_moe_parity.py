"""Mixture-of-experts families proven equal to Hugging Face layer by layer (moe_check.py, one process per layout:
TP=1, TP=2, and EP=2, where each rank holds and reads only half the experts and runs its own batch).

On each MoE tiny model of `FAMILY_TINY_MODELS` (Qwen3-MoE with renormalised top-k, Qwen3-MoE with plain top-k and a
dense layer between sparse ones, Qwen2-MoE, Mixtral, GLM-4.5 with sigmoid group-limited routing, Granite 3 MoE with its
experts stacked in two tensors per layer, read one expert's slice at a time): megatron's fp32 router
logits, the experts it chooses for every token, the routing probabilities, each MoE block's output and the whole-model
logits equal transformers' in fp32. Whole-model logits on packed documents and long sequences, and the bit-exact HF ->
mcore -> HF round trip, are in test_family_parity.py (the same tiny models). Also here: real SFT jobs at one rank, DP=2
and EP=2; the load-balancing loss (metric = NumPy, gradient = the written-out objective, EP=2 = DP=2); routing replay
(replayed layers = float64 on the recorded experts) and GRPO over several steps per batch with it off and on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from parity import FIRST_STEP, assert_same_curve
from trainer_jobs import mpi_env, require_mpirun

from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS

HERE = Path(__file__).parent
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "deepseek_v3", "deepseek_v2", "olmoe",
                "granitemoe", "gpt_oss")  # fmt: skip
MOE_MODELS = sorted(name for name, spec in FAMILY_TINY_MODELS.items() if spec["family"] in MOE_FAMILIES)
TOLERANCE = 1e-5  # fp32 against float64 or NumPy
# fp32 router logits, probabilities, layer outputs and logits (values up to ~7) against transformers': measured
# <= 5.3e-6; the rounding differs by up to 2x between CPUs (parity.py)
FORWARD_TOLERANCE = 3e-5
LAYOUTS = [(1, 1), pytest.param((2, 1), marks=pytest.mark.slow, id="tp2"),
           pytest.param((1, 2), marks=pytest.mark.slow, id="ep2")]  # (TP, EP)


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from scalarlm.cli.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp("moe")
    return {name: make_tiny_model(root / name, **FAMILY_TINY_MODELS[name]) for name in MOE_MODELS}


def run_check(script: str, args: list[str], ranks: int) -> subprocess.CompletedProcess:
    """Run a check script of this folder as one plain process, or under `mpirun -n ranks`; it must succeed."""
    command = [sys.executable, str(HERE / script), *args]
    if ranks > 1:
        require_mpirun()
        command = ["mpirun", "-n", str(ranks), "--oversubscribe", *command]
    proc = subprocess.run(command, env=mpi_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def result_rows(proc: subprocess.CompletedProcess) -> list[dict]:
    """The `RESULT <json>` lines a check script printed."""
    return [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]


@pytest.fixture(scope="module")
def results(moe_models: dict[str, Path]):
    cache: dict[tuple[int, int], dict[str, dict]] = {}

    def get(layout: tuple[int, int]) -> dict[str, dict]:
        if layout not in cache:
            tp, ep = layout
            proc = run_check("moe_check.py", [str(tp), str(ep), *map(str, moe_models.values())], tp * ep)
            cache[layout] = {row["model"]: row for row in result_rows(proc)}
        return cache[layout]

    return get


def test_the_moe_tiny_models_cover_every_moe_family_and_every_routing() -> None:
    assert MOE_MODELS == ["deepseek-v2-lite", "deepseek-v3", "glm4-moe", "gpt-oss", "granite-moe", "mixtral",
                          "moonlight", "olmoe", "qwen2-moe", "qwen3-moe", "qwen3-moe-mixed"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("model", MOE_MODELS)
def test_router_experts_and_layers_match_hf(results, model: str, layout: tuple[int, int]) -> None:
    r = results(layout)[model]
    if model == "gpt-oss" and layout[0] > 1:  # megatron trains experts with biases only unsplit: refused by name
        assert "tensor_parallel_size 2 is not supported for gpt_oss" in r["refused"], r
        return
    assert (r["tp"], r["ep"]) == layout and r["moe_layers"] == 2, r  # qwen3-moe-mixed: layers 0 and 2 sparse, 1 dense
    assert r["local_experts"] == 4 // layout[1], r
    if layout == (1, 2):  # a rank reads the shared weights and its own experts, not the other rank's
        assert r["read_fraction"] < 0.9, r
    if layout[1] > 1:  # the expert group's longest micro-batch is asked once per forward pass, not once per MoE layer
        assert r["length_syncs"] == 1, r
    assert r["experts_equal"] is True, r
    assert r["router_logit_diff"] <= FORWARD_TOLERANCE, r
    assert r["prob_diff"] <= FORWARD_TOLERANCE, r
    # block outputs reach 35 on GPT-OSS (its expert biases): the bound scales past the others' ~7
    assert r["layer_diff"] <= FORWARD_TOLERANCE * max(1.0, r["layer_scale"] / 7), r
    assert r["logit_diff"] <= FORWARD_TOLERANCE, r


def test_full_sft_job_trains_router_and_experts_and_publishes_the_hub_layout(moe_models: dict[str, Path],
                                                                             tmp_path: Path) -> None:  # fmt: skip
    """A real trainer process (full weights, 4 steps) on tiny Qwen3-MoE: the published checkpoint holds exactly the
    base's per-expert tensor names, router and every expert moved, and `transformers` opens it."""
    import torch
    from safetensors.torch import load_file
    from trainer_jobs import losses, make_job, qa_rows, run_trainer, trainer_output
    from transformers import AutoModelForCausalLM

    base = moe_models["qwen3-moe"]
    job = make_job(tmp_path, "moe-sft", base, qa_rows(), max_steps=4, learning_rate=1e-2, steps_per_checkpoint=4,
                   max_seq_len=64, dtype="float32", adapter_type="full")  # fmt: skip
    assert run_trainer(job, 1, timeout=300) == 0, trainer_output(job)[-3000:]
    curve = losses(job)
    assert len(curve) == 4 and all(torch.isfinite(torch.tensor(curve))) and curve[-1] < curve[0], curve
    step = job.step_dir(4)
    before, after = load_file(base / "model.safetensors"), load_file(step / "model.safetensors")
    assert set(after) == set(before)  # the hub's per-expert layout, nothing added or dropped
    for layer in range(2):
        assert not torch.equal(after[f"model.layers.{layer}.mlp.gate.weight"], before[f"model.layers.{layer}.mlp.gate.weight"])
        for e in range(4):
            for proj in ("gate_proj", "up_proj", "down_proj"):
                name = f"model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
                assert not torch.equal(after[name], before[name]), name  # every expert got tokens and was trained
    reloaded = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32)
    assert type(reloaded).__name__ == "Qwen3MoeForCausalLM"


# Full SFT on tiny Qwen3-MoE, the same global batch of 4 blocks per step: one rank (the reference), two data-parallel
# ranks (experts replicated, their grads summed over DP) and two expert-parallel ranks (two experts each, tokens
# dispatched between the ranks, the dense layers data parallel).
MOE_SFT = dict(max_steps=4, learning_rate=3e-3, lr_schedule="constant", batch_size=4, adapter_type="full",
               max_seq_len=32, seed=0, steps_per_checkpoint=4, dtype="float32")  # fmt: skip
MOE_LAYOUTS = {"dp2": dict(cpu_ranks=2, batch_size=2), "ep2": dict(cpu_ranks=2, batch_size=2, expert_parallel_size=2),
               # sequence parallel: each TP rank routes half of every micro-batch's tokens to TP-sharded experts
               "tp2": dict(cpu_ranks=2, tensor_parallel_size=2, batch_size=2, gradient_accumulation_steps=2)}
# The layouts change only the order of fp32 sums: curves follow each other to parity.py's per-step bounds.
# Weights after 4 Adam steps: Adam's normalised update turns the rounding of a few near-zero grads into visible moves
# of up to ~lr per step each (measured, lr 3e-3: the worst element 5.6e-5 at DP=2 and 1.1e-4 at TP=2 on one machine,
# 3.3e-4 at TP=2 on another; 3, 8 and 19 elements of 1.4M beyond 3e-5). So one element may differ by up to one
# step's move (lr), and the count is what tells a bug: a wrong reduction or a misplaced expert moves whole tensors
# (thousands of elements) by ~lr per step. The count follows the CPU's rounding (parity.py), so it has room for 5x
# the most elements measured.
WEIGHT_TOLERANCE = MOE_SFT["learning_rate"]
MOVED = 3e-5  # at most MAX_MOVED elements differ by more
MAX_MOVED = 100


@pytest.fixture(scope="module")
def moe_sft_ref(moe_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    from trainer_jobs import make_job, qa_rows, run_trainer, trainer_output

    job = make_job(tmp_path_factory.mktemp("moe-ref"), "moe-ref", moe_models["qwen3-moe"], qa_rows(), **MOE_SFT)
    assert run_trainer(job, 1, timeout=600) == 0, trainer_output(job)[-3000:]
    return job


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(MOE_LAYOUTS))
def test_two_rank_moe_sft_matches_one_rank_and_publishes_the_same_weights(moe_models: dict[str, Path], moe_sft_ref,
                                                                          layout: str, tmp_path: Path) -> None:  # fmt: skip
    from safetensors.torch import load_file
    from trainer_jobs import make_job, qa_rows, run_trainer, trainer_output

    require_mpirun()
    job = make_job(tmp_path, f"moe-{layout}", moe_models["qwen3-moe"], qa_rows(), **{**MOE_SFT, **MOE_LAYOUTS[layout]})
    assert run_trainer(job, 2, timeout=600) == 0, trainer_output(job)[-3000:]
    ours, ref = job.read_metrics(), moe_sft_ref.read_metrics()
    assert len(ref) == 4
    assert_same_curve(ours, ref, ("loss", "grad_norm"))
    # The published step holds every expert (gathered from both ranks under EP), equal to the one-rank job's.
    published = load_file(job.step_dir(4) / "model.safetensors")
    expected = load_file(moe_sft_ref.step_dir(4) / "model.safetensors")
    assert set(published) == set(expected)
    worst = max((published[n] - expected[n]).abs().max().item() for n in expected)
    moved = sum(int(((published[n] - expected[n]).abs() > MOVED).sum()) for n in expected)
    assert worst <= WEIGHT_TOLERANCE and moved <= MAX_MOVED, (layout, worst, moved)
    print(f"{layout}: max weight difference {worst:.2e}, {moved} elements beyond {MOVED:g}")


def test_load_balancing_loss_equals_numpy_and_its_gradient_the_written_out_objective(moe_models: dict[str, Path]) -> None:
    """moe_aux_check.py on every MoE tiny model: the metric equals NumPy's loss from transformers' router logits; the
    gradient of megatron's aux loss (as the step driver weighs it) equals autograd of the objective written out."""
    rows = result_rows(run_check("moe_aux_check.py", list(map(str, moe_models.values())), 1))
    assert sorted(r["model"] for r in rows) == MOE_MODELS
    for r in rows:
        assert r["tokens"] == 40 and abs(r["metric"] - r["numpy"]) <= TOLERANCE, r
        assert r["aux_grad"] > 1e-3, r  # the aux loss moves the gradient ...
        assert r["grad_diff"] <= 1e-6, r  # ... exactly as the written-out objective does


def test_sequence_parallel_moe_gradients_at_tp2_equal_tp1(moe_models: dict[str, Path], tmp_path: Path) -> None:
    """moe_sp_check.py at TP=1 and at TP=2 (sequence parallel; a 41-token micro-batch runs padded to 42): with the
    load-balancing loss on, every gradient (router, experts, norms, attention, embedding), the cross-entropy and the
    load-balancing metric equal TP=1's. Before the padding mask went with every micro-batch, megatron weighed each
    rank's aux loss by its own half of the tokens: router grads 4e-3 off at 40 tokens."""
    import torch

    split = [path for name, path in moe_models.items() if name != "gpt-oss"]  # GPT-OSS refuses TP=2 (its biases)
    outs = {}
    for tp in (1, 2):
        outs[tp] = tmp_path / f"tp{tp}"
        outs[tp].mkdir()
        run_check("moe_sp_check.py", [str(tp), str(outs[tp]), *map(str, split)], tp)
    files = sorted(p.name for p in outs[1].iterdir())
    assert files == sorted(p.name for p in outs[2].iterdir()) and len(files) == 2 * len(MOE_MODELS) - 2
    for name in files:
        one, two = torch.load(outs[1] / name), torch.load(outs[2] / name)
        assert set(one["grads"]) == set(two["grads"])
        worst = max((one["grads"][n] - two["grads"][n]).abs().max().item() for n in one["grads"])
        # measured <= 4.7e-7 (grads up to 0.44), 1.4e-6 on DeepSeek-V3's embedding (grads up to 0.64, the 512-wide kv
        # latent); the shared rotated key's gradient summed over one rank's heads only was 0.16 off
        assert worst <= 3e-6, (name, worst)
        assert abs(one["ce"] - two["ce"]) <= 1e-4 and one["tokens"] == two["tokens"], (name, one["ce"], two["ce"])
        assert abs(one["metric"] - two["metric"]) <= 1e-6, (name, one["metric"], two["metric"])


AUX = dict(MOE_SFT, cpu_ranks=2, batch_size=2, moe_aux_loss_coef=0.1)


@pytest.mark.slow
def test_aux_loss_trains_the_same_at_ep2_as_at_dp2_and_is_reported(moe_models: dict[str, Path], moe_sft_ref,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    """`moe_aux_loss_coef` in real 2-rank trainers: the EP=2 run (tokens dispatched across ranks, its padding masked
    out of the loss), the TP=2 run (sequence parallel; also with activation recompute) and the TP=2 x EP=2 run (with
    recompute: a recomputed MoE layer pads to the length its forward pass asked the group for) follow the DP=2 run's curve, grad norm and load-balancing loss; the aux term changes the
    gradient (not the reported cross-entropy) against the coefficient-0 reference, which reports the metric too."""
    from trainer_jobs import make_job, qa_rows, run_trainer, trainer_output

    require_mpirun()
    runs = {}
    # TP=2 takes the DP=2 ranks' micro-batches one after the other: the same partition of the tokens, so the same
    # load-balancing loss; sequence parallel, each TP rank measures and weighs its share of each micro-batch.
    # TP=2 x EP=2 (4 ranks): each DP rank's micro-batch split over its two TP ranks, its tokens dispatched to the
    # experts over all four (TP-sharded experts, two per EP rank).
    for name, extra in (("dp2", {}), ("ep2", {"expert_parallel_size": 2}),
                        ("tp2", {"tensor_parallel_size": 2, "gradient_accumulation_steps": 2}),
                        ("tp2-recompute", {"tensor_parallel_size": 2, "gradient_accumulation_steps": 2,
                                           "gradient_checkpointing": True}),
                        ("tp2ep2", {"tensor_parallel_size": 2, "expert_parallel_size": 2, "cpu_ranks": 4,
                                    "gradient_checkpointing": True})):
        job = make_job(tmp_path, f"aux-{name}", moe_models["qwen3-moe"], qa_rows(), **{**AUX, **extra})
        assert run_trainer(job, job.read_config().train_args.cpu_ranks, timeout=600) == 0, trainer_output(job)[-3000:]
        runs[name] = job.read_metrics()
    dp, ep, ref = runs["dp2"], runs["ep2"], moe_sft_ref.read_metrics()
    assert len(dp) == 4
    for other in (ep, runs["tp2"], runs["tp2-recompute"], runs["tp2ep2"]):
        assert_same_curve(other, dp, ("loss", "grad_norm", "moe_load_balancing_loss"))
    assert abs(dp[0]["loss"] - ref[0]["loss"]) <= FIRST_STEP, (dp[0], ref[0])  # same weights, same tokens
    assert abs(dp[0]["grad_norm"] - ref[0]["grad_norm"]) > 1e-3 * ref[0]["grad_norm"], (dp[0], ref[0])
    assert all(r["moe_load_balancing_loss"] > 0 for r in ref + dp)
    print("load balancing (coef 0 / 0.1):", [round(r["moe_load_balancing_loss"], 4) for r in ref],
          [round(r["moe_load_balancing_loss"], 4) for r in dp])


def test_routing_replay_runs_each_moe_layer_on_the_recorded_experts(moe_models: dict[str, Path]) -> None:
    """moe_replay_check.py on every MoE tiny model: after the routers move (so that most tokens would choose other
    experts), a replayed forward's MoE layers equal the layer computed in float64 on the first pass's experts with the
    moved router's probabilities; without replay the outputs differ, and the changed choices are counted."""
    rows = result_rows(run_check("moe_replay_check.py", list(map(str, moe_models.values())), 1))
    assert sorted(r["model"] for r in rows) == MOE_MODELS
    for r in rows:
        # measured <= 2.1e-6 (fp32 against float64); 2.6e-5 on GPT-OSS, whose outputs reach 34 (its clamped
        # activations reach 56): the bound grows with the outputs past 3.5 (GPT-OSS's: 9.8e-5)
        assert r["replay_diff"] <= TOLERANCE * max(1.0, r["replay_scale"] / 3.5), r
        assert r["replay_effect"] > 0.1, r  # the replay decides which experts run
        assert 0.2 < r["changed_fraction"] < 1 and 0 < r["changed_fraction_replayed"] < 1, r
        # GLM-4.5's fixed expert bias stays fp32 under bf16 (the others have none)
        assert r["bf16_bias_exact"] is (True if r["model"] in ("deepseek-v3", "glm4-moe", "moonlight") else None), r


def grpo_rows() -> list[dict]:
    rows = []
    for i, prompt in enumerate(["2+2=", "3+3=", "1+4=", "5+1=", "2+5=", "4+4="]):
        rows += [{"prompt": prompt, "completion": " yes", "reward": 1.0 + i % 2},
                 {"prompt": prompt, "completion": " no way", "reward": 0.0},
                 {"prompt": prompt, "completion": " maybe so", "reward": 0.5}]  # fmt: skip
    return rows


MU = dict(loss="grpo", num_iterations=3, max_steps=6, batch_size=3, learning_rate=2e-2, lr_schedule="constant",
          adapter_type="full", dtype="float32", steps_per_checkpoint=6, shuffle=False, max_seq_len=32)  # fmt: skip


def test_tinker_forward_backward_weighs_the_balance_loss_the_same_after_a_grpo_step(moe_models: dict[str, Path],
                                                                                 tmp_path: Path) -> None:  # fmt: skip
    """A session on a MoE model with a trained load-balancing loss: Tinker's forward_backward gives the same router
    gradient before and after an ordinary GRPO step of the session (learning rate 1e-12). The step left megatron's
    aux-loss backward scale at 1 / its tokens, which forward_backward inherited (router gradient norm 56.9 vs 54.8)."""
    from scalarlm.checkpoint import JobDir
    from scalarlm.checkpoint.session import SessionDir
    from scalarlm.protocol.training import TrainArgs, TrainJobConfig

    job = JobDir(tmp_path / "tinker-aux")
    job.create()
    args = TrainArgs(loss="grpo", adapter_type="full", learning_rate=1e-12, lr_schedule="constant", max_seq_len=32,
                     moe_aux_loss_coef=0.1, batch_size=3)  # fmt: skip
    job.write_config(TrainJobConfig(job_id="tinker-aux", base_model=str(moe_models["qwen3-moe"]), train_args=args,
                                    session=True))  # fmt: skip
    job.dataset_path.write_text("")
    SessionDir(job).create()
    script = Path(__file__).with_name("tinker_aux_check.py")
    proc = subprocess.run([sys.executable, str(script), str(job.root)], env={**mpi_env(), "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["router_grad"] > 1 and result["max_diff"] < 1e-6, result


def test_the_lora_kl_reference_routes_on_its_own_under_replay_and_recompute(moe_models: dict[str, Path],
                                                                           tmp_path: Path) -> None:  # fmt: skip
    """LoRA GRPO on tiny Qwen3-MoE with a KL term, routing replay and activation recompute: the KL reference (the same
    model, adapters off) is the frozen base routing on its own choices, so a batch's reference is identical on all
    its passes. It used to route on the policy's replayed experts on the later passes (up to 3 nats per token
    apart, measured), and with recompute it emptied the replay list the backward needed (the job failed)."""
    from trainer_jobs import make_job

    args = {**MU, "adapter_type": "lora", "lora_config": {"r": 4, "alpha": 8}, "learning_rate": 5e-2,
            "num_iterations": 2, "kl_coef": 0.05, "routing_replay": True, "gradient_checkpointing": True}
    job = make_job(tmp_path, "lora-kl-replay", moe_models["qwen3-moe"], grpo_rows(), **args)
    script = Path(__file__).with_name("replay_reference_check.py")
    proc = subprocess.run([sys.executable, str(script), str(job.root)], env=mpi_env(), capture_output=True, text=True,
                          timeout=600)  # fmt: skip
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(lines[0][len("RESULT ") :])
    assert result["status"] == "COMPLETED" and result["steps"] == [1, 2, 3, 4, 5, 6], result
    assert result["compared"] >= 3 and result["max_pass_diff"] == 0.0, result


@pytest.mark.slow
def test_grpo_steps_over_one_batch_record_compare_and_replay_the_routing(moe_models: dict[str, Path],
                                                                         tmp_path: Path) -> None:  # fmt: skip
    """GRPO with num_iterations 3 on tiny Qwen3-MoE, routing replay off and on (real trainer processes): three steps
    per batch of groups; the first step of a batch is the same in both runs; the later steps report the fraction of
    tokens whose experts changed since it; where they changed, replay trains differently, where not, identically."""
    from trainer_jobs import make_job, run_trainer, trainer_output

    runs = {}
    for replay in (False, True):
        job = make_job(tmp_path, f"mu-{replay}", moe_models["qwen3-moe"], grpo_rows(), routing_replay=replay, **MU)
        assert run_trainer(job, 1, timeout=600) == 0, trainer_output(job)[-3000:]
        assert job.read_status().status == "COMPLETED"
        runs[replay] = job.read_metrics()
    off, on = runs[False], runs[True]
    for rows in (off, on):
        assert [r["batch_step"] for r in rows] == [1, 2, 3, 1, 2, 3]
        assert [r["groups"] for r in rows] == [3] * 6
        assert rows[0]["reward_mean"] == rows[1]["reward_mean"] == rows[2]["reward_mean"]  # one batch, three steps
        assert all("moe_routing_changed_fraction" not in r for r in rows[::3])  # a first pass compares with nothing
        assert all(0 <= r["moe_routing_changed_fraction"] <= 1 for i, r in enumerate(rows) if i % 3)
        assert all(r["moe_load_balancing_loss"] > 0 for r in rows)
        # no load-balancing loss trained (the default): each group's prompt is computed once, as on a dense model
        assert all(r["prompt_tokens_shared"] > 0 for r in rows)
    assert off[0]["loss"] == on[0]["loss"] and off[0]["grad_norm"] == on[0]["grad_norm"]
    assert any(r["moe_routing_changed_fraction"] > 0 for i, r in enumerate(off) if i % 3), off  # the routers moved
    moved = off[1]["moe_routing_changed_fraction"] > 0
    assert (abs(off[1]["grad_norm"] - on[1]["grad_norm"]) > 1e-6 * off[1]["grad_norm"]) == moved, (off[1], on[1])
    print("changed fraction off / on:", [r.get("moe_routing_changed_fraction") for r in off],
          [r.get("moe_routing_changed_fraction") for r in on])


def uneven_grpo_rows() -> list[dict]:
    """9 groups of a short answer and a long one (about one 64-token block each): DP rank 0 gets every short answer
    (1 block), rank 1 every long one (9 blocks: 2 micro-batches of at most 8), so at EP=2 rank 0 runs a filler."""
    rows = []
    for i in range(9):
        prompt = f"{i}="
        rows += [{"prompt": prompt, "completion": " y", "reward": 0.0},
                 {"prompt": prompt, "completion": " x" * 50, "reward": 1.0}]  # fmt: skip
    return rows


EP_GRPO = dict(MU, num_iterations=2, max_steps=2, batch_size=3, gradient_accumulation_steps=3, max_seq_len=64, routing_replay=True,
               moe_aux_loss_coef=0.1, cpu_ranks=2)  # fmt: skip


@pytest.mark.slow
def test_grpo_at_ep2_trains_as_dp2_with_uneven_ranks_aux_loss_and_routing_replay(moe_models: dict[str, Path],
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """GRPO at expert_parallel_size 2 (real 2-rank trainers): the ranks' shares pack into 2 and 1 micro-batches, so
    the short rank (0: the one that logs) runs a filler to keep the expert group's dispatcher in step. Loss, grad norm, load-balancing loss
    and the replayed batch's routing-changed fraction equal DP=2's, step by step."""
    from trainer_jobs import make_job, run_trainer, trainer_output

    require_mpirun()
    runs, logs = {}, {}
    for name, extra in (("dp2", {}), ("ep2", {"expert_parallel_size": 2})):
        job = make_job(tmp_path, f"grpo-{name}", moe_models["qwen3-moe"], uneven_grpo_rows(), **EP_GRPO, **extra)
        assert run_trainer(job, 2, timeout=600) == 0, trainer_output(job)[-3000:]
        assert job.read_status().status == "COMPLETED"
        runs[name] = job.read_metrics()
        logs[name] = "\n".join(p.read_text() for p in sorted((job.root / "logs").glob("rank-*.log")))
    dp, ep = runs["dp2"], runs["ep2"]
    assert "1 filler micro-batch(es) on DP rank 0 (2 micro-batches on every rank)" in logs["ep2"], logs["ep2"][-3000:]
    assert "filler" not in logs["dp2"]
    assert len(dp) == 2 and [r["batch_step"] for r in ep] == [1, 2] and ep[0]["groups"] == 9
    assert_same_curve(ep, dp, ("loss", "grad_norm", "moe_load_balancing_loss", "loss_tokens"))
    assert abs(ep[1]["moe_routing_changed_fraction"] - dp[1]["moe_routing_changed_fraction"]) <= 1e-9, (ep, dp)
    assert ep[0]["grad_norm"] > 0 and ep[1]["loss"] != ep[0]["loss"]
    assert all(r["prompt_tokens_shared"] == 0 for r in ep + dp)  # a trained load-balancing loss reads every row


@pytest.mark.slow
def test_grpo_at_ep2_without_a_balance_loss_shares_prompts_and_skips_rows_as_dp2(moe_models: dict[str, Path],
                                                                                tmp_path: Path) -> None:  # fmt: skip
    """GRPO at expert_parallel_size 2 with no load-balancing loss trained (the default): each group's prompt is
    computed once and the groups whose rows scored alike are left out, the ranks taking whole groups; loss, grad norm,
    load-balancing metric, loss tokens and routing replay equal DP=2's, step by step. A batch whose every group
    scored alike computes nothing: no load-balancing figure (nothing was routed), the other ranks' experts idle."""
    from trainer_jobs import make_job, run_trainer, trainer_output

    require_mpirun()
    alike = [{"prompt": f"Say {i} twice: ", "completion": c, "reward": 1.0} for i in range(12) for c in (" a", " b b")]
    spread = [{"prompt": f"What is {i} plus zero? ", "completion": c, "reward": r}
              for i in range(6) for c, r in ((" y", 0.0), (" x" * (5 + 3 * i), 1.0))]  # fmt: skip
    args = dict(EP_GRPO, moe_aux_loss_coef=0.0, max_steps=4)
    runs = {}
    for name, extra in (("dp2", {}), ("ep2", {"expert_parallel_size": 2})):
        job = make_job(tmp_path, f"grpo-{name}", moe_models["qwen3-moe"], alike[:6] + spread + alike[6:], **args,
                       **extra)  # fmt: skip
        assert run_trainer(job, 2, timeout=600) == 0, trainer_output(job)[-3000:]
        runs[name] = job.read_metrics()
    dp, ep = runs["dp2"], runs["ep2"]
    assert len(ep) == 4 and [r["groups"] for r in ep] == [9] * 4  # 3 alike groups and 6 others, then 9 alike
    assert_same_curve(ep[:2], dp[:2], ("loss", "grad_norm", "moe_load_balancing_loss", "loss_tokens"))
    assert abs(ep[1]["moe_routing_changed_fraction"] - dp[1]["moe_routing_changed_fraction"]) <= 1e-9, (ep, dp)
    assert all(r["rows_skipped"] == 6 and r["prompt_tokens_shared"] > 0 for r in ep[:2] + dp[:2]), ep
    assert ep[0]["grad_norm"] > 0 and ep[0]["moe_load_balancing_loss"] > 0
    for r in ep[2:] + dp[2:]:  # every row of the second batch left out
        assert r["rows_skipped"] == 18 and r["grad_norm"] == 0 and "moe_load_balancing_loss" not in r, r


@pytest.mark.slow
def test_grpo_at_tp2_trains_as_one_rank_with_aux_loss_and_routing_replay(moe_models: dict[str, Path],
                                                                         tmp_path: Path) -> None:  # fmt: skip
    """GRPO at tensor_parallel_size 2 (sequence parallel: each TP rank routes, measures and replays its half of every
    micro-batch's tokens): loss, grad norm, load-balancing loss and the replayed batch's routing-changed fraction
    (summed over both ranks' tokens) equal the one-rank job's, step by step."""
    from trainer_jobs import make_job, run_trainer, trainer_output

    require_mpirun()
    runs = {}
    for name, ranks, extra in (("tp1", 1, {}), ("tp2", 2, {"tensor_parallel_size": 2})):
        job = make_job(tmp_path, f"grpo-{name}", moe_models["qwen3-moe"], uneven_grpo_rows(),
                       **{**EP_GRPO, "cpu_ranks": ranks, **extra})  # fmt: skip
        assert run_trainer(job, ranks, timeout=600) == 0, trainer_output(job)[-3000:]
        runs[name] = job.read_metrics()
    one, two = runs["tp1"], runs["tp2"]
    assert len(one) == 2
    assert_same_curve(two, one, ("loss", "grad_norm", "moe_load_balancing_loss", "loss_tokens"))
    assert abs(two[1]["moe_routing_changed_fraction"] - one[1]["moe_routing_changed_fraction"]) <= 1e-9, (two, one)
    assert two[1]["moe_routing_changed_fraction"] > 0


@pytest.mark.slow
def test_an_rl_session_at_ep2_steps_with_uneven_ranks_and_refuses_tinker_ops(moe_models: dict[str, Path], tmp_path: Path,
                                                                           ) -> None:  # fmt: skip
    """A GRPO session on tiny Qwen3-MoE at expert_parallel_size 2 (2 real ranks): the uneven batch (a filler on rank
    0) takes its step, a Tinker primitive gets an error result that says what to change (it would leave the expert
    group's ranks out of step), the next batch trains, `end` completes the session."""
    from trainer_jobs import start_trainer, trainer_output, wait_for

    from scalarlm.checkpoint import JobDir
    from scalarlm.checkpoint.session import SessionDir
    from scalarlm.protocol.training import TrainArgs, TrainJobConfig

    require_mpirun()
    args = {k: v for k, v in EP_GRPO.items() if k not in ("num_iterations", "routing_replay", "max_steps")}
    job = JobDir(tmp_path / "session-ep2")
    job.create()
    job.write_config(TrainJobConfig(job_id=job.job_id, base_model=str(moe_models["qwen3-moe"]), session=True,
                                    train_args=TrainArgs(**args, expert_parallel_size=2)))  # fmt: skip
    job.dataset_path.write_text("")
    files = SessionDir(job)
    files.create()
    proc = start_trainer(job, 2)
    try:
        results = {}
        for k, rows in {1: uneven_grpo_rows(), 2: [{"op": "forward", "data": []}], 3: uneven_grpo_rows()}.items():
            files.write_request(k, rows)
            wait_for(lambda: files.result_path(k).exists() or proc.poll() is not None, 300, f"result {k}")
            assert files.result_path(k).exists(), trainer_output(job)[-3000:]
            results[k] = files.read_result(k)
        files.request_end()
        assert proc.wait(timeout=120) == 0, trainer_output(job)[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert results[1].error is None and results[3].error is None and results[3].version == 2
    assert "not supported at expert_parallel_size > 1" in results[2].error, results[2]
    first = results[1].metrics
    assert first["groups"] == 9 and first["moe_load_balancing_loss"] > 0
    assert job.read_status().status == "COMPLETED" and [r["step"] for r in job.read_metrics()] == [1, 2]


@pytest.mark.slow
def test_a_grpo_job_at_ep2_saved_inside_a_batch_resumes_there(moe_models: dict[str, Path], tmp_path: Path) -> None:
    """GRPO at EP=2 with routing replay, two batches of two steps: a job whose state was saved after step 3 (inside
    the second batch, each rank holding its own experts' optimizer state) resumes at EP=2 and takes the second batch
    again for step 4; steps 1-3 are the uninterrupted job's."""
    from trainer_jobs import make_job, run_trainer, trainer_output

    require_mpirun()
    rows = uneven_grpo_rows() + [dict(r, prompt="1" + r["prompt"], reward=2 * r["reward"]) for r in uneven_grpo_rows()]
    args = dict(EP_GRPO, max_steps=4, steps_per_checkpoint=4, expert_parallel_size=2)
    whole = make_job(tmp_path, "ep-whole", moe_models["qwen3-moe"], rows, **args)
    assert run_trainer(whole, 2, timeout=600) == 0, trainer_output(whole)[-3000:]
    split = make_job(tmp_path, "ep-split", moe_models["qwen3-moe"], rows, **dict(args, max_steps=3,
                                                                                   steps_per_checkpoint=3))
    assert run_trainer(split, 2, timeout=600) == 0, trainer_output(split)[-3000:]
    config = split.read_config()
    split.write_config(config.model_copy(update={"train_args": config.train_args.model_copy(update={"max_steps": 4})}))
    assert run_trainer(split, 2, timeout=600) == 0, trainer_output(split)[-3000:]
    a, b = whole.read_metrics(), split.read_metrics()
    assert [r["step"] for r in b] == [1, 2, 3, 4] and [r["batch_step"] for r in b] == [1, 2, 1, 2]
    assert_same_curve(b[:3], a[:3], ("loss", "grad_norm"), tolerance=1e-5)  # the same layout, the same arithmetic
    assert b[3]["reward_mean"] == a[3]["reward_mean"] != a[1]["reward_mean"]  # the second batch, again
    assert split.read_status().status == "COMPLETED" and (split.step_dir(4) / "model.safetensors").exists()
