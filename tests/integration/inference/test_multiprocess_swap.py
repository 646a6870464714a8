"""Hot-swap with vLLM's engine core in its own process, as it runs on a GPU (`VLLM_ENABLE_V1_MULTIPROCESSING=1`).

`reload_weights` and `add_lora` then cross a process boundary (vLLM's msgpack RPC). Measured 2026-12: vLLM 0.32's
`AsyncLLM` starts a separate `VLLM::EngineCore` process under `scalarlm serve` even with the variable at 0 (our CPU
default), so every served test crosses that boundary; this one asserts it and pins the GPU setting explicitly. A real `scalarlm serve`
runs in that mode; full-weight and LoRA checkpoints published into its home are served, through the OpenAI
route and the batch queue, with the greedy tokens of `transformers` / PEFT on the same files.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any, Callable

import httpx
import pytest
from swap_checkpoints import transformers_greedy, write_full_checkpoint, write_lora_checkpoint

from scalarlm.checkpoint import JobDir, publish_step
from scalarlm.protocol.training import CheckpointManifest

pytestmark = pytest.mark.slow

PROMPTS = ["Hello, how are you", "The capital of France is"]
TOKENS = 6


def _publish(home: Path, job_id: str, step: int, kind: str, source: Path, base: Path) -> None:
    """Publish `source`'s files as `step` of job `job_id` under `home`, as the trainer does."""
    job = JobDir.under(home / "jobs", job_id)
    job.create()

    def write(tmp: Path) -> None:
        for f in source.iterdir():
            if f.is_file() and f.name != "manifest.json":
                shutil.copy(f, tmp / f.name)

    publish_step(job, CheckpointManifest(job_id=job_id, step=step, base_model=str(base), kind=kind), write)


def _children(pid: int) -> list[str]:
    """The command names of `pid`'s child processes."""
    names = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            names.append((stat.parent / "comm").read_text().strip())
    return names


def test_full_and_lora_swaps_across_the_engine_process_boundary(
    serve_process: Callable[..., Any], tiny_model_dir: Path, tmp_path: Path
) -> None:
    full = write_full_checkpoint(tiny_model_dir, tmp_path / "src-full", seed=41)
    lora = write_lora_checkpoint(tiny_model_dir, tmp_path / "src-lora", seed=42)
    expected = {"tiny": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS),
                "job-full": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, full=full),
                "job-lora": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, lora=lora)}  # fmt: skip
    assert len({str(v) for v in expected.values()}) == 3
    sampling = {"max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    with serve_process(tmp_path, tiny_model_dir, {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}) as (url, home, pid):
        children = _children(pid)
        _publish(home, "job-full", 3, "full", full, tiny_model_dir)
        _publish(home, "job-lora", 5, "lora", lora, tiny_model_dir)
        served: dict[str, list[list[int]]] = {}
        batch: dict[str, list[dict[str, Any]]] = {}
        with httpx.Client(base_url=url, timeout=300) as client:
            for model in ("job-full", "job-lora", "tiny"):
                replies = [client.post("/v1/completions", json={"model": model, "prompt": p, "return_token_ids": True,
                                                                 **sampling}).json() for p in PROMPTS]  # fmt: skip
                served[model] = [r["choices"][0]["token_ids"] for r in replies]
                assert all(r["model"] == model for r in replies), replies[0]
                got = client.post("/v1/generate", json={"prompts": PROMPTS, "model": model, "wait_seconds": 120,
                                                        **sampling})  # fmt: skip
                batch[model] = got.json()["results"]

    assert any(name.startswith("VLLM::EngineCor") for name in children), children  # comm keeps 15 characters
    assert served == expected
    tokenizer = __import__("transformers").AutoTokenizer.from_pretrained(tiny_model_dir)
    for model, results in batch.items():
        version = {"tiny": 0, "job-full": 3, "job-lora": 5}[model]
        assert [(r["model"], r["version"]) for r in results] == [(model, version)] * len(PROMPTS)
        assert [r["response"] for r in results] == [tokenizer.decode(t, skip_special_tokens=True)
                                                    for t in expected[model]], model  # fmt: skip
