"""Through the real control plane and trainer: a job names its base by a hub id found only in the local HF cache
(a bf16, sharded checkpoint), trains on chat rows, and publishes a checkpoint with the source's tensor names and
dtypes, config, generation config, tokenizer and chat template, which opens in transformers. An uncached id is a
400 at submission naming it, with nothing written."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sharded_models import put_in_hub_cache, sharded_tiny_model

from scalarlm.config import Settings
from scalarlm.server.app import create_app
from scalarlm.training import hf_io

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

REPO_ID = "tiny-org/tiny-llama-bf16"
CHATS = [
    {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}
    for q, a in [("What is the capital of France?", "Paris"), ("What is two plus two?", "four")]
]
SUPPORT_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                 "chat_template.jinja")  # fmt: skip


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(cache dir, snapshot) of a bf16 sharded tiny Llama cached under REPO_ID."""
    root = tmp_path_factory.mktemp("hub")
    model = sharded_tiny_model(root / "models", "tiny-bf16", "bfloat16", heads=2)
    cache = root / "cache"
    return cache, put_in_hub_cache(model, cache, REPO_ID)


@pytest.fixture
def settings(tmp_path: Path, tiny_model_dir: Path, hub: tuple[Path, Path]) -> Settings:
    return Settings(home=tmp_path / "home", model=str(tiny_model_dir), hf_cache=hub[0], training={"poll_seconds": 0.5})


@pytest.fixture
def client(settings: Settings) -> Iterator[TestClient]:
    with TestClient(create_app(settings)) as c:
        yield c


def _submit(client: TestClient, rows: list[dict], params: dict):
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    files = {"file": ("dataset", data, "application/octet-stream"), "params": (None, json.dumps(params), "application/json")}
    return client.post("/v1/megatron/train", files=files)


def _wait(client: TestClient, job_id: str, timeout: float = 420.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        body = client.get(f"/v1/megatron/train/{job_id}").json()
        if body["job_status"]["status"] in ("COMPLETED", "FAILED", "CANCELLED"):
            return body
        if time.monotonic() > deadline:
            pytest.fail(f"{job_id} still {body['job_status']}: {client.get(f'/v1/megatron/train/{job_id}/logs').text[-3000:]}")
        time.sleep(0.5)


def test_an_uncached_hub_id_is_a_400_naming_it_and_nothing_is_written(client: TestClient, settings: Settings) -> None:
    response = _submit(client, CHATS, {"llm_name": "tiny-org/not-cached", "max_steps": 1})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert "'tiny-org/not-cached'" in error["message"] and error["param"] == "llm_name"
    assert not settings.jobs_dir.exists() or not any(settings.jobs_dir.iterdir())


def test_a_cached_hub_id_trains_and_publishes_a_real_checkpoint(
    client: TestClient, settings: Settings, hub: tuple[Path, Path]
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, snapshot = hub
    params = {"llm_name": REPO_ID, "adapter_type": "full", "max_steps": 2, "learning_rate": 1e-3, "max_seq_len": 64,
              "dtype": "float32", "gpus": 0}  # fmt: skip
    response = _submit(client, CHATS, params)
    assert response.status_code == 200, response.text
    assert response.json()["job_config"]["base_model"] == str(snapshot)
    job_id = response.json()["job_status"]["job_id"]
    final = _wait(client, job_id)
    assert final["job_status"]["status"] == "COMPLETED", final
    step = settings.jobs_dir / job_id / "checkpoints" / "step-2"

    source = hf_io.source_dtypes(snapshot)
    assert hf_io.source_dtypes(step) == source and set(source.values()) == {torch.bfloat16}
    for name in SUPPORT_FILES:
        assert (step / name).is_file(), name
    assert json.loads((step / "config.json").read_text()).get("dtype", "bfloat16") == "bfloat16"
    model = AutoModelForCausalLM.from_pretrained(step)
    assert model.dtype == torch.bfloat16
    trained = hf_io.load_weights(step)
    base = hf_io.load_weights(snapshot)
    assert any(not torch.equal(trained[k], base[k]) for k in base)  # it did train
    tokenizer = AutoTokenizer.from_pretrained(step)
    assert tokenizer.apply_chat_template(CHATS[0]["messages"], tokenize=False) == AutoTokenizer.from_pretrained(
        snapshot
    ).apply_chat_template(CHATS[0]["messages"], tokenize=False)
