"""Export of a trained model: the merged LoRA export equals PEFT's `merge_and_unload()` (logits), the adapter export
loads in PEFT, and both serve from stock vLLM (published into the running server, as the trainer publishes)."""

from __future__ import annotations

import io
import json
import shutil
import tarfile
from pathlib import Path
from typing import Any

import httpx
import pytest
from console_server import Server

from scalarlm.checkpoint import JobDir, publish_step
from scalarlm.checkpoint.export import merge_lora
from scalarlm.protocol.training import CheckpointManifest, JobStatus

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, how are you", "What is 3 + 1?"]
TOKENS = 6


def fetch_export(server: Server, job: str, **params: Any) -> Path:
    """GET the export tar and return the directory it unpacks to."""
    r = httpx.get(f"{server.url}/v1/megatron/train/{job}/export", params=params, timeout=300,
                  headers={"Authorization": f"Bearer {server.key}"})  # fmt: skip
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "application/x-tar"
    return r.content and _unpack(r.content, server.home.parent / "unpacked")


def _unpack(blob: bytes, root: Path) -> Path:
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        (top,) = {m.name.split("/")[0] for m in tar.getmembers()}
        shutil.rmtree(root / top, ignore_errors=True)
        tar.extractall(root, filter="data")
    return root / top


def _logits(model: Any, ids: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(ids).logits


@pytest.fixture(scope="module")
def exports(server: Server, lora_job: str) -> dict[str, Path]:
    return {"merged": fetch_export(server, lora_job, merged="true"), "adapter": fetch_export(server, lora_job)}


def test_merged_export_equals_peft_merge_and_unload(exports: dict[str, Path], tiny_model_dir: Path,
                                                    lora_job: str) -> None:  # fmt: skip
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged_dir = exports["merged"]
    assert merged_dir.name == f"{lora_job}-step4-merged"
    assert json.loads((merged_dir / "export.json").read_text())["kind"] == "full"
    assert not (merged_dir / "adapter_config.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, exports["adapter"]).merge_and_unload().eval()
    ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (2, 32), generator=torch.Generator().manual_seed(0))
    want, got = _logits(reference, ids), _logits(ours, ids)
    assert (want - got).abs().max().item() < 1e-5
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    assert set(ref_state) == set(our_state)
    original = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    changed = [k for k in ref_state if not torch.equal(ref_state[k], original[k])]
    assert changed  # the adapter moved something
    assert max((ref_state[k] - our_state[k]).abs().max().item() for k in ref_state) < 1e-6


def test_adapter_export_loads_in_peft(exports: dict[str, Path], tiny_model_dir: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    adapter = exports["adapter"]
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == tiny_model_dir.name  # no server path leaks out
    assert not (adapter / "manifest.json").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    peft = PeftModel.from_pretrained(base, adapter).eval()
    merged = AutoModelForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32).eval()
    ids = torch.randint(0, 500, (1, 24), generator=torch.Generator().manual_seed(1))
    assert (_logits(peft, ids) - _logits(merged, ids)).abs().max().item() < 1e-5


def _publish(home: Path, job_id: str, kind: str, source: Path, base: Path) -> None:
    """Publish an export as step 1 of `job_id` in the server's home, the way the trainer publishes."""
    job = JobDir.under(home / "jobs", job_id)
    job.create()

    def write(tmp: Path) -> None:
        for f in source.iterdir():
            shutil.copy(f, tmp / f.name)

    publish_step(job, CheckpointManifest(job_id=job_id, step=1, base_model=str(base), kind=kind), write)
    job.write_status(JobStatus(job_id=job_id, status="COMPLETED", step=1, max_steps=1))


def _greedy(model_dir: Path, tokenizer_dir: Path) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    for prompt in PROMPTS:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        tokens: list[int] = []
        for _ in range(TOKENS):
            nxt = int(_logits(model, ids)[0, -1].argmax())
            tokens.append(nxt)
            ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
        out.append(tokens)
    return out


def test_both_exports_serve_from_vllm(server: Server, exports: dict[str, Path], tiny_model_dir: Path) -> None:
    _publish(server.home, "job-exported-merged", "full", exports["merged"], tiny_model_dir)
    _publish(server.home, "job-exported-adapter", "lora", exports["adapter"], tiny_model_dir)
    expected = _greedy(exports["merged"], tiny_model_dir)
    headers = {"Authorization": f"Bearer {server.key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as http:
        for model in ("job-exported-merged", "job-exported-adapter"):
            served = []
            for prompt in PROMPTS:
                reply = http.post("/v1/completions", json={"model": model, "prompt": prompt, "max_tokens": TOKENS,
                                                           "temperature": 0, "ignore_eos": True,
                                                           "return_token_ids": True})  # fmt: skip
                assert reply.status_code == 200, reply.text
                body = reply.json()
                assert body["model"] == model and body["scalarlm_version"] == 1
                served.append(body["choices"][0]["token_ids"])
            assert served == expected, model


def test_export_refusals_and_export_into_the_home(server: Server, lora_job: str, exports: dict[str, Path]) -> None:
    headers = {"Authorization": f"Bearer {server.key}"}
    with httpx.Client(base_url=server.url, headers=headers, timeout=300) as http:
        assert http.get(f"/v1/megatron/train/{lora_job}/export", headers={"Authorization": ""}).status_code == 401
        missing = http.get(f"/v1/megatron/train/{lora_job}/export", params={"step": 3})
        assert missing.status_code == 404 and "no checkpoint at step 3 (it has [2, 4])" in missing.json()["error"]["message"]
        if not (server.home / "jobs" / "job-exported-merged").exists():
            _publish(server.home, "job-exported-merged", "full", exports["merged"], Path("/nonexistent"))
        refused = http.get("/v1/megatron/train/job-exported-merged/export")
        assert refused.status_code == 400 and "no adapter to export" in refused.json()["error"]["message"]
        written = http.post(f"/v1/megatron/train/{lora_job}/export", json={"merged": True, "step": 2})
        assert written.status_code == 200, written.text
        body = written.json()
        assert body["path"] == str(server.home / "exports" / f"{lora_job}-step2-merged") and body["kind"] == "full"
        assert "model.safetensors" in body["files"] and body["bytes"] > 0
        assert sorted(p.name for p in (server.home / "exports").iterdir()) == [f"{lora_job}-step2-merged"]


def _random_adapter(model, targets: list[str], dest: Path) -> None:
    """A PEFT adapter (r 4, alpha 8) of `model` on `targets` with random A and B, saved to `dest`."""
    import torch
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
    peft.save_pretrained(dest)


def test_bf16_merge_rounds_as_peft_does(tiny_model_dir: Path, tmp_path: Path) -> None:
    """A bf16 base: the NumPy merge is bit-equal to PEFT's merge on CPU (delta rounded to bf16, then the sum)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_dir, adapter_dir, merged_dir = tmp_path / "base", tmp_path / "adapter", tmp_path / "merged"
    AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).save_pretrained(base_dir)
    for f in tiny_model_dir.glob("tokenizer*"):
        shutil.copy(f, base_dir / f.name)
    _random_adapter(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16), ["q_proj", "down_proj"],
                    adapter_dir)  # fmt: skip
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    reference = PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    merge_lora(base_dir, adapter_dir, merged_dir)
    ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.bfloat16)
    ref_state, our_state = reference.state_dict(), ours.state_dict()
    for name, tensor in ref_state.items():
        assert our_state[name].dtype == torch.bfloat16
        assert torch.equal(tensor, our_state[name]), name


def test_merge_of_a_multimodal_gemma3_adapter_names_the_checkpoints_weights(tmp_path: Path) -> None:
    """A PEFT adapter of Gemma 3 4B-27B keys its weights by transformers' module tree (`model.language_model.*`,
    `model.vision_tower.*`), the checkpoint by the hub's names (`language_model.model.*`, `vision_tower.*`): the merge
    adds each delta to the checkpoint's weight, text model and vision tower alike, as PEFT's `merge_and_unload()`."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from scalarlm.cli.tiny_model import FAMILY_TINY_MODELS, make_tiny_model

    base_dir = make_tiny_model(tmp_path / "gemma3-mm", **FAMILY_TINY_MODELS["gemma3-mm"])
    adapter_dir, merged_dir = tmp_path / "adapter", tmp_path / "merged"
    _random_adapter(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), ["q_proj", "down_proj", "fc1"],
                    adapter_dir)  # fmt: skip
    reference = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
                                          adapter_dir).merge_and_unload().state_dict()  # fmt: skip
    merge_lora(base_dir, adapter_dir, merged_dir)
    ours = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).state_dict()
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32).state_dict()
    changed = {name for name in reference if not torch.equal(reference[name], base[name])}
    assert any("vision_tower" in n for n in changed) and any("language_model" in n for n in changed)
    for name, tensor in reference.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=1e-6, msg=name)
