"""Bad input gets the right 4xx with a message naming the field, and the queue keeps every earlier item."""

from __future__ import annotations

import json

import httpx
import pytest


LONG_PROMPT = "hello world " * 80  # far more than the 64-token max_model_len of these tests

BAD_GENERATE = [
    # (description, raw body, status, field the message must name)
    ("malformed JSON", b'{"prompts": ["a"', 400, "JSON"),
    ("body is a list", b'["a"]', 400, "body"),
    ("prompts missing", b'{"max_tokens": 3}', 400, "prompts"),
    ("prompts empty", b'{"prompts": []}', 400, "prompts"),
    ("prompt of wrong type", b'{"prompts": [123]}', 400, "prompts.0"),
    ("prompts not a list", b'{"prompts": "abc"}', 400, "prompts"),
    ("max_tokens zero", b'{"prompts": ["a"], "max_tokens": 0}', 400, "max_tokens"),
    ("max_tokens negative", b'{"prompts": ["a"], "max_tokens": -5}', 400, "max_tokens"),
    ("max_tokens too large", b'{"prompts": ["a"], "max_tokens": 100000}', 400, "max_tokens"),
    ("max_tokens wrong type", b'{"prompts": ["a"], "max_tokens": "lots"}', 400, "max_tokens"),
    ("temperature negative", b'{"prompts": ["a"], "temperature": -1}', 400, "temperature"),
    ("unknown field", b'{"prompts": ["a"], "temprature": 0.5}', 400, "temprature"),
    ("unknown model", b'{"prompts": ["a"], "model": "gpt-17"}', 404, "gpt-17"),
    ("prompt too long", json.dumps({"prompts": ["short", LONG_PROMPT]}).encode(), 400, "prompts[1]"),
    ("chat prompt without messages", b'{"prompts": [{"messages": []}]}', 400, "prompts.0"),
    # What vLLM would refuse for every item after the batch was stored is refused at submission.
    ("n > 1 with greedy decoding", b'{"prompts": ["a"], "n": 2}', 400, "temperature above 0"),
    ("temperature NaN", b'{"prompts": ["a"], "temperature": NaN}', 400, "temperature"),
    ("temperature above 2", b'{"prompts": ["a"], "temperature": 2.5}', 400, "temperature must be at most 2"),
    ("top_p Infinity", b'{"prompts": ["a"], "top_p": Infinity}', 400, "top_p"),
    ("empty stop string", b'{"prompts": ["a"], "stop": ["x", ""]}', 400, "stop"),
    ("seed beyond int64", b'{"prompts": ["a"], "seed": 9223372036854775808}', 400, "seed"),
    ("image content part", json.dumps({"prompts": [{"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]}]}).encode(), 400, "content[0]"),
    ("tools with a text prompt", json.dumps({"prompts": ["a"], "tools": [{"type": "function"}]}).encode(), 400,
     "prompts[0]"),
    ("tool_choice required", b'{"prompts": [{"messages": [{"role": "user", "content": "a"}]}], "tools": [], '
     b'"tool_choice": "required"}', 400, "tool_choice"),
]


@pytest.mark.parametrize("case", BAD_GENERATE, ids=[c[0] for c in BAD_GENERATE])
async def test_bad_generate_requests(client: httpx.AsyncClient, case: tuple) -> None:
    _, raw, status, field = case
    reply = await client.post("/v1/generate", content=raw, headers={"content-type": "application/json"})
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert field in error["message"] and error["code"] == status
    assert (await client.get("/v1/generate/metrics")).json()["queue_depth"] == 0  # nothing half-stored


async def test_unknown_ids_are_404_naming_them(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/generate/get_results", json={"request_ids": ["feed_000000007"]})
    assert reply.status_code == 404 and "feed_000000007" in reply.json()["error"]["message"]
    reply = await client.post("/v1/generate/download", json={"request_id": "nosuchbatch"})
    assert reply.status_code == 404 and "nosuchbatch" in reply.json()["error"]["message"]
    reply = await client.post("/v1/generate/get_results", json={"request_ids": []})
    assert reply.status_code == 400 and "request_ids" in reply.json()["error"]["message"]


BAD_UPLOADS = [
    ("not JSON", b"this is not json", 400, "file"),
    ("truncated JSON", b'[{"prompt": "a"}, {"prompt": ', 400, "JSON"),
    ("not a list", b'{"prompt": "a"}', 400, "JSON list"),
    ("empty list", b"[]", 400, "prompts"),
    ("item without prompt", b'[{"prompt": "a"}, {"max_tokens": 3}]', 400, "item 1"),
    ("item max_tokens zero", b'[{"prompt": "a", "max_tokens": 0}]', 400, "max_tokens"),
    ("item max_tokens too large", b'[{"prompt": "a", "max_tokens": 99999}]', 400, "file[0].max_tokens"),
    ("item unknown model", b'[{"prompt": "a", "model": "nope"}]', 404, "nope"),
    ("item prompt too long", json.dumps([{"prompt": "a"}, {"prompt": LONG_PROMPT}]).encode(), 400, "prompts[1]"),
    ("item n > 1 greedy", b'[{"prompt": "a"}, {"prompt": "b", "n": 3}]', 400, "item 1"),
    ("item temperature NaN", b'[{"prompt": "a", "temperature": NaN}]', 400, "temperature"),
    ("item tools with a text prompt", b'[{"prompt": "a", "tools": [{"type": "function"}]}]', 400, "file[0]"),
]


@pytest.mark.parametrize("case", BAD_UPLOADS, ids=[c[0] for c in BAD_UPLOADS])
async def test_bad_uploads(client: httpx.AsyncClient, case: tuple) -> None:
    _, raw, status, field = case
    reply = await client.post("/v1/generate/upload", files={"file": ("requests.json", raw)})
    assert reply.status_code == status, reply.text
    assert field in reply.json()["error"]["message"]
    assert (await client.get("/v1/generate/metrics")).json()["queue_depth"] == 0


async def test_upload_without_file_field(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/generate/upload", data={"other": "x"})
    assert reply.status_code == 400 and "file" in reply.json()["error"]["message"]


async def test_oversized_upload_is_413_declared_or_streamed(client: httpx.AsyncClient) -> None:
    big = json.dumps([{"prompt": "x" * 100} for _ in range(1000)]).encode()  # > 64 KiB upload limit
    reply = await client.post("/v1/generate/upload", files={"file": ("requests.json", big)})
    assert reply.status_code == 413 and reply.json()["error"]["type"] == "payload_too_large"

    async def chunks():  # no Content-Length: the limit is enforced while the body streams in
        boundary = b"--xyz\r\n"
        yield boundary + b'Content-Disposition: form-data; name="file"; filename="r.json"\r\n\r\n'
        for start in range(0, len(big), 8192):
            yield big[start : start + 8192]
        yield b"\r\n--xyz--\r\n"

    reply = await client.post(
        "/v1/generate/upload", content=chunks(), headers={"content-type": "multipart/form-data; boundary=xyz"}
    )
    assert reply.status_code == 413, reply.text
    assert (await client.get("/v1/generate/metrics")).json()["queue_depth"] == 0


async def test_oversized_json_body_is_413(client: httpx.AsyncClient) -> None:
    body = json.dumps({"prompts": ["x" * 1000] * 300}).encode()  # > 256 KiB request limit
    reply = await client.post("/v1/generate", content=body, headers={"content-type": "application/json"})
    assert reply.status_code == 413


async def test_queue_keeps_serving_earlier_items_after_bad_input(client: httpx.AsyncClient, work) -> None:
    first = (await client.post("/v1/generate", json={"prompts": ["keep-1", "keep-2"]})).json()["results"]
    upload = (await client.post("/v1/generate/upload",
                                files={"file": ("r.json", json.dumps([{"prompt": "keep-3"}]).encode())})).json()
    for _, raw, _, _ in BAD_GENERATE:
        await client.post("/v1/generate", content=raw, headers={"content-type": "application/json"})
    for _, raw, _, _ in BAD_UPLOADS:
        await client.post("/v1/generate/upload", files={"file": ("r.json", raw)})
    assert (await client.get("/v1/generate/metrics")).json()["queue"]["queued"] == 3
    while await work(client, capacity=10):
        pass
    got = (await client.post("/v1/generate/get_results", json={"request_ids": [r["request_id"] for r in first]})).json()
    assert [r["response"] for r in got["results"]] == ["echo:keep-1", "echo:keep-2"]
    done = (await client.post("/v1/generate/download", json={"request_id": upload["request_id"]})).json()
    assert [r["response"] for r in done["results"].values()] == ["echo:keep-3"]


async def test_unknown_route_uses_the_error_shape(client: httpx.AsyncClient) -> None:
    reply = await client.get("/v1/nothing-here")
    assert reply.status_code == 404 and reply.json()["error"]["code"] == 404


async def test_batch_size_limit_applies_to_json_and_upload(running_app) -> None:
    async with running_app(generate={"max_batch_prompts": 3}) as client:
        reply = await client.post("/v1/generate", json={"prompts": ["a"] * 4})
        assert reply.status_code == 400 and "prompts" in reply.json()["error"]["message"]
        rows = json.dumps([{"prompt": "a"}] * 4).encode()
        reply = await client.post("/v1/generate/upload", files={"file": ("r.json", rows)})
        assert reply.status_code == 400 and "more than 3" in reply.json()["error"]["message"]
        assert (await client.get("/v1/generate/metrics")).json()["queue_depth"] == 0


async def test_form_encoded_body_is_told_to_send_json(client: httpx.AsyncClient) -> None:
    reply = await client.post("/v1/generate", content=b'{"prompts": ["a"]}',
                              headers={"content-type": "application/x-www-form-urlencoded"})
    assert reply.status_code == 400 and "application/json" in reply.json()["error"]["message"]
