"""The pull loop against the real SQLite queue: every item completes, stamped, sampled as asked."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.asyncio(loop_scope="session")

RESULT_TIMEOUT = 240.0  # generous: the box has 2 cores shared with other work


async def _run_batch(engine: Any, settings: Any, path: Path, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Enqueue `items`, run a PullLoop until all are finished, return results by request id."""
    from scalarlm.inference.pull_loop import PullLoop
    from scalarlm.queue.service import QueueService
    from scalarlm.queue.store import RequestQueue

    queue = RequestQueue(path, lease_seconds=settings.generate.lease_seconds)
    service = QueueService(queue, idle_wait=0.05)
    batch = await service.enqueue(items, model=settings.base_model_name)
    loop = PullLoop(engine, service, settings, worker_id="test-worker")
    loop.start()
    try:
        deadline = time.monotonic() + RESULT_TIMEOUT
        while True:
            counts = await service.counts()
            if counts.completed + counts.failed >= batch.count or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
    finally:
        await loop.stop()
    results = await service.get(batch.request_ids)
    service.close()
    return {str(int(r.request_id.rsplit("_", 1)[-1])): r for r in results}


async def test_batch_of_300_completes_with_sampling_honoured(
    vllm_engine: Any, inference_settings: Any, tmp_path: Path
) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(292)]
    items: list[dict[str, Any]] = [{"prompt": p, "sampling": {"max_tokens": 6}} for p in prompts]
    # Seeded sampling is reproducible; temperature > 0 departs from greedy somewhere.
    for i in range(4):
        items.append({"prompt": prompts[i], "sampling": {"max_tokens": 12, "temperature": 1.0, "seed": 7}})
    items.append({"prompt": prompts[0], "sampling": {"max_tokens": 12, "temperature": 1.0, "seed": 7}})
    items.append({"prompt": prompts[0], "sampling": {"max_tokens": 12}})  # greedy twin of the above
    items.append({"prompt": prompts[1], "sampling": {"max_tokens": 5, "logprobs": 3}})
    items.append({"messages": [{"role": "user", "content": "Say hi"}], "sampling": {"max_tokens": 4, "n": 2, "temperature": 0.8}})
    items.append({"prompt": "word " * 3000, "sampling": {}})  # longer than max_model_len
    assert len(items) == 301

    results = await _run_batch(vllm_engine, inference_settings, tmp_path / "queue.sqlite", items)

    assert len(results) == 301
    too_long = results["300"]
    assert too_long.status == "failed"
    assert "maximum context length" in (too_long.error or "")
    done = [r for k, r in results.items() if k != "300"]
    assert all(r.status == "completed" for r in done), [r.error for r in done if r.status != "completed"][:3]
    assert all(r.model == "tiny" and r.version == 0 for r in done)
    assert all(r.response is not None and r.completion_tokens and r.prompt_tokens for r in done)
    assert all(r.completion_tokens == 6 for k, r in results.items() if int(k) < 292 and r.finish_reason == "length")

    seeded_first, seeded_again, greedy = results["292"], results["296"], results["297"]
    assert seeded_first.outputs[0].token_ids == seeded_again.outputs[0].token_ids
    sampled = [results[str(292 + i)].outputs[0].token_ids for i in range(4)]
    greedy_same_prompt = [results[str(i)].outputs[0].token_ids for i in range(4)]
    assert seeded_first.outputs[0].token_ids != greedy.outputs[0].token_ids or any(
        s[:6] != g for s, g in zip(sampled, greedy_same_prompt)
    )

    with_logprobs = results["298"]
    assert with_logprobs.logprobs is not None and len(with_logprobs.logprobs) == with_logprobs.completion_tokens
    assert all(lp <= 0.0 for lp in with_logprobs.logprobs)
    assert with_logprobs.outputs[0].cumulative_logprob == pytest.approx(sum(with_logprobs.logprobs), abs=1e-3)
    # Greedy: at each position the sampled token is the most likely of the 3 asked for.
    top = with_logprobs.outputs[0].top_logprobs
    assert top is not None and [len(p) for p in top] == [3] * len(with_logprobs.logprobs)
    assert [p[0].token_id for p in top] == with_logprobs.outputs[0].token_ids
    assert [p[0].logprob for p in top] == with_logprobs.logprobs
    assert all(p[0].logprob >= p[1].logprob >= p[2].logprob and p[0].token is not None for p in top)
    assert results["0"].logprobs is None and results["0"].outputs[0].top_logprobs is None

    chat = results["299"]
    assert chat.outputs is not None and len(chat.outputs) == 2

    assert vllm_engine.load.in_flight == 0


async def test_unknown_model_item_fails_alone(vllm_engine: Any, inference_settings: Any, tmp_path: Path) -> None:
    items = [{"prompt": "hello", "sampling": {}}, {"prompt": "hello", "model": "no-such-model", "sampling": {}}]
    results = await _run_batch(vllm_engine, inference_settings, tmp_path / "queue.sqlite", items)
    assert results["0"].status == "completed"
    assert results["1"].status == "failed" and "no-such-model" in (results["1"].error or "")


@pytest.mark.slow
async def test_batch_of_10000_completes(vllm_engine: Any, inference_settings: Any, tmp_path: Path) -> None:
    items = [{"prompt": f"Item {i} says", "sampling": {"max_tokens": 2}} for i in range(10_000)]
    results = await _run_batch(vllm_engine, inference_settings, tmp_path / "queue.sqlite", items)
    assert len(results) == 10_000
    assert sum(r.status == "completed" for r in results.values()) == 10_000
    assert all(r.version == 0 and r.completion_tokens for r in results.values())


async def test_stop_finishes_and_posts_every_leased_item(
    vllm_engine: Any, inference_settings: Any, tmp_path: Path
) -> None:
    from scalarlm.inference.pull_loop import PullLoop
    from scalarlm.queue.service import QueueService
    from scalarlm.queue.store import RequestQueue

    service = QueueService(RequestQueue(tmp_path / "queue.sqlite"), idle_wait=0.05)
    await service.enqueue([{"prompt": f"Story {i}:", "sampling": {"max_tokens": 24, "ignore_eos": True}}
                           for i in range(400)], model=inference_settings.base_model_name)
    loop = PullLoop(vllm_engine, service, inference_settings, worker_id="stopping-worker")
    loop.start()
    for _ in range(400):
        if loop.in_flight > 0:
            break
        await asyncio.sleep(0.025)
    assert loop.in_flight > 0
    await loop.stop()

    counts = await service.counts()
    assert counts.leased == 0  # everything handed to this worker came back with a result
    assert counts.completed > 0 and counts.failed == 0
    assert counts.completed + counts.queued == 400
    assert vllm_engine.load.in_flight == 0
    service.close()


async def test_leased_prompts_reach_the_engine_rendered_as_vllm_renders_them(vllm_engine: Any) -> None:
    """The pull loop renders a leased batch in one thread hop; `add_request` then adds each inline (a raw prompt
    took one hop to vLLM's renderer pool per request). The engine input is the one vLLM renders from the text."""
    from scalarlm.inference.sampling import engine_prompts
    from scalarlm.protocol.generate import ChatMessage, SamplingParams, WorkItem

    renderer = vllm_engine.llm.renderer
    texts = ["What is 2 + 2?", ""]
    items = [WorkItem(request_id=f"t{i}", model="tiny", prompt=t, sampling=SamplingParams())
             for i, t in enumerate(texts)]  # fmt: skip
    items.append(WorkItem(request_id="c", model="tiny", messages=[ChatMessage(role="user", content="hi")],
                          sampling=SamplingParams()))  # fmt: skip
    prompts = engine_prompts(items, vllm_engine.llm.get_tokenizer(), renderer)
    assert all(isinstance(p, dict) and p["type"] == "token" for p in prompts)
    for prompt, text in zip(prompts, texts):
        assert prompt["prompt_token_ids"] == renderer.render_cmpl([{"prompt": text}])[0]["prompt_token_ids"]
    assert prompts[2]["prompt_token_ids"] == engine_prompts(items[2:], vllm_engine.llm.get_tokenizer())[0][
        "prompt_token_ids"]  # fmt: skip
