"""Each family served like transformers, by two checks.

Every family (FAMILIES): the vLLM engine `scalarlm serve` builds for its tiny model (our settings' flags), run in one
process for all of them (family_engine_check.py): greedy answers and each chosen token's logprob equal transformers'
on the base and, after a full-weight swap by the worker calls the hot swap makes, on a perturbed checkpoint under the
checkpoint's names (the names the trainer exports: the mcore -> HF round trip is bit-exact in test_family_parity).

The whole loop on one family per distinct serving path (LOOP_FAMILIES): a real `scalarlm serve` per family (the next
family's boots while this one's tests run). Two SFT jobs (full weights and LoRA, training side by side) publish
checkpoints that open in `transformers` (PEFT for the adapter); the served greedy answer for each job, after the hot
swap, equals `transformers` greedy on that checkpoint, and so does each chosen token's logprob. One GRPO step trains
and publishes for qwen3, qwen3-moe and deepseek-v3 (GRPO_FAMILIES): the rest of the dense families' GRPO path is their
SFT forward (a token's logprob is minus its cross-entropy), which test_family_parity checks, and the loss itself is
family-blind (tests/unit/training/test_grpo.py, test_grpo_padding_free). On a mixture-of-experts model (MOE) an
adapter targets the attention (an expert target is a 400) and the CPU engine has no LoRA slots: the adapter is served
merged into the base. DeepSeek's latent attention takes no adapter (LORA_REFUSED: a 400 naming adapter_type). A MoE
GRPO job (qwen3-moe's with and without routing replay, deepseek-v3's with it) takes two steps per batch and reports the
changed-routing fraction.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import scalarlm
from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS

from hf_greedy import PROMPTS, TOKENS, hf_greedy

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3", "qwen3-yarn", "llama3", "phi3", "phi4-mini", "mistral", "smollm3", "gemma", "gemma2", "gemma3",
            "olmo2", "olmo3", "exaone4", "ernie4.5", "granite", "granite4", "glm", "glm4", "qwen3-moe", "qwen2-moe",
            "mixtral", "glm4-moe", "deepseek-v3", "moonlight", "deepseek-v2-lite", "olmoe", "granite-moe",
            "gpt-oss", "seed-oss", "starcoder2", "nemotron", "arcee", "apertus", "hunyuan",
            "command-r-plus", "cohere2", "gpt-neox", "phi", "stablelm", "gemma3-mm"]  # fmt: skip
# (cohere: vLLM serves it with Command R+'s module and names, without the q/k norms; test_family_parity checks its
# training)
# Through the whole loop (the suite's time: a server boot per family): the reference dense family; fused q/k/v and
# gate/up projections (phi3); GPT-NeoX's fused, head-interleaved query_key_value; vLLM's Transformers backend (olmo2);
# a multimodal checkpoint's language model (gemma3-mm); a mixture of experts with its adapter served merged
# (qwen3-moe); multi-head latent attention (deepseek-v3); a checkpoint that trains with dropout, through the Tinker
# API (seed-oss).
LOOP_FAMILIES = ["qwen3", "phi3", "gpt-neox", "olmo2", "gemma3-mm", "qwen3-moe", "deepseek-v3", "seed-oss"]
MOE = {"qwen3-moe", "qwen2-moe", "mixtral", "glm4-moe", "deepseek-v3", "moonlight", "deepseek-v2-lite", "olmoe",
       "granite-moe", "gpt-oss"}  # fmt: skip
# LoRA refused at submission: no adapter rule for multi-head latent attention
LORA_REFUSED = {"deepseek-v3", "moonlight", "deepseek-v2-lite"}
# One GRPO job through the server per kind of router: qwen3-moe's softmax top-k (with and without routing replay) and
# deepseek-v3's grouped sigmoid routing with shared experts. Every MoE model's replay is checked layer by layer in
# test_moe_parity (moe_replay_check.py), and a GRPO job publishes through the same export as the SFT job here.
GRPO_FAMILIES = {"qwen3", "qwen3-moe", "deepseek-v3"}
HERE = Path(__file__).parent
FACTS = [{"input": p, "output": o} for p, o in zip(PROMPTS, [" Paris", " honey", " blue"])]
TRAIN = {"max_steps": 4, "learning_rate": 1e-2, "steps_per_checkpoint": 4, "max_seq_len": 64, "dtype": "float32"}


# The next family's server, booting while this family's tests run (its start is mostly imports on one core, theirs
# mostly trainer processes): {family: (the started `scalarlm serve`, its base model dir)}.
_AHEAD: dict[str, tuple[Any, Path]] = {}


def _launch(name: str, tmp_path_factory: pytest.TempPathFactory, steps: Any) -> tuple[Any, Path]:
    from scalarlm.cli.tiny_model import make_tiny_model

    root = tmp_path_factory.mktemp(f"serve-{name}")
    model = make_tiny_model(root / name, **FAMILY_TINY_MODELS[name])
    return steps.launch(root, model), model


def _next_selected(session: pytest.Session, name: str) -> str | None:
    """The family after `name` whose tests this run selected (None: none)."""
    chosen = {item.callspec.params.get("family_server") for item in session.items if hasattr(item, "callspec")}
    return next((f for f in LOOP_FAMILIES[LOOP_FAMILIES.index(name) + 1 :] if f in chosen), None)


@pytest.fixture(scope="module", params=LOOP_FAMILIES)
def family_server(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                  serve_steps: Any) -> Iterator[tuple[str, str, Path]]:  # fmt: skip
    """(family, URL, base model dir) of a real `scalarlm serve` whose base is the family's tiny model; once it is up,
    the next family's server starts booting."""
    name = request.param
    launch, model = _AHEAD.pop(name, None) or _launch(name, tmp_path_factory, serve_steps)
    try:
        serve_steps.wait(launch)
        following = _next_selected(request.session, name)
        if following is not None and following not in _AHEAD:
            _AHEAD[following] = _launch(following, tmp_path_factory, serve_steps)
        yield name, launch.url, model
    finally:
        serve_steps.stop(launch)


@pytest.fixture(scope="module", autouse=True)
def _no_server_left_booting(serve_steps: Any) -> Iterator[None]:
    """A server booted ahead for tests that did not run (an error, -x) stops with the module."""
    yield
    while _AHEAD:
        launch, _ = _AHEAD.popitem()[1]
        serve_steps.stop(launch)


@pytest.fixture(scope="module")
def sft_jobs(family_server: tuple[str, str, Path]) -> dict[str, Any]:
    """The family's SFT jobs, full weights and (but for LORA_REFUSED) LoRA, submitted together when the module's
    first test starts: they train side by side while the base model is checked."""
    family, url, _ = family_server
    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    kinds = ["full"] if family in LORA_REFUSED else ["full", "lora"]
    return {kind: llm.train(FACTS, train_args={**TRAIN, "adapter_type": kind}) for kind in kinds}


def _served_like_transformers(url: str, base: Path, job: Any) -> None:
    """The job's last checkpoint, served after the hot swap: greedy answers = transformers', and so is each chosen
    token's logprob (which compares the distributions even where a briefly trained model's answer is its EOS)."""
    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    assert job.wait(timeout=900).status == "COMPLETED", job.info()
    info = job.info()
    step = info.checkpoints[-1]
    checkpoint = Path(info.job_status["job_directory"]) / "checkpoints" / f"step-{step}"
    results = llm.generate(PROMPTS, model_name=job.id, max_tokens=TOKENS, temperature=0, return_details=True,
                           logprobs=0)  # fmt: skip
    assert [(r.model, r.version) for r in results] == [(job.id, step)] * len(PROMPTS)
    answers, logprobs = hf_greedy(base, checkpoint)
    assert [r.response for r in results] == [answer.rstrip("\ufffd") for answer in answers]  # (as the base test's)
    for result, expected in zip(results, logprobs, strict=True):
        assert result.logprobs == pytest.approx(expected, abs=1e-3), (result.logprobs, expected)
    assert min(map(len, logprobs)) >= 1


@pytest.fixture(scope="module")
def engine_results(family_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """family_engine_check.py's result for every family, by name (one process for all)."""
    out = tmp_path_factory.mktemp("swapped")
    models = [str(family_models[family]) for family in FAMILIES]
    command = [sys.executable, str(HERE / "family_engine_check.py"), str(out), *models]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=900, cwd=HERE)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = [json.loads(line[len("RESULT ") :]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return {row["model"]: row for row in rows}


@pytest.mark.parametrize("family", FAMILIES)
def test_the_engine_serves_the_base_and_a_swapped_checkpoint_like_transformers(
        engine_results: dict[str, dict], family_models: dict[str, Path], family: str) -> None:  # fmt: skip
    """Greedy answers and each chosen token's logprob = transformers', on the base and after the full-weight swap
    (which changed them: the swap took)."""
    result = engine_results[family]
    swapped = Path(result["swapped_dir"])
    for served, checkpoint in (("base", family_models[family]), ("swapped", swapped)):
        (answers, logprobs), (hf_answers, hf_logprobs) = result[served], hf_greedy(checkpoint, checkpoint)
        # a random model's last token may end inside a UTF-8 character: transformers decodes it as U+FFFD, vLLM's
        # incremental detokenizer holds the incomplete bytes back
        assert [a.rstrip("\ufffd") for a in answers] == [a.rstrip("\ufffd") for a in hf_answers], served
        for got, want in zip(logprobs, hf_logprobs, strict=True):
            assert got == pytest.approx(want, abs=1e-3), (served, got, want)
    base, after = result["base"][1], result["swapped"][1]
    assert max(abs(a - b) for u, v in zip(base, after) for a, b in zip(u, v)) > 1e-2


def test_the_base_model_is_served_like_transformers(family_server: tuple[str, str, Path],
                                                    sft_jobs: dict[str, Any]) -> None:  # fmt: skip
    """The untrained random base (whose greedy tokens move with any error, unlike a trained model's peaked answers):
    e.g. vLLM's CPU rotary kernel mis-rotates MLA queries (deepseek-v3's yarn takes another path; moonlight's plain
    RoPE shows it: `engine.cpu_rotary_args`). (The family's SFT jobs train meanwhile.)"""
    _, url, base = family_server
    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    results = llm.generate(PROMPTS, max_tokens=TOKENS, temperature=0, return_details=True)
    # a random model's last token may end inside a UTF-8 character: transformers decodes it as U+FFFD, vLLM's
    # incremental detokenizer holds the incomplete bytes back
    expected = [answer.rstrip("\ufffd") for answer in hf_greedy(base, base)[0]]
    assert [r.response.rstrip("\ufffd") for r in results] == expected
    assert any(answer.strip() for answer in expected)


@pytest.mark.parametrize("adapter_type", ["full", "lora"])
def test_sft_job_is_served_like_transformers(family_server: tuple[str, str, Path], sft_jobs: dict[str, Any],
                                             adapter_type: str) -> None:  # fmt: skip
    family, url, base = family_server
    if family in LORA_REFUSED and adapter_type == "lora":
        from scalarlm.protocol.errors import InvalidRequest

        llm = scalarlm.ScalarLM(api_url=url, timeout=600)
        refused = "adapter_type 'lora' is not supported for deepseek_v[23]: LoRA on multi-head latent attention"
        with pytest.raises(InvalidRequest, match=refused) as e:
            llm.train(FACTS, train_args={**TRAIN, "adapter_type": "lora"})
        assert e.value.param == "train_args"
        return
    if family in MOE and adapter_type == "lora":  # the attention only: an expert adapter is refused at submission
        from scalarlm.protocol.errors import InvalidRequest

        llm = scalarlm.ScalarLM(api_url=url, timeout=600)
        lora = {"adapter_type": "lora", "lora_config": {"target_modules": ["q_proj", "gate_proj"]}}
        with pytest.raises(InvalidRequest, match=r"\['gate_proj'\]: not supported for .*: adapters on a mixture-of-"):
            llm.train(FACTS, train_args={**TRAIN, **lora})
    _served_like_transformers(url, base, sft_jobs[adapter_type])


def test_one_grpo_step_trains_and_publishes(family_server: tuple[str, str, Path]) -> None:
    family, url, _ = family_server
    if family not in GRPO_FAMILIES:
        pytest.skip(f"{family}: its GRPO forward is its SFT forward, checked by its SFT jobs (see the docstring)")
    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    rows = [{"prompt": PROMPTS[0], "completion": c, "reward": r} for c, r in ((" Paris", 1.0), (" Rome", 0.0))]
    if family not in MOE:
        job = llm.train(rows, train_args={**TRAIN, "max_steps": 1, "loss": "grpo", "batch_size": 1})
        assert job.wait(timeout=900).status == "COMPLETED", job.info()
        assert job.info().checkpoints == [1]
        return
    # MoE: two steps over the batch (num_iterations 2) with routing replay, and on qwen3-moe also without it (the two
    # jobs train side by side; test_moe_parity compares replayed and free layers on every MoE model); the second step
    # reports how many tokens' experts changed since the first, through the API's metrics.
    replays = (False, True) if family == "qwen3-moe" else (True,)
    jobs = [llm.train(rows, train_args={**TRAIN, "max_steps": 2, "steps_per_checkpoint": 2, "loss": "grpo",
                                        "batch_size": 1, "adapter_type": "full", "num_iterations": 2,
                                        "routing_replay": replay}) for replay in replays]  # fmt: skip
    for job in jobs:
        assert job.wait(timeout=900).status == "COMPLETED", job.info()
        assert job.info().checkpoints == [2]
        first, second = job.metrics()
        assert "moe_routing_changed_fraction" not in first and 0 <= second["moe_routing_changed_fraction"] <= 1
        assert first["moe_load_balancing_loss"] > 0 and second["batch_step"] == 2


def _tinker_datum(base: Path) -> tuple[Any, Any]:
    """One Tinker cross-entropy datum (the first prompt and " Paris") and transformers' logprob of each target token
    on the base."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    types = pytest.importorskip("tinker").types
    seq = AutoTokenizer.from_pretrained(base)(PROMPTS[0] + " Paris").input_ids
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()(torch.tensor([seq[:-1]])).logits
    expected = torch.log_softmax(logits[0].double(), -1).gather(1, torch.tensor(seq[1:])[:, None])[:, 0].numpy()
    inputs = {"target_tokens": np.array(seq[1:]), "weights": np.ones(len(seq) - 1, np.float32)}
    datum = types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                        loss_fn_inputs={k: types.TensorData.from_numpy(v) for k, v in inputs.items()})  # fmt: skip
    return datum, expected


@contextmanager
def _tinker_service(url: str) -> Iterator[tuple[Any, str]]:
    """A Tinker ServiceClient on the server and the name of its base model; closed after the block."""
    tinker = pytest.importorskip("tinker")
    service = tinker.ServiceClient(base_url=url, api_key="tml-unused")
    try:
        yield service, service.get_server_capabilities().supported_models[0].model_name
    finally:
        service.close("success").result()


def test_tinker_forward_gives_the_weights_logprobs_and_forward_backward_trains_with_dropout(
        family_server: tuple[str, str, Path]) -> None:  # fmt: skip
    """A checkpoint that trains with dropout (Seed-OSS's 0.1) through the Tinker API: `forward` (eval mode) returns
    the logprobs the weights give, the same on every call and equal to transformers'; `forward_backward` applies the
    dropout as training does."""
    family, url, base = family_server
    if family != "seed-oss":  # (StarCoder2's dropout runs the same code: test_family_parity counts both)
        pytest.skip(f"{family}: checked on seed-oss, one of the checkpoints that set dropout")
    import numpy as np

    datum, expected = _tinker_datum(base)
    with _tinker_service(url) as (service, name):
        client = service.create_lora_training_client(base_model=name, rank=8).result()
        first, again = (client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
                        for _ in range(2))  # fmt: skip
        assert np.array_equal(first, again)
        np.testing.assert_allclose(first, expected, atol=2e-5)
        trained = client.forward_backward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert np.abs(trained - expected).max() > 1e-3


def test_a_tinker_lora_client_on_a_mixture_of_experts_model_trains_its_attention(
        family_server: tuple[str, str, Path]) -> None:  # fmt: skip
    """Tinker's default LoRA client asks for the MLP too (`train_mlp`): on a MoE model that is refused saying what to
    set; with `train_mlp=False` the client's `forward` gives the base's logprobs (B starts at zero) = transformers', and
    a step on the attention adapter moves them."""
    family, url, base = family_server
    if family != "qwen3-moe":
        pytest.skip(f"{family}: checked on qwen3-moe (the MoE adapter rule is one for every MoE family)")
    import numpy as np

    datum, expected = _tinker_datum(base)  # (skips without the tinker SDK)
    from tinker import types

    with _tinker_service(url) as (service, name):
        with pytest.raises(Exception, match=r"mixture-of-experts model's MLPs .* train_mlp=False"):
            service.create_lora_training_client(base_model=name, rank=8).result()
        client = service.create_lora_training_client(base_model=name, rank=8, train_mlp=False).result()
        before = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        np.testing.assert_allclose(before, expected, atol=2e-5)
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        after = client.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        assert after.sum() > before.sum() + 1e-3, (before, after)  # the trained tokens got likelier
