"""Hot-swap on the shared real engine: full weights and LoRA adapters answer exactly as transformers/PEFT.

Every test leaves the base weights loaded (later tests of the session assume them).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest
from swap_checkpoints import transformers_greedy, write_full_checkpoint, write_lora_checkpoint

pytestmark = pytest.mark.asyncio(loop_scope="session")

PROMPTS = ["Hello, how are you", "The capital of France is", "12 + 7 ="]
TOKENS = 8
RESULT_TIMEOUT = 240.0


async def _completion(backend: Any, model: str, prompt: str) -> dict[str, Any]:
    reply = await backend.openai(
        "completions", {"model": model, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0,
                        "ignore_eos": True, "return_token_ids": True},
    )
    assert reply.status_code == 200, reply.body
    return reply.body


async def _run_queue(engine: Any, settings: Any, path: Path, catalog: list[Any],
                     batches: list[tuple[str, list[str]]]) -> tuple[list[list[Any]], Any]:
    """Enqueue each (model, prompts) batch in order, run a PullLoop until done; results per batch, the loop."""
    from scalarlm.inference.pull_loop import PullLoop
    from scalarlm.queue.service import QueueService
    from scalarlm.queue.store import RequestQueue

    queue = RequestQueue(path, lease_seconds=settings.generate.lease_seconds)
    service = QueueService(queue, idle_wait=0.05, models=lambda: catalog)
    sampling = {"max_tokens": TOKENS, "ignore_eos": True}
    enqueued = [await service.enqueue([{"prompt": p, "sampling": sampling} for p in prompts], model=model)
                for model, prompts in batches]
    loop = PullLoop(engine, service, settings, worker_id="swap-worker")
    loop.start()
    total = sum(b.count for b in enqueued)
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT
        while True:
            counts = await service.counts()
            if counts.completed + counts.failed >= total or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        results = [await service.get(b.request_ids) for b in enqueued]
    finally:
        await loop.stop()
        await _restore_base(loop.weights, settings)
        service.close()
    return results, loop


async def _restore_base(weights: Any, settings: Any) -> None:
    """Swap the base weights back in (a no-op when they are loaded)."""
    lease = await weights.acquire(settings.base_model_name)
    weights.release(lease)


def _tokens(result: Any) -> list[int]:
    assert result.status == "completed", result.error
    return list(result.outputs[0].token_ids)


async def test_full_weight_swap_matches_transformers_and_swaps_back(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    ckpt = write_full_checkpoint(tiny_model_dir, tmp_path / "ft-full" / "step-3", seed=11, step=3)
    expected_ft = transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, full=ckpt)
    expected_base = transformers_greedy(tiny_model_dir, PROMPTS, TOKENS)
    assert expected_ft != expected_base

    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    backend.weights.update_catalog([ModelVersion(name="ft-full", version=3, kind="full", path=str(ckpt))])
    swaps_before = backend.load().swaps
    try:
        before = [await _completion(backend, "tiny", p) for p in PROMPTS]
        after = [await _completion(backend, "ft-full", p) for p in PROMPTS]
        back = [await _completion(backend, "tiny", p) for p in PROMPTS]
    finally:
        await _restore_base(backend.weights, inference_settings)

    assert [b["choices"][0]["token_ids"] for b in before] == expected_base
    assert [b["choices"][0]["token_ids"] for b in after] == expected_ft
    assert [b["choices"][0]["token_ids"] for b in back] == expected_base
    assert all(b["model"] == "ft-full" and b["scalarlm_version"] == 3 for b in after)
    assert all(b["system_fingerprint"] == "scalarlm-ft-full-v3" for b in after)
    assert all(b["model"] == "tiny" and b["scalarlm_version"] == 0 for b in before + back)
    load = backend.load()
    assert load.swaps - swaps_before == 2 and load.swap_seconds > 0


async def test_two_lora_adapters_in_a_mixed_batch_each_match_peft(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.protocol.generate import ModelVersion

    lora_a = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-a" / "step-2", seed=1, step=2)
    lora_b = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-b" / "step-5", seed=2, step=5)
    expected = {
        "tiny": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS),
        "job-a": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, lora=lora_a),
        "job-b": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, lora=lora_b),
    }
    assert len({str(v) for v in expected.values()}) == 3
    catalog = [
        ModelVersion(name="tiny", version=0, kind="base", path=str(tiny_model_dir)),
        ModelVersion(name="job-a", version=2, kind="lora", path=str(lora_a)),
        ModelVersion(name="job-b", version=5, kind="lora", path=str(lora_b)),
    ]
    # The queue leases one model per batch; the loop keeps several leases in the engine at once,
    # so base and both adapters run in the same engine steps.
    batches = [(m, PROMPTS) for m in ("job-a", "tiny", "job-b", "tiny", "job-a", "job-b")]
    results, loop = await _run_queue(vllm_engine, inference_settings, tmp_path / "q.sqlite", catalog, batches)
    loaded = loop.versions.loaded()
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, loop.versions, loop.weights)
    try:
        listed = (await backend.openai("models", {})).body
        interactive = await _completion(backend, "job-b", PROMPTS[0])
    finally:
        await loop.weights.unload_adapters()

    for (model, _), batch in zip(batches, results):
        assert [_tokens(r) for r in batch] == expected[model], model
        assert all(r.model == model for r in batch)
        assert all(r.version == {"tiny": 0, "job-a": 2, "job-b": 5}[model] for r in batch)
    assert loaded == {"tiny": 0, "job-a": 2, "job-b": 5}
    assert loop.versions.loaded() == {"tiny": 0}  # unloaded again
    assert {"tiny", "job-a", "job-b"} <= {m["id"] for m in listed["data"]}
    assert interactive["choices"][0]["token_ids"] == expected["job-b"][0]
    assert interactive["scalarlm_version"] == 5 and interactive["model"] == "job-b"


async def test_full_fine_tune_and_base_interleaved_through_the_queue(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    from scalarlm.protocol.generate import ModelVersion

    ckpt = write_full_checkpoint(tiny_model_dir, tmp_path / "job-ft" / "step-7", seed=5, step=7)
    expected = {
        "tiny": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS),
        "job-ft": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, full=ckpt),
    }
    catalog = [
        ModelVersion(name="tiny", version=0, kind="base", path=str(tiny_model_dir)),
        ModelVersion(name="job-ft", version=7, kind="full", path=str(ckpt)),
    ]
    swaps_before = vllm_engine.load.swaps
    batches = [(m, PROMPTS) for m in ("tiny", "job-ft", "tiny", "job-ft", "tiny")]
    results, loop = await _run_queue(vllm_engine, inference_settings, tmp_path / "q.sqlite", catalog, batches)

    for (model, _), batch in zip(batches, results):
        assert [_tokens(r) for r in batch] == expected[model], model
        assert all(r.model == model and r.version == (7 if model == "job-ft" else 0) for r in batch)
    swaps = vllm_engine.load.swaps - swaps_before
    assert 2 <= swaps <= 4  # at least there and back; the queue groups by model, so never one per request
    assert vllm_engine.load.snapshot().swaps == vllm_engine.load.swaps


async def _openai_completion(backend: Any, entry: Any, prompt: str) -> Any:
    """An OpenAI completion carrying the control plane's model entry, as the control plane sends it."""
    body = {"model": entry.name, "prompt": prompt, "max_tokens": TOKENS, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True}  # fmt: skip
    return await backend.openai("completions", body, entry)


async def test_openai_request_loads_a_model_no_get_work_has_named(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """Issue 16: the OpenAI path swaps in a newly listed model itself (full weights and LoRA, streams too)."""
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    full = write_full_checkpoint(tiny_model_dir, tmp_path / "job-f" / "step-4", seed=21, step=4)
    lora = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-l" / "step-9", seed=22, step=9)
    entries = {"job-f": ModelVersion(name="job-f", version=4, kind="full", path=str(full)),
               "job-l": ModelVersion(name="job-l", version=9, kind="lora", path=str(lora))}  # fmt: skip
    expected = {"job-f": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, full=full),
                "job-l": transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, lora=lora)}  # fmt: skip
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    try:
        replies = {name: [await _openai_completion(backend, entry, p) for p in PROMPTS]
                   for name, entry in entries.items()}  # fmt: skip
        stream = await backend.openai("completions", {"model": "job-f", "prompt": PROMPTS[0], "max_tokens": TOKENS,
                                                      "temperature": 0.0, "ignore_eos": True, "stream": True},
                                      entries["job-f"])  # fmt: skip
        events = [chunk async for chunk in stream.stream]
    finally:
        await backend.weights.unload_adapters()
        await _restore_base(backend.weights, inference_settings)

    for name, batch in replies.items():
        assert [r.status_code for r in batch] == [200] * len(PROMPTS), batch[0].body
        assert [r.body["choices"][0]["token_ids"] for r in batch] == expected[name], name
        assert all(r.body["model"] == name and r.body["scalarlm_version"] == entries[name].version for r in batch)
    text = b"".join(events).decode()
    assert '"scalarlm_version":4' in text and '"model":"job-f"' in text and "data: [DONE]" in text


async def test_listed_model_that_cannot_be_loaded_answers_why_and_the_base_still_serves(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path, family_models: dict[str, Path]
) -> None:
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    broken = write_full_checkpoint(tiny_model_dir, tmp_path / "job-broken" / "step-2", seed=3, step=2)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    missing = tmp_path / "job-gone" / "step-1"  # an adapter whose files were deleted
    expected_base = transformers_greedy(tiny_model_dir, PROMPTS[:1], TOKENS)
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    base = ModelVersion(name="tiny", version=0, kind="base", path=str(tiny_model_dir))
    try:
        full = await _openai_completion(backend, ModelVersion(name="job-broken", version=2, kind="full",
                                                              path=str(broken)), PROMPTS[0])  # fmt: skip
        lora = await _openai_completion(backend, ModelVersion(name="job-gone", version=1, kind="lora",
                                                              path=str(missing)), PROMPTS[0])  # fmt: skip
        # A checkpoint of another architecture (mixture of experts into this dense engine): refused before vLLM tries.
        moe = family_models["qwen3-moe"]
        experts = await _openai_completion(backend, ModelVersion(name="job-moe", version=1, kind="full",
                                                                 path=str(moe)), PROMPTS[0])  # fmt: skip
        after = await _openai_completion(backend, base, PROMPTS[0])
    finally:
        await _restore_base(backend.weights, inference_settings)

    assert "['Qwen3MoeForCausalLM'] (4 experts) is not the served base's" in experts.body["error"]["message"]
    for reply, name, path in ((full, "job-broken", broken), (lora, "job-gone", missing), (experts, "job-moe", moe)):
        assert reply.status_code == 500, reply.body
        error = reply.body["error"]
        assert error["type"] == "model_load_error" and error["param"] == "model"
        assert f"model '{name}'" in error["message"] and str(path) in error["message"], error["message"]
    assert after.status_code == 200
    assert [after.body["choices"][0]["token_ids"]] == expected_base


async def test_an_engine_without_lora_slots_serves_each_adapter_version_merged_into_the_base(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A mixture-of-experts model on CPU gets no LoRA slots (`engine.lora_enabled`): its adapters are served merged
    into the base, swapped in as full weights. Here the shared engine's manager is told it has none."""
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    first = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-m" / "step-2", seed=31, step=2)
    second = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-m" / "step-4", seed=32, step=4)
    broken = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-x" / "step-1", seed=33, step=1)
    (broken / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}")
    expected = [transformers_greedy(tiny_model_dir, PROMPTS, TOKENS, lora=path) for path in (first, second)]
    expected_base = transformers_greedy(tiny_model_dir, PROMPTS, TOKENS)
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    backend.weights.lora_slots = 0
    merged = inference_settings.home / "merged-adapters"
    versions = [ModelVersion(name="job-m", version=2, kind="lora", path=str(first)),
                ModelVersion(name="job-m", version=4, kind="lora", path=str(second))]  # fmt: skip
    try:
        replies, held = [], []
        for entry in versions:
            replies.append([await _openai_completion(backend, entry, p) for p in PROMPTS])
            held.append(sorted(p.name for p in merged.iterdir()))
        failed = await _openai_completion(backend, ModelVersion(name="job-x", version=1, kind="lora",
                                                                path=str(broken)), PROMPTS[0])  # fmt: skip
        still = await _openai_completion(backend, versions[1], PROMPTS[0])
        base = [await _completion(backend, "tiny", p) for p in PROMPTS]
    finally:
        await _restore_base(backend.weights, inference_settings)

    assert expected[0] != expected[1] != expected_base
    for entry, batch, tokens in zip(versions, replies, expected, strict=True):
        assert [r.status_code for r in batch] == [200] * len(PROMPTS), batch[0].body
        assert [r.body["choices"][0]["token_ids"] for r in batch] == tokens  # = PEFT on the adapter
        assert all(r.body["model"] == "job-m" and r.body["scalarlm_version"] == entry.version for r in batch)
    assert held == [["job-m-v2"], ["job-m-v4"]]  # one merged copy at a time: the one the engine holds
    assert failed.status_code == 500 and failed.body["error"]["type"] == "model_load_error"
    assert "could not be merged into the base" in failed.body["error"]["message"], failed.body
    assert still.status_code == 200 and [still.body["choices"][0]["token_ids"]] == expected[1][:1]
    assert [b["choices"][0]["token_ids"] for b in base] == expected_base
    assert list(merged.iterdir()) == []  # the base is the base's own files


async def test_an_adapter_is_merged_while_the_engine_serves_what_it_holds(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path, monkeypatch: Any
) -> None:
    """Without LoRA slots an adapter is merged before its swap takes its turn: a request for the weights the engine
    holds is answered while the merge runs, and two requests for one adapter version share one merge. (The merge is
    the real one, held at its start until the base request has been answered.)"""
    import threading

    from scalarlm.inference import hot_swap
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    started, go_on, merges, merge_lora = threading.Event(), threading.Event(), [], hot_swap.merge_lora

    def held_merge(base: Path, adapter: Path, dest: Path) -> None:
        merges.append(adapter)
        started.set()
        go_on.wait(300)
        merge_lora(base, adapter, dest)

    monkeypatch.setattr(hot_swap, "merge_lora", held_merge)
    adapter = write_lora_checkpoint(tiny_model_dir, tmp_path / "job-g" / "step-1", seed=34, step=1)
    expected = transformers_greedy(tiny_model_dir, PROMPTS[:1], TOKENS, lora=adapter)
    expected_base = transformers_greedy(tiny_model_dir, PROMPTS[:1], TOKENS)
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    backend.weights.lora_slots = 0
    entry = ModelVersion(name="job-g", version=1, kind="lora", path=str(adapter))
    try:
        adapted = [asyncio.ensure_future(_openai_completion(backend, entry, PROMPTS[0])) for _ in range(2)]
        assert await asyncio.to_thread(started.wait, 300)
        base = await asyncio.wait_for(_completion(backend, "tiny", PROMPTS[0]), 300)  # (before: waited on the merge)
        pending = not any(request.done() for request in adapted)
        go_on.set()
        replies = [await request for request in adapted]
    finally:
        go_on.set()
        await _restore_base(backend.weights, inference_settings)

    assert expected != expected_base
    assert base["choices"][0]["token_ids"] == expected_base[0] and pending
    assert len(merges) == 1  # one merge for both requests
    for reply in replies:
        assert reply.status_code == 200, reply.body
        assert [reply.body["choices"][0]["token_ids"]] == expected  # = PEFT on the adapter


async def test_a_request_that_waited_for_a_swap_gets_the_newest_version_stamped_as_loaded(
    vllm_engine: Any, inference_settings: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A request for a fine-tune waits for the engine's in-flight requests to drain; a version published meanwhile is
    what the swap loads, and the reply is stamped with it (a reply's version is the weights that produced it)."""
    from scalarlm.inference.openai_backend import VllmOpenAIBackend
    from scalarlm.inference.versions import ModelVersions
    from scalarlm.protocol.generate import ModelVersion

    first = write_full_checkpoint(tiny_model_dir, tmp_path / "job-r" / "step-1", seed=41, step=1)
    second = write_full_checkpoint(tiny_model_dir, tmp_path / "job-r" / "step-2", seed=42, step=2)
    expected = [transformers_greedy(tiny_model_dir, PROMPTS[:1], TOKENS, full=path)[0] for path in (first, second)]
    backend = VllmOpenAIBackend(inference_settings)
    await backend.attach(vllm_engine, ModelVersions(inference_settings.base_model_name))
    weights = backend.weights
    weights.update_catalog([ModelVersion(name="job-r", version=1, kind="full", path=str(first))])
    in_flight = await weights.acquire(inference_settings.base_model_name)  # a request on the base, not yet done
    try:
        waiting = asyncio.ensure_future(_completion(backend, "job-r", PROMPTS[0]))
        while not weights._swap_lock.locked():  # it waits for the drain
            await asyncio.sleep(0.01)
        weights.update_catalog([ModelVersion(name="job-r", version=2, kind="full", path=str(second))])
        weights.release(in_flight)
        reply = await waiting
    finally:
        weights.release(in_flight)
        await _restore_base(weights, inference_settings)

    assert expected[0] != expected[1]
    assert reply["choices"][0]["token_ids"] == expected[1] and reply["scalarlm_version"] == 2
