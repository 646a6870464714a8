"""ScalarLM: the blocking client (safe inside a running event loop, e.g. Jupyter)."""

from __future__ import annotations

from types import TracebackType
from typing import Any

from scalarlm.client import flows
from scalarlm.client.connection import DEFAULT_TIMEOUT, auth_headers, resolve_api_key, resolve_api_url
from scalarlm.client.payloads import PromptInput
from scalarlm.client.rl import DEFAULT_STEP_WAIT_SECONDS, RLSession, create_flow
from scalarlm.client.training import TrainingMethods
from scalarlm.client.transport import SyncRunner
from scalarlm.protocol.generate import GenerateResult
from scalarlm.protocol.training import StalePolicy


class ScalarLM(TrainingMethods):
    """Talks to a scalarlm (or ScalarLM) server: batch generate, training jobs, health, models, queue metrics."""

    def __init__(self, api_url: str | None = None, api_key: str | None = None,
                 timeout: float = DEFAULT_TIMEOUT) -> None:
        self.api_url = resolve_api_url(api_url)
        self._run = SyncRunner(self.api_url, auth_headers(resolve_api_key(api_key)), timeout)

    def generate(self, prompts: PromptInput | list[PromptInput], model_name: str | None = None,
                 max_tokens: int | None = None, return_details: bool = False,
                 progress: bool | None = None, **sampling: Any) -> list[str] | list[GenerateResult]:
        """Generate for every prompt and return the texts in prompt order (or full results).

        Prompts are strings, chat conversations (lists of {"role", "content"}), or dicts with
        "prompt" or "messages". Sampling kwargs: temperature, top_p, top_k, n, stop, seed, logprobs, ...
        """
        return self._run(flows.generate(prompts, model_name, max_tokens, return_details, progress, sampling))

    def submit_generate(self, prompts: PromptInput | list[PromptInput], model_name: str | None = None,
                        max_tokens: int | None = None, **sampling: Any) -> list[str]:
        """Queue prompts without waiting; return their request ids."""
        return self._run(flows.submit(prompts, model_name, max_tokens, sampling))

    def get_results(self, request_ids: list[str], wait_seconds: float | None = 0) -> list[GenerateResult]:
        """Current results for these ids (unfinished ones have response None)."""
        return self._run(flows.get_results(request_ids, wait_seconds))

    def rl_session(self, model_name: str | None = None, train_args: dict[str, Any] | None = None,
                   step_wait_seconds: float = DEFAULT_STEP_WAIT_SECONDS, max_staleness: int = 1,
                   stale_policy: StalePolicy = "refuse") -> RLSession:  # fmt: skip
        """Start an RL session (a trainer taking one step per `session.step(rows)`; full weights by default).

        `max_staleness`: how many versions older than the weights it trains a batch may be generated with (0: a
        synchronous loop); `stale_policy` "reweight" trains an older batch with its importance ratio instead of
        refusing it (its rows must carry sampling logprobs).
        """
        info = self._run(create_flow(model_name, train_args, max_staleness, stale_policy))
        return RLSession(self._run, info, step_wait_seconds, model_name)

    def health(self) -> dict[str, Any]:
        """GET /v1/health: {"api", "vllm", "all"} each "up", "down" or "starting"."""
        return self._run(flows.get_json("/v1/health"))

    def list_models(self) -> dict[str, Any]:
        """The models the server knows (ScalarLM's list, or OpenAI's /v1/models)."""
        return self._run(flows.list_models())

    def metrics(self) -> dict[str, Any]:
        """GET /v1/generate/metrics: queue counts and throughput."""
        return self._run(flows.get_json("/v1/generate/metrics"))

    def clear_queue(self) -> dict[str, Any]:
        """Drop every queued, unfinished request."""
        return self._run(flows.post_json("/v1/generate/clear_queue"))

    def get_gpu_count(self) -> int:
        """Accelerators available to training."""
        return self._run(flows.count("/v1/megatron/gpu_count", "gpu_count"))

    def get_node_count(self) -> int:
        """Nodes available to training."""
        return self._run(flows.count("/v1/megatron/node_count", "node_count"))

    def close(self) -> None:
        """Close the connection pool."""
        self._run.close()

    def __enter__(self) -> "ScalarLM":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
