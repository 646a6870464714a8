"""The official openai client against `scalarlm serve`: completions and chat, streamed and not."""

from __future__ import annotations

import pytest
from openai import NotFoundError, OpenAI


@pytest.fixture(scope="module")
def client(server_url: str) -> OpenAI:
    return OpenAI(base_url=f"{server_url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_models_list_names_the_base_model(client: OpenAI, model_name: str) -> None:
    assert model_name in [m.id for m in client.models.list().data]


def test_completion(client: OpenAI, model_name: str) -> None:
    reply = client.completions.create(model=model_name, prompt="What is 3 + 4?", max_tokens=8, temperature=0)
    assert reply.model == model_name
    assert len(reply.choices) == 1 and reply.choices[0].text
    assert reply.usage.completion_tokens == 8 or reply.choices[0].finish_reason == "stop"


def test_completion_stream_matches_non_stream(client: OpenAI, model_name: str) -> None:
    whole = client.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=0)
    pieces = client.completions.create(model=model_name, prompt="Hello", max_tokens=8, temperature=0, stream=True)
    assert "".join(chunk.choices[0].text for chunk in pieces if chunk.choices) == whole.choices[0].text


def test_chat(client: OpenAI, model_name: str) -> None:
    reply = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "What is 2 + 2?"}], max_tokens=8, temperature=0
    )
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content
    assert reply.usage.prompt_tokens > 0


def test_chat_stream_matches_non_stream(client: OpenAI, model_name: str) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0)
    stream = client.chat.completions.create(model=model_name, messages=messages, max_tokens=8, temperature=0,
                                            stream=True)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert text == whole.choices[0].message.content


def test_unknown_model_is_404(client: OpenAI) -> None:
    with pytest.raises(NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=2)
