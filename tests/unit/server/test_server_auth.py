"""With API keys configured, queue and OpenAI routes need a bearer key; health and metrics stay open."""

from __future__ import annotations


async def test_api_keys_guard_every_route_but_health(running_app) -> None:
    async with running_app(server={"api_keys": ["k1", "k2"]}) as client:
        missing = await client.post("/v1/generate", json={"prompts": ["a"]})
        assert missing.status_code == 401 and missing.json()["error"]["type"] == "authentication_error"
        wrong = await client.post("/v1/generate", json={"prompts": ["a"]}, headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 401
        ok = await client.post("/v1/generate", json={"prompts": ["a"]}, headers={"authorization": "Bearer k2"})
        assert ok.status_code == 200
        work = await client.post("/v1/generate/get_work", json={"capacity": 1})
        assert work.status_code == 401  # workers need a key too
        assert (await client.post("/v1/chat/completions", json={})).status_code == 401
        assert (await client.get("/v1/health")).status_code == 200
        assert (await client.get("/metrics")).status_code == 200
