"""Each new family through the whole loop: a real `scalarlm serve` (vLLM worker, local megatron trainer) per family.

Two SFT jobs (full weights and LoRA, training side by side) publish checkpoints that open in `transformers` (PEFT
for the adapter); the served greedy answer for each job, after the hot swap, equals `transformers` greedy on that
checkpoint, and so does each chosen token's logprob (but where another family's job checks the same serving path:
SFT_CHECKED_BY, LORA_CHECKED_BY). One GRPO step trains and publishes for qwen3, qwen3-moe and deepseek-v3
(GRPO_FAMILIES): the rest of the dense families' GRPO path is their SFT forward (a token's logprob is minus its
cross-entropy), which their SFT jobs here and test_family_parity check, and the loss itself is family-blind
(tests/unit/training/test_grpo.py, test_grpo_padding_free). One module-scoped server per family (the next family's
boots while this one's tests run), a few steps per job. On a mixture-of-experts model (MOE) an adapter targets the
attention (an expert target is a 400) and, as on StableLM, the CPU engine has no LoRA slots: the adapter is served
merged into the base (qwen3-moe's job checks that path for all of them). DeepSeek's latent attention takes no
adapter (LORA_REFUSED: a 400 naming adapter_type). A MoE GRPO job (qwen3-moe's with and without routing replay,
deepseek-v3's with it) takes two steps per batch and reports the changed-routing fraction.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

import scalarlm
from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS

pytestmark = pytest.mark.slow

FAMILIES = ["qwen3", "qwen3-yarn", "llama3", "phi3", "phi4-mini", "mistral", "smollm3", "gemma", "gemma2", "gemma3",
            "olmo2", "olmo3", "exaone4", "ernie4.5", "granite", "granite4", "glm", "glm4", "qwen3-moe", "qwen2-moe",
            "mixtral", "glm4-moe", "deepseek-v3", "moonlight", "deepseek-v2-lite", "olmoe", "granite-moe",
            "gpt-oss", "seed-oss", "starcoder2", "nemotron", "arcee", "apertus", "hunyuan",
            "command-r-plus", "cohere2", "gpt-neox", "phi", "stablelm", "gemma3-mm"]  # fmt: skip
# (cohere: vLLM serves it with Command R+'s module and names, without the q/k norms; test_family_parity checks its
# training)
MOE = {"qwen3-moe", "qwen2-moe", "mixtral", "glm4-moe", "deepseek-v3", "moonlight", "deepseek-v2-lite", "olmoe",
       "granite-moe", "gpt-oss"}  # fmt: skip
# LoRA refused at submission: no adapter rule for multi-head latent attention
LORA_REFUSED = {"deepseek-v3", "moonlight", "deepseek-v2-lite"}
# One GRPO job through the server per kind of router: qwen3-moe's softmax top-k (with and without routing replay) and
# deepseek-v3's grouped sigmoid routing with shared experts. Every MoE model's replay is checked layer by layer in
# test_moe_parity (moe_replay_check.py), and a GRPO job publishes through the same export as the SFT job here.
GRPO_FAMILIES = {"qwen3", "qwen3-moe", "deepseek-v3"}
# Variants whose trained weights and adapters vLLM loads by the same module and names as the family they vary (their
# RoPE is what differs, which their base test checks): their SFT jobs would repeat that family's.
# (Moonlight: DeepSeek-V3's module and names but one `q_proj`, the path deepseek-v2-lite's job takes in that module.)
VARIANTS = {"qwen3-yarn": "qwen3", "phi4-mini": "phi3", "moonlight": "deepseek-v3"}
# Families vLLM 0.32.0 serves on its Transformers backend (transformers' own modules; checked against vLLM's registry
# below). A full-weight step reloads by the checkpoint's names, which are the base's (the round trip in
# test_family_parity is bit-exact) and so the names the boot loaded: olmo2's full job checks that reload for all.
TRANSFORMERS_BACKEND = ("olmo2", "smollm3", "olmo3", "glm", "seed-oss", "starcoder2", "arcee", "hunyuan", "gpt-neox",
                        "phi")  # fmt: skip
SFT_CHECKED_BY = {**VARIANTS, **dict.fromkeys(TRANSFORMERS_BACKEND[1:], "olmo2")}
# Adapters the backend loads on the same kind of Linear layers under the same PEFT names: olmo2's LoRA job checks
# q/k/v/o_proj and a gated gate/up/down_proj, starcoder2's an ungated MLP's two projections (Arcee's up/down_proj,
# Phi's fc1/fc2). GLM's fused gate_up_proj and GPT-NeoX's fused, head-interleaved query_key_value keep their own jobs.
LORA_CHECKED_BY = {**VARIANTS, **dict.fromkeys(("olmo3", "smollm3", "seed-oss", "hunyuan"), "olmo2"),
                   **dict.fromkeys(("arcee", "phi"), "starcoder2"),
                   "cohere2": "command-r-plus",  # (vLLM's Command R module, the same adapter names)
                   # Served merged into the base (no LoRA slots on this engine: `engine.lora_enabled`), by the same
                   # merge and full-weight swap whatever the family (attention adapters; = PEFT in test_family_parity)
                   **dict.fromkeys(sorted(MOE - LORA_REFUSED - {"qwen3-moe"}) + ["stablelm"], "qwen3-moe")}
PROMPTS = ["What is the capital of France?", "What do bees make?", "What colour is the sky?"]
FACTS = [{"input": p, "output": o} for p, o in zip(PROMPTS, [" Paris", " honey", " blue"])]
TOKENS = 6
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
    return next((f for f in FAMILIES[FAMILIES.index(name) + 1 :] if f in chosen), None)


@pytest.fixture(scope="module", params=FAMILIES)
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


def _hf_greedy(base: Path, checkpoint: Path) -> tuple[list[str], list[list[float]]]:
    """`transformers` greedy completions on the published checkpoint (PEFT over the base for an adapter), and each
    chosen token's logprob."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lora = (checkpoint / "adapter_config.json").exists()
    # Eager attention: HF's SDPA path drops Gemma 2's attention soft cap (vLLM applies it).
    model: Any = AutoModelForCausalLM.from_pretrained(base if lora else checkpoint, dtype=torch.float32,
                                                      attn_implementation="eager")  # fmt: skip
    if lora:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, checkpoint)
    model.eval()
    for module in model.modules():  # vLLM 0.32.0 holds xIELU's scalars (Apertus's) in bf16 whatever the model's dtype,
        if type(module).__name__ == "XIELUActivation":  # and computes their softplus there
            module.to(torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    answers, logprobs = [], []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=TOKENS, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)  # fmt: skip
        chosen = out.sequences[0, ids.shape[1] :]
        answers.append(tokenizer.decode(chosen, skip_special_tokens=True))
        steps = torch.log_softmax(torch.cat(out.logits).double(), -1)
        logprobs.append(steps.gather(1, chosen[:, None])[:, 0].tolist())
    return answers, logprobs


@pytest.fixture(scope="module")
def sft_jobs(family_server: tuple[str, str, Path]) -> dict[str, Any]:
    """The family's SFT jobs, full weights and (but for MOE) LoRA, submitted together when the module's first test
    starts: they train side by side while the base model is checked."""
    family, url, _ = family_server
    llm = scalarlm.ScalarLM(api_url=url, timeout=600)
    kinds = [k for k in ("full", "lora")
             if _checked_by(family, k) is None and not (k == "lora" and family in LORA_REFUSED)]  # fmt: skip
    return {kind: llm.train(FACTS, train_args={**TRAIN, "adapter_type": kind}) for kind in kinds}


def _checked_by(family: str, adapter_type: str) -> str | None:
    """The family whose SFT job of `adapter_type` checks this one's serving path (None: its own job does)."""
    return (LORA_CHECKED_BY if adapter_type == "lora" else SFT_CHECKED_BY).get(family)


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
    answers, logprobs = _hf_greedy(base, checkpoint)
    assert [r.response for r in results] == [answer.rstrip("\ufffd") for answer in answers]  # (as the base test's)
    for result, expected in zip(results, logprobs, strict=True):
        assert result.logprobs == pytest.approx(expected, abs=1e-3), (result.logprobs, expected)
    assert min(map(len, logprobs)) >= 1


def test_the_families_checked_by_olmo2_are_served_on_vllms_transformers_backend() -> None:
    from vllm.model_executor.models.registry import ModelRegistry

    from scalarlm.training.families import BY_NAME

    for name in TRANSFORMERS_BACKEND:
        for architecture in BY_NAME[FAMILY_TINY_MODELS[name]["family"]].architectures:
            assert ModelRegistry.models[architecture].module_name.endswith(".transformers"), (name, architecture)


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
    expected = [answer.rstrip("\ufffd") for answer in _hf_greedy(base, base)[0]]
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
    if (other := _checked_by(family, adapter_type)) is not None:
        pytest.skip(f"{family}: its {adapter_type} serving path is {other}'s, whose job checks it (*_CHECKED_BY)")
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
        jobs = f"{VARIANTS[family]}'s SFT jobs" if family in VARIANTS else "the SFT jobs"
        if family in MOE:
            jobs += "; its routing replay by test_moe_parity"
        pytest.skip(f"{family}: its GRPO forward is its SFT forward, checked by {jobs} (see the docstring)")
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
