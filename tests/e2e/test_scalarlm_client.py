"""scalarlm.ScalarLM / AsyncScalarLM against a real `scalarlm serve`."""

from __future__ import annotations

import asyncio

import pytest

import scalarlm
from scalarlm.protocol.errors import InvalidRequest, NotFound

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]


@pytest.fixture(scope="module")
def llm(server_url: str) -> scalarlm.ScalarLM:
    with scalarlm.ScalarLM(api_url=server_url, timeout=120) as client:
        yield client


def test_health_and_models(llm: scalarlm.ScalarLM, model_name: str) -> None:
    assert llm.health()["all"] == "up"
    assert model_name in str(llm.list_models())


def test_strings_and_chats_come_back_in_order(llm: scalarlm.ScalarLM) -> None:
    prompts = ["What is 1 + 1?", CHAT, {"prompt": "Hello"}, {"messages": CHAT}, "What is 1 + 1?"]
    texts = llm.generate(prompts, max_tokens=6, temperature=0)
    assert len(texts) == 5 and all(isinstance(t, str) and t for t in texts)
    assert texts[0] == texts[4] and texts[1] == texts[3]


def test_details_name_model_version_and_tokens(llm: scalarlm.ScalarLM, model_name: str) -> None:
    [result] = llm.generate(["What is 5 + 5?"], max_tokens=5, return_details=True, ignore_eos=True)
    assert result.response and result.model == model_name and result.version == 0
    assert result.finish_reason == "length" and result.completion_tokens == 5 and result.prompt_tokens > 0


def test_greedy_is_deterministic_and_seed_is_honoured(llm: scalarlm.ScalarLM) -> None:
    prompts = ["Once upon a time"] * 2
    assert len(set(llm.generate(prompts, max_tokens=10, temperature=0))) == 1
    first = llm.generate(["Once upon a time"], max_tokens=10, temperature=1.0, seed=7)
    again = llm.generate(["Once upon a time"], max_tokens=10, temperature=1.0, seed=7)
    assert first == again
    others = {llm.generate(["Once upon a time"], max_tokens=10, temperature=1.0, seed=s)[0] for s in range(4)}
    assert len(others) > 1


def test_n_completions_and_logprobs(llm: scalarlm.ScalarLM) -> None:
    [result] = llm.generate(["Hello"], max_tokens=4, n=3, temperature=1.0, seed=1, logprobs=1, return_details=True)
    assert len(result.outputs) == 3 and all(o.text for o in result.outputs)
    assert all(len(o.token_ids) <= 4 for o in result.outputs)
    assert result.logprobs is not None and all(lp <= 0 for lp in result.logprobs)


def test_large_batch_goes_through_upload(llm: scalarlm.ScalarLM) -> None:
    prompts = [f"What is {i} + 1?" for i in range(130)]
    texts = llm.generate(prompts, max_tokens=3, temperature=0)
    assert len(texts) == 130 and all(isinstance(t, str) for t in texts)
    assert texts[7] == llm.generate([prompts[7]], max_tokens=3, temperature=0)[0]


def test_submit_then_fetch_results(llm: scalarlm.ScalarLM) -> None:
    ids = llm.submit_generate(["Hello", "World"], max_tokens=3)
    assert len(ids) == 2
    results = llm.get_results(ids, wait_seconds=30)
    assert [r.request_id for r in results] == ids
    assert all(r.response is not None for r in results)
    assert llm.metrics()["total_completed"] >= 2


def test_bad_input_gets_typed_errors(llm: scalarlm.ScalarLM) -> None:
    with pytest.raises(NotFound):
        llm.generate(["x"], model_name="no-such-model", max_tokens=2)
    with pytest.raises(InvalidRequest):
        llm.generate(["x"], max_tokens=0)
    with pytest.raises(TypeError):
        llm.generate(["x"], max_tokns=2)


async def test_sync_client_works_inside_a_running_loop(server_url: str) -> None:
    # As in Jupyter: a running event loop in this thread must not break the blocking client.
    assert asyncio.get_running_loop().is_running()
    with scalarlm.ScalarLM(api_url=server_url) as client:
        assert len(client.generate(["Hello"], max_tokens=2)) == 1


async def test_async_client(server_url: str) -> None:
    client = scalarlm.AsyncScalarLM(api_url=server_url)
    texts, health = await asyncio.gather(client.generate(["Hello", CHAT], max_tokens=3), client.health())
    assert len(texts) == 2 and health["all"] == "up"
    with pytest.raises(InvalidRequest):
        await client.generate(["x"], max_tokens=0)
