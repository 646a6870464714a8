"""Trained models on the OpenAI routes, with the official `openai` client and no batch request in between.

A real `scalarlm serve` (vLLM worker, local megatron trainer) trains a full-weight job and a LoRA job; right
after each completes, its job id and `latest` answer completions, chat and streams, with the greedy output of
`transformers` (PEFT for the adapter) on the published checkpoint and the job's newest step as the version.
Requests to the base, the full fine-tune and the adapter interleave, each answered with its own weights; and
a session's new step is served to the next request while requests for the previous one are still running.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
from openai import OpenAI

import scalarlm
from scalarlm.checkpoint.staging import SUPERSEDABLE_FILE
from scalarlm.protocol.errors import NotFound

pytestmark = pytest.mark.slow

PROMPTS = ["What is the capital of France?", "What do bees make?", "What colour is the sky?"]
# The two jobs learn different answers, so the interleaving test can tell their weights apart.
FACTS = {"full": [{"input": p, "output": o} for p, o in zip(PROMPTS, [" Paris", " honey", " blue"])],
         "lora": [{"input": p, "output": o} for p, o in zip(PROMPTS, [" Rome", " milk", " green"])]}  # fmt: skip
TOKENS = 6
TRAIN = {"max_steps": 6, "learning_rate": 1e-2, "steps_per_checkpoint": 6, "max_seq_len": 64, "dtype": "float32"}
GREEDY = {"max_tokens": TOKENS, "temperature": 0, "extra_body": {"ignore_eos": True, "return_token_ids": True}}


class Reference:
    """`transformers` greedy tokens and first-token logprobs of one published checkpoint (PEFT for adapters)."""

    def __init__(self, base: Path, checkpoint: Path | None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(base)
        lora = checkpoint is not None and (checkpoint / "adapter_config.json").exists()
        source = base if checkpoint is None or lora else checkpoint
        model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
        if lora:
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, checkpoint)
        self.model = model.eval()

    def greedy(self, prompt: str) -> list[int]:
        import torch

        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        out: list[int] = []
        with torch.no_grad():  # argmax steps that never stop at EOS, as vLLM's ignore_eos
            for _ in range(TOKENS):
                out.append(int(self.model(input_ids=ids).logits[0, -1].argmax()))
                ids = torch.cat([ids, torch.tensor([[out[-1]]])], dim=1)
        return out

    def first_logprob(self, prompt: str) -> float:
        import torch

        ids = self.tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = self.model(input_ids=ids).logits[0, -1].float()
        return float(torch.log_softmax(logits, -1).max())


def step_dir(home: Path, job_id: str, step: int) -> Path:
    return home / "jobs" / job_id / "checkpoints" / f"step-{step}"


@pytest.fixture(scope="module")
def llm(loop_server: str) -> scalarlm.ScalarLM:
    return scalarlm.ScalarLM(api_url=loop_server, timeout=300)


@pytest.fixture(scope="module")
def oai(loop_server: str) -> OpenAI:
    return OpenAI(base_url=f"{loop_server}/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def jobs(llm: scalarlm.ScalarLM, loop_server_home: tuple[str, Path]) -> dict[str, tuple[str, int]]:
    """A full-weight job, then a LoRA job (so `latest` names the adapter): name -> (job id, newest step)."""
    done = {}
    for kind in ("full", "lora"):
        job = llm.train(FACTS[kind], train_args={**TRAIN, "adapter_type": kind})
        job.wait(timeout=900)
        done[kind] = (job.id, job.info().checkpoints[-1])
    return done


@pytest.fixture(scope="module")
def references(jobs: dict[str, tuple[str, int]], tiny_model_dir: Path,
               loop_server_home: tuple[str, Path]) -> dict[str, Reference]:
    home = loop_server_home[1]
    refs = {"base": Reference(tiny_model_dir, None)}
    for kind, (job_id, step) in jobs.items():
        refs[kind] = Reference(tiny_model_dir, step_dir(home, job_id, step))
    return refs


@pytest.mark.parametrize("kind,alias", [("full", False), ("lora", False), ("lora", True)],
                         ids=["full", "lora", "latest"])  # fmt: skip
def test_trained_model_answers_completions_chat_and_streams_right_after_training(
    oai: OpenAI, jobs: dict[str, tuple[str, int]], references: dict[str, Reference], kind: str, alias: bool
) -> None:
    job_id, step = jobs[kind]
    name = "latest" if alias else job_id
    fingerprint = f"scalarlm-{job_id}-v{step}"
    listed = {m.id: m.model_extra for m in oai.models.list().data}
    assert listed[job_id]["scalarlm_version"] == step

    for prompt in PROMPTS:
        reply = oai.completions.create(model=name, prompt=prompt, **GREEDY)
        assert reply.model == job_id
        assert (reply.system_fingerprint, reply.model_extra["scalarlm_version"]) == (fingerprint, step)
        assert reply.choices[0].model_extra["token_ids"] == references[kind].greedy(prompt)

    whole = oai.completions.create(model=name, prompt=PROMPTS[0], **GREEDY)
    chunks = list(oai.completions.create(model=name, prompt=PROMPTS[0], stream=True, **GREEDY))
    assert {c.system_fingerprint for c in chunks} == {fingerprint}
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text

    messages = [{"role": "user", "content": PROMPTS[1]}]
    chat = oai.chat.completions.create(model=name, messages=messages, **GREEDY)
    assert chat.system_fingerprint == fingerprint and chat.model == job_id
    pieces = oai.chat.completions.create(model=name, messages=messages, stream=True, **GREEDY)
    text = "".join(c.choices[0].delta.content or "" for c in pieces if c.choices)
    assert text == chat.choices[0].message.content


def test_interleaved_requests_to_base_full_and_lora_each_use_their_own_weights(
    oai: OpenAI, jobs: dict[str, tuple[str, int]], references: dict[str, Reference], tiny_model_dir: Path
) -> None:
    names = {"base": tiny_model_dir.name, "full": jobs["full"][0], "lora": jobs["lora"][0]}
    expected = {(kind, p): references[kind].greedy(p) for kind in names for p in PROMPTS}
    assert len({tuple(expected[(k, PROMPTS[0])]) for k in names}) == 3, "the three models must answer differently"
    order = [(kind, prompt) for _ in range(3) for prompt in PROMPTS for kind in ("base", "full", "lora")]

    def ask(kind_prompt: tuple[str, str]) -> tuple[str, int, list[int]]:
        kind, prompt = kind_prompt
        reply = oai.completions.create(model=names[kind], prompt=prompt, **GREEDY)
        return reply.model, reply.model_extra["scalarlm_version"], reply.choices[0].model_extra["token_ids"]

    with ThreadPoolExecutor(max_workers=6) as pool:
        answers = list(pool.map(ask, order))
    versions = {"base": 0, "full": jobs["full"][1], "lora": jobs["lora"][1]}
    for (kind, prompt), (model, version, tokens) in zip(order, answers):
        assert (model, version) == (names[kind], versions[kind])
        assert tokens == expected[(kind, prompt)], (kind, prompt)


def test_a_session_step_published_during_requests_is_served_to_the_next_request(
    llm: scalarlm.ScalarLM, oai: OpenAI, tiny_model_dir: Path, loop_server_home: tuple[str, Path]
) -> None:
    home = loop_server_home[1]
    prompt = PROMPTS[0]
    rows = [{"prompt": prompt, "completion": c, "reward": r}
            for c, r in ((" Paris", 1.0), (" blue", 0.0), (" honey", 0.0), (" Paris", 1.0))]  # fmt: skip
    seen: list[tuple[int, float]] = []
    stop = threading.Event()

    def keep_asking(model: str) -> None:
        while not stop.is_set():
            reply = oai.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0, logprobs=1)
            seen.append((reply.model_extra["scalarlm_version"], reply.choices[0].logprobs.token_logprobs[0]))

    with llm.rl_session(train_args={"loss": "grpo", "learning_rate": 1e-2, "max_seq_len": 64,
                                    "dtype": "float32"}) as session:  # fmt: skip
        first = session.step(rows)
        askers = [threading.Thread(target=keep_asking, args=(session.model_name,)) for _ in range(2)]
        for t in askers:
            t.start()
        try:
            while not seen:
                stop.wait(0.05)
            second = session.step(rows)
            after = oai.completions.create(model=session.model_name, prompt=prompt, max_tokens=2, temperature=0,
                                           logprobs=1)  # fmt: skip
        finally:
            stop.set()
            for t in askers:
                t.join()
    assert after.model_extra["scalarlm_version"] == second > first
    logprob = {v: Reference(tiny_model_dir, step_dir(home, session.model_name, v)).first_logprob(prompt)
               for v in (first, second)}  # fmt: skip
    assert abs(logprob[first] - logprob[second]) > 1e-3, "the two steps must be told apart by their outputs"
    assert after.choices[0].logprobs.token_logprobs[0] == pytest.approx(logprob[second], abs=1e-4)
    assert {v for v, _ in seen} <= {first, second} and first in {v for v, _ in seen}
    for version, value in seen:  # each response was produced by the weights its version names
        assert value == pytest.approx(logprob[version], abs=1e-4), version


def _file_bytes(folder: Path) -> dict[str, bytes]:
    """The checkpoint's files (not its manifest, nor a staged copy's `supersedable` marker, which never lands)."""
    skip = ("manifest.json", SUPERSEDABLE_FILE)
    return {f.name: f.read_bytes() for f in folder.iterdir() if f.is_file() and f.name not in skip}


def test_full_weights_are_served_from_the_staged_copy_and_the_same_files_land_durably(
    llm: scalarlm.ScalarLM, oai: OpenAI, tiny_model_dir: Path, loop_server_home: tuple[str, Path]
) -> None:
    """The step's answer comes once the weights are staged in memory, not once they are durable; what is served is
    the checkpoint that then lands (the same bytes); a landed staged copy is removed once a newer step is staged."""
    home = loop_server_home[1]
    prompt = PROMPTS[1]
    rows = [{"prompt": prompt, "completion": c, "reward": r}
            for c, r in ((" honey", 1.0), (" blue", 0.0), (" Paris", 0.0), (" honey", 1.0))]  # fmt: skip
    staged: dict[int, dict[str, bytes]] = {}
    served: dict[int, float] = {}
    with llm.rl_session(train_args={"loss": "grpo", "learning_rate": 1e-2, "max_seq_len": 64,
                                    "dtype": "float32"}) as session:  # fmt: skip
        pointer = home / "jobs" / session.model_name / "checkpoints" / "staged"
        for _ in range(2):
            version = session.step(rows)
            name, path = pointer.read_text().split()
            assert name == f"step-{version}" and Path(path).parent.parent.name.startswith("scalarlm-staging-")
            staged[version] = _file_bytes(Path(path))  # read now: it is removed once landed and superseded
            assert (Path(path) / SUPERSEDABLE_FILE).exists()  # a session step serves; a newer one may overtake it
            reply = oai.completions.create(model=session.model_name, prompt=prompt, max_tokens=1, temperature=0,
                                           logprobs=1)  # fmt: skip
            assert reply.model_extra["scalarlm_version"] == version
            served[version] = reply.choices[0].logprobs.token_logprobs[0]
        first, second = sorted(staged)
        deadline = time.monotonic() + 60  # the poll removes step 1's copy: landed, and step 2 is staged
        while (Path(path).parent / f"step-{first}").exists() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not (Path(path).parent / f"step-{first}").exists()
    for version in (first, second):  # the session's end waited for the durable copies
        durable = step_dir(home, session.model_name, version)
        assert _file_bytes(durable) == staged[version]
        reference = Reference(tiny_model_dir, durable).first_logprob(prompt)
        assert served[version] == pytest.approx(reference, abs=1e-4), version
    assert served[first] != pytest.approx(served[second], abs=1e-3)


@pytest.mark.parametrize("kind", ["lora", "full"])
def test_a_deleted_job_leaves_every_route_at_once(llm: scalarlm.ScalarLM, oai: OpenAI, tiny_model_dir: Path,
                                                  loop_server_home: tuple[str, Path], kind: str) -> None:  # fmt: skip
    """Once the delete answers, the job is not listed (though the engine still holds the adapter it loaded, which
    vLLM's own list names) and its name is a 404 on the OpenAI and batch routes, without waiting for the catalog's
    poll; the base still answers. A full-weight job's copy staged in memory is removed too."""
    job = llm.train(FACTS[kind], train_args={**TRAIN, "max_steps": 1, "steps_per_checkpoint": 1, "adapter_type": kind})
    job.wait(timeout=900)
    assert oai.completions.create(model=job.id, prompt=PROMPTS[0], **GREEDY).model == job.id  # the engine loads it
    assert job.id in {m.id for m in oai.models.list().data}
    staged = loop_server_home[1] / "jobs" / job.id / "checkpoints" / "staged"
    folder = Path(staged.read_text().split()[1]).parent if kind == "full" else None  # the job's staging folder

    assert llm.delete(job)["deleted"] is True
    assert job.id not in {m.id for m in oai.models.list().data}
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        oai.completions.create(model=job.id, prompt=PROMPTS[0], **GREEDY)
    with pytest.raises(NotFound, match="does not exist"):
        llm.generate([PROMPTS[0]], model_name=job.id, max_tokens=2)
    assert oai.completions.create(model=tiny_model_dir.name, prompt=PROMPTS[0], **GREEDY).model == tiny_model_dir.name
    if folder is not None:
        deadline = time.monotonic() + 30
        while folder.exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not folder.exists()
