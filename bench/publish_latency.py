"""Publish->serve latency: from the end of an optimizer step to the first response stamped with the new version,
divided by the floor: writing and reading the same bytes as safetensors on the same disk (measured in each round just
before its publish and just after its answer, so both sides meet the disk as it is during the rounds: this disk's
write times drift by 4x over minutes; the fastest of those, against the median publish->serve), plus one request's
latency through the same queue and engine on weights already loaded (what any answer costs), so a swap that
adds nothing beyond its bytes and one answer scores 1.0.

One process: a ~40M-param model, the real SQLite queue whose catalog reads the job's published
checkpoints (the file-poll path), and the worker's pull loop on an in-process vLLM engine. Each round
perturbs the weights (standing in for a step), publishes them with `checkpoint.publish_step` and the trainer's
own writers (`training.hf_io.write_checkpoint`, `training.lora.write_adapter`), then sends one request for the
job until a result carries the new version. Full weights and LoRA are reported apart, and
full weights again as the trainer publishes them on the serving host: staged in /dev/shm, served from there, the
durable copy landing in the background (`checkpoint.staging`); `publish_blocks_step_seconds_*` is how long the
"trainer" waited before it could take its next step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ENGINE_ENV, merge_results

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def floor_seconds(tensors: dict[str, Any], folder: Path) -> float:
    """Time to write `tensors` as safetensors (fsynced) and read them back, on the same disk."""
    from safetensors.torch import load_file, save_file

    path = folder / "floor.safetensors"
    start = time.perf_counter()
    save_file(tensors, str(path))
    with open(path, "rb") as fh:
        os.fsync(fh.fileno())
    load_file(str(path))
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def published_tensors(model: Any, kind: str) -> dict[str, Any]:
    """A copy of the tensors a publish of `model` writes (the whole model, or the LoRA adapter)."""
    state = adapter_tensors(model) if kind == "lora" else model.state_dict()
    return {k: v.detach().contiguous().clone() for k, v in state.items()}


def _catalog(job: Any, kind: str, base: Any) -> Callable[[], list[Any]]:
    """The control plane's view of the job: its newest servable step, staged or durable (read on every call)."""
    from scalarlm.checkpoint.staging import servable_step
    from scalarlm.protocol.generate import ModelVersion

    def models() -> list[Any]:
        newest = servable_step(job)
        if newest is None:
            return [base]
        step, path = newest
        return [base, ModelVersion(name=job.job_id, version=step, kind=kind, path=str(path))]

    return models


async def measure(kind: str, model: Any, engine: Any, settings: Any, home: Path, rounds: int,
                  staging: Path | None = None) -> dict[str, float]:
    """Median publish->serve seconds over `rounds` publishes of `model` (HF or PEFT), and its floor; with `staging`
    full weights are staged there and land in the background, as a trainer on the serving host does."""
    import torch

    from scalarlm.checkpoint.jobdir import JobDir
    from scalarlm.checkpoint.publish import publish_step
    from scalarlm.inference.pull_loop import PullLoop
    from scalarlm.protocol.generate import ModelVersion
    from scalarlm.protocol.training import CheckpointManifest
    from scalarlm.queue.service import QueueService
    from scalarlm.queue.store import RequestQueue

    from scalarlm.checkpoint.staging import StagedPublisher

    label = kind + ("-staged" if staging is not None else "")
    job = JobDir.under(home / "jobs", f"bench-{label}")
    publisher = StagedPublisher(job, staging, lambda step: None) if staging is not None else None
    publish = publisher.publish if publisher is not None else publish_step
    base = ModelVersion(name=settings.base_model_name, version=0, kind="base", path=settings.model)
    service = QueueService(RequestQueue(home / f"{label}.sqlite", 300.0), models=_catalog(job, kind, base))
    loop = PullLoop(engine, service, settings, worker_id=f"bench-{label}")
    loop.start()
    params = [p for n, p in model.named_parameters() if kind == "full" or "lora_" in n]
    write = writer(model, kind, Path(settings.model))  # the state is read from the model at each publish
    latencies, writes, floors = [], [], []
    try:
        for step in range(1, rounds + 1):
            with torch.no_grad():  # the "optimizer step"
                for p in params:
                    p.add_(0.01 * torch.randn_like(p))
            manifest = CheckpointManifest(job_id=job.job_id, step=step, base_model=settings.model, kind=kind)
            tensors = published_tensors(model, kind)
            floors.append(floor_seconds(tensors, home))
            megabytes = sum(t.numel() * t.element_size() for t in tensors.values()) / 1e6
            start = time.perf_counter()
            publish(job, manifest, write)
            written = time.perf_counter()
            while True:
                batch = await service.enqueue([{"prompt": "Hello", "sampling": {"max_tokens": 1}}], model=job.job_id)
                result = (await service.wait_results(batch.request_ids, 120.0))[0]
                if result.error:
                    raise RuntimeError(f"{kind} request failed: {result.error}")
                if result.version == step:
                    break
            latencies.append(time.perf_counter() - start)
            writes.append(written - start)
            floors.append(floor_seconds(tensors, home))
            del tensors
        answer = await _request_seconds(service, job.job_id, rounds)
    finally:
        if publisher is not None:
            publisher.wait()
        await loop.stop()
        service.close()
    io = min(floors)  # a floor: the fastest this disk wrote and read these bytes during the rounds
    floor = io + answer
    latency = statistics.median(latencies)
    print(f"{label}: {megabytes:.1f} MB, publish->serve {latency:.3f}s (write {statistics.median(writes):.3f}s), "
          f"floor {floor:.3f}s (write+read {io:.3f}s + one answer {answer:.3f}s), ratio {latency / floor:.2f}; "
          f"swaps {engine.load.swaps}")
    return {"latency": latency, "floor": floor, "blocks": statistics.median(writes)}


def adapter_tensors(model: Any) -> dict[str, Any]:
    """PEFT's adapter_model.safetensors keys -> tensors sharing the live LoRA parameters' storage, found once: the
    trainer's `lora.peft_state` walks its layers' adapter pairs straight away, while PEFT's
    `get_peft_model_state_dict` walks the whole model's state dict and filters it (7.4 ms a call on this model),
    a cost of the stand-in that our trainer's publish does not have."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def writer(model: Any, kind: str, base: Path) -> Callable[[Path], None]:
    """What the trainer writes for a step of `model` (HF, or PEFT for `lora`), with its own writers."""
    from scalarlm.training import hf_io, lora

    if kind == "lora":
        live = adapter_tensors(model)
        config = json.loads(json.dumps(model.peft_config["default"].to_dict(), default=sorted))  # sets: lists
        return lambda dest: lora.write_adapter(dest, dict(live), config, base)
    config = model.config.to_dict()

    def write_full(dest: Path) -> None:
        hf_io.write_checkpoint(dest, {k: v.detach() for k, v in model.state_dict().items()}, base, config)

    return write_full


async def _request_seconds(service: Any, model: str, rounds: int) -> float:
    """Median time of one request through the queue and engine on weights already loaded (no publish between)."""
    times = []
    for _ in range(max(3, rounds)):
        start = time.perf_counter()
        batch = await service.enqueue([{"prompt": "Hello", "sampling": {"max_tokens": 1}}], model=model)
        await service.wait_results(batch.request_ids, 120.0)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


async def run(rounds: int) -> dict[str, float]:
    """Build the model and engine, measure full then LoRA."""
    from scalarlm.inference.process_env import configure_vllm_process_env

    configure_vllm_process_env()
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from scalarlm.cli.tiny_model import make_tiny_model
    from scalarlm.config import Settings
    from scalarlm.inference.engine import start_engine

    with tempfile.TemporaryDirectory(dir=Path.cwd() / "build") as tmp:
        home = Path(tmp)
        base_dir = make_tiny_model(home / "base", hidden=512, layers=9, heads=8, vocab=1024, intermediate=2048)
        settings = Settings(
            model=str(base_dir), served_model_name="base", home=home / "home",
            engine={"dtype": "float32", "kv_cache_bytes": 1 << 30, "max_model_len": 512, "max_num_seqs": 32,
                    "enforce_eager": True, "enable_lora": True, "max_loras": 4, "max_lora_rank": 8},
        )  # fmt: skip
        engine = start_engine(settings)
        try:
            full_model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            params = sum(p.numel() for p in full_model.parameters())
            print(f"model: {params / 1e6:.1f}M params")
            full = await measure("full", full_model, engine, settings, home, rounds)
            shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else home
            with tempfile.TemporaryDirectory(dir=shm, prefix="bench-staging-") as staging:
                staged = await measure("full", full_model, engine, settings, home, rounds, Path(staging))
            del full_model
            lora_base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
            lora_model = get_peft_model(lora_base, LoraConfig(r=8, lora_alpha=16, target_modules=LORA_TARGETS))
            lora = await measure("lora", lora_model, engine, settings, home, rounds)
        finally:
            engine.shutdown()
    return {
        "publish_to_serve_vs_floor_full": round(full["latency"] / full["floor"], 3),
        "publish_to_serve_vs_floor_lora": round(lora["latency"] / lora["floor"], 3),
        "publish_to_serve_vs_floor_full_staged": round(staged["latency"] / staged["floor"], 3),
        "publish_to_serve_seconds_full": round(full["latency"], 4),
        "publish_to_serve_seconds_full_staged": round(staged["latency"], 4),
        "publish_blocks_step_seconds_full": round(full["blocks"], 4),
        "publish_blocks_step_seconds_full_staged": round(staged["blocks"], 4),
        "publish_to_serve_seconds_lora": round(lora["latency"], 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=5)
    args, _ = parser.parse_known_args()
    for key, value in ENGINE_ENV.items():
        os.environ.setdefault(key, value)
    (Path.cwd() / "build").mkdir(exist_ok=True)
    figures = asyncio.run(run(args.rounds))
    for key, value in figures.items():
        print(f"{key}={value}")
    merge_results(figures)


if __name__ == "__main__":
    main()
