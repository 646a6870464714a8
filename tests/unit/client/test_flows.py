"""How generate() reads the server's answers: order, partial results, failures, fallbacks.

The flows are driven here with the wire answers a server gives (shapes from scalarlm.protocol); the
same flows run over HTTP against the real server in tests/e2e.
"""

from __future__ import annotations

from typing import Any

import pytest

from scalarlm.client import GenerationFailed, flows
from scalarlm.protocol.errors import NotFound


def drive(flow: flows.Flow, answers: list[Any]) -> tuple[Any, list[flows.Call]]:
    """Run a flow, answering each Call with the next item (an exception is thrown into the flow)."""
    calls: list[flows.Call] = []
    pending = list(answers)
    to_send: Any = None
    to_throw: Exception | None = None
    while True:
        try:
            step = flow.throw(to_throw) if to_throw is not None else flow.send(to_send)
        except StopIteration as done:
            assert not pending, f"unused answers: {pending}"
            return done.value, calls
        to_send, to_throw = None, None
        if isinstance(step, flows.Sleep):
            continue
        calls.append(step)
        answer = pending.pop(0)
        if isinstance(answer, Exception):
            to_throw = answer
        else:
            to_send = answer


def result(rid: str, response: str | None = None, error: str | None = None) -> dict[str, Any]:
    status = "failed" if error else ("completed" if response is not None else "queued")
    return {"request_id": rid, "response": response, "error": error, "status": status}


def test_small_batch_polls_only_unfinished_ids_and_keeps_order() -> None:
    answers = [
        {"results": [result("a"), result("b"), result("c")]},
        {"results": [result("b", "B")]},
        {"results": [result("a", "A"), result("c", "C")]},
    ]
    texts, calls = drive(flows.generate(["x", "y", "z"], None, 4, False, False, {}), answers)
    assert texts == ["A", "B", "C"]
    assert calls[0].path == "/v1/generate" and calls[0].json["wait_seconds"] == 0
    assert calls[1].json["request_ids"] == ["a", "b", "c"]
    assert calls[2].json["request_ids"] == ["a", "c"]
    assert all(c.extra_timeout > 0 for c in calls[1:])


def test_item_error_raises_generation_failed() -> None:
    answers = [{"results": [result("a"), result("b")]}, {"results": [result("a", "A"), result("b", error="boom")]}]
    with pytest.raises(GenerationFailed) as info:
        drive(flows.generate(["x", "y"], None, None, False, False, {}), answers)
    assert info.value.request_id == "b" and "boom" in str(info.value)


def test_large_batch_uploads_then_collects_partial_pages_in_index_order() -> None:
    prompts = [f"p{i}" for i in range(130)]
    keys = {i: f"batch_{i:09d}" for i in range(130)}
    first = {k: result(f"r{i}", f"t{i}") for i, k in keys.items() if i % 2}
    second = {k: result(f"r{i}", f"t{i}") for i, k in reversed(keys.items())}
    answers = [
        {"request_id": "batch", "total_requests": 130},
        {"request_id": "batch", "current_index": 65, "total_requests": 130, "results": first},
        {"request_id": "batch", "current_index": 130, "total_requests": 130, "results": second},
    ]
    texts, calls = drive(flows.generate(prompts, "m", 2, False, False, {"seed": 1}), answers)
    assert texts == [f"t{i}" for i in range(130)]
    assert calls[0].path == "/v1/generate/upload" and "file" in calls[0].files
    assert [c.path for c in calls[1:]] == ["/v1/generate/download"] * 2


def test_details_are_protocol_results() -> None:
    done = {**result("a", "A"), "model": "tiny", "version": 3, "finish_reason": "length", "completion_tokens": 4}
    [detail], _ = drive(flows.generate(["x"], None, None, True, False, {}), [{"results": [done]}])
    assert detail.response == "A" and detail.model == "tiny" and detail.version == 3


def test_list_models_falls_back_to_openai_route() -> None:
    models, calls = drive(flows.list_models(), [NotFound("no such route"), {"data": [{"id": "tiny"}]}])
    assert models == {"data": [{"id": "tiny"}]}
    assert [c.path for c in calls] == ["/v1/megatron/list_models", "/v1/models"]
