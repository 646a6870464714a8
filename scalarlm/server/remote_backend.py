"""Split mode: the control plane forwards OpenAI requests over HTTP to worker processes.

A worker's HTTP app exposes `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions`
(vLLM's own OpenAI serving), `GET /load` (an `EngineLoad` JSON) and `GET /health`. Streams are
passed through byte for byte. Loads are refreshed in the background, so `load()` never blocks.
Each completion carries the control plane's entry for its model in the `X-ScalarLM-Model` header, so a
worker loads a newly published model on its first OpenAI request, as it would for a batch item.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

from scalarlm.protocol.backend import MODEL_HEADER, OpenAIReply, OpenAIRoute
from scalarlm.protocol.errors import EngineUnavailable
from scalarlm.protocol.generate import EngineLoad, ModelVersion

logger = logging.getLogger(__name__)


class RemoteBackend:
    """An `InferenceBackend` over HTTP: picks the least-loaded reachable worker for each request."""

    def __init__(
        self,
        worker_urls: list[str],
        *,
        default_max_num_seqs: int = 256,
        refresh_seconds: float = 0.5,
        transport: httpx.AsyncBaseTransport | None = None,
        api_key: str | None = None,
    ) -> None:
        """`api_key`: the worker key, sent as `Authorization: Bearer` on every request to a worker."""
        self.urls = [u.rstrip("/") for u in worker_urls]
        self.default_max_num_seqs = default_max_num_seqs
        self.refresh_seconds = refresh_seconds
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(None, connect=10.0), headers=headers)
        self._loads: dict[str, EngineLoad | None] = {u: None for u in self.urls}
        self._task: asyncio.Task[None] | None = None
        self._turn = 0

    async def start(self) -> None:
        """Start refreshing worker loads in the background."""
        await self.refresh()
        self._task = asyncio.create_task(self._refresh_forever())

    async def close(self) -> None:
        """Stop refreshing and close connections."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.client.aclose()

    # ---- InferenceBackend -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """The sum over workers (a worker not heard from yet counts with the configured max_num_seqs); the
        shortest context length any of them reported."""
        total = EngineLoad(running=0, waiting=0, max_num_seqs=0, kv_cache_usage=0.0)
        for load in self._loads.values():
            load = load or EngineLoad(max_num_seqs=self.default_max_num_seqs)
            total.running += load.running
            total.waiting += load.waiting
            total.max_num_seqs += load.max_num_seqs
            total.kv_cache_usage = max(total.kv_cache_usage, load.kv_cache_usage)
            if load.max_model_len is not None:  # a prompt must fit whichever worker leases it
                total.max_model_len = min(total.max_model_len or load.max_model_len, load.max_model_len)
        total.max_num_seqs = max(1, total.max_num_seqs)
        return total

    async def healthy(self) -> bool:
        """True when at least one worker answers its health check."""
        for url in self.urls:
            try:
                if (await self.client.get(f"{url}/health", timeout=5.0)).status_code == 200:
                    return True
            except httpx.HTTPError:
                continue
        return False

    async def openai(self, route: OpenAIRoute, body: dict[str, Any], model: ModelVersion | None = None) -> OpenAIReply:
        """Forward one OpenAI request; stream SSE through unchanged when the worker streams."""
        url = f"{self._pick()}/v1/{route}"
        try:
            if route == "models":
                resp = await self.client.get(url)
                return OpenAIReply(resp.status_code, body=_json(resp))
            headers = {MODEL_HEADER: model.model_dump_json()} if model is not None else None
            request = self.client.build_request("POST", url, json=body, headers=headers)
            resp = await self.client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"inference worker {url} unreachable: {exc}") from exc
        if resp.headers.get("content-type", "").startswith("text/event-stream"):
            return OpenAIReply(resp.status_code, stream=_passthrough(resp), headers=_pass_headers(resp))
        await resp.aread()
        await resp.aclose()
        return OpenAIReply(resp.status_code, body=_json(resp), headers=_pass_headers(resp))

    # ---- internals -------------------------------------------------------------------------------

    def _pick(self) -> str:
        if not self.urls:
            raise EngineUnavailable("no inference worker configured (server.worker_urls is empty)")
        known = [(u, l) for u, l in self._loads.items() if l is not None]
        if known:
            return min(known, key=lambda ul: (ul[1].running + ul[1].waiting) / max(1, ul[1].max_num_seqs))[0]
        self._turn = (self._turn + 1) % len(self.urls)
        return self.urls[self._turn]

    async def refresh(self) -> None:
        """Read every worker's load once; an unreachable worker is left out of routing."""
        for url in self.urls:
            try:
                resp = await self.client.get(f"{url}/load", timeout=5.0)
                self._loads[url] = EngineLoad.model_validate(resp.json()) if resp.status_code == 200 else None
            except (httpx.HTTPError, ValueError):
                self._loads[url] = None

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_seconds)
            await self.refresh()


def _json(resp: httpx.Response) -> dict[str, Any]:
    try:
        data = resp.json()
    except ValueError:
        raise EngineUnavailable(f"worker answered {resp.status_code} without JSON: {resp.text[:200]!r}") from None
    if not isinstance(data, dict):
        raise EngineUnavailable(f"worker answered {resp.status_code} with a non-object JSON body")
    return data


def _pass_headers(resp: httpx.Response) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items() if k.lower() == "retry-after"}


async def _passthrough(resp: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in resp.aiter_raw():
            yield chunk
    finally:
        await resp.aclose()
