"""AsyncScalarLM: the same API as ScalarLM, awaitable."""

from __future__ import annotations

from typing import Any

from scalarlm.client import flows
from scalarlm.client.connection import DEFAULT_TIMEOUT, auth_headers, resolve_api_key, resolve_api_url
from scalarlm.client.payloads import PromptInput
from scalarlm.client.rl import DEFAULT_STEP_WAIT_SECONDS, AsyncRLSession, create_flow
from scalarlm.client.training import AsyncTrainingMethods
from scalarlm.client.transport import AsyncRunner
from scalarlm.protocol.generate import GenerateResult
from scalarlm.protocol.training import StalePolicy


class AsyncScalarLM(AsyncTrainingMethods):
    """Async client. Each call opens its own connection pool, so one instance works across event loops."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.api_url = resolve_api_url(api_url)
        self._run = AsyncRunner(self.api_url, auth_headers(resolve_api_key(api_key)), timeout)

    async def generate(self, prompts: PromptInput | list[PromptInput], model_name: str | None = None,
                       max_tokens: int | None = None, return_details: bool = False,
                       progress: bool | None = None, **sampling: Any) -> list[str] | list[GenerateResult]:
        """Generate for every prompt and return the texts in prompt order (or full results)."""
        return await self._run(flows.generate(prompts, model_name, max_tokens, return_details, progress, sampling))

    async def submit_generate(self, prompts: PromptInput | list[PromptInput], model_name: str | None = None,
                              max_tokens: int | None = None, **sampling: Any) -> list[str]:
        """Queue prompts without waiting; return their request ids."""
        return await self._run(flows.submit(prompts, model_name, max_tokens, sampling))

    async def get_results(self, request_ids: list[str], wait_seconds: float | None = 0) -> list[GenerateResult]:
        """Current results for these ids (unfinished ones have response None)."""
        return await self._run(flows.get_results(request_ids, wait_seconds))

    async def rl_session(self, model_name: str | None = None, train_args: dict[str, Any] | None = None,
                         step_wait_seconds: float = DEFAULT_STEP_WAIT_SECONDS, max_staleness: int = 1,
                         stale_policy: StalePolicy = "refuse") -> AsyncRLSession:  # fmt: skip
        """Start an RL session (see `ScalarLM.rl_session`)."""
        info = await self._run(create_flow(model_name, train_args, max_staleness, stale_policy))
        return AsyncRLSession(self._run, info, step_wait_seconds, model_name)

    async def health(self) -> dict[str, Any]:
        """GET /v1/health."""
        return await self._run(flows.get_json("/v1/health"))

    async def list_models(self) -> dict[str, Any]:
        """The models the server knows."""
        return await self._run(flows.list_models())

    async def metrics(self) -> dict[str, Any]:
        """GET /v1/generate/metrics."""
        return await self._run(flows.get_json("/v1/generate/metrics"))

    async def clear_queue(self) -> dict[str, Any]:
        """Drop every queued, unfinished request."""
        return await self._run(flows.post_json("/v1/generate/clear_queue"))

    async def get_gpu_count(self) -> int:
        """Accelerators available to training."""
        return await self._run(flows.count("/v1/megatron/gpu_count", "gpu_count"))

    async def get_node_count(self) -> int:
        """Nodes available to training."""
        return await self._run(flows.count("/v1/megatron/node_count", "node_count"))
