"""Serve OpenAI routes with vLLM's own serving classes, so the wire format is exactly `vllm serve`'s.

The serving objects are built by vLLM's `init_app_state`, as its API server builds them; this module
only validates the body into vLLM's request models, calls the handler, and stamps each response with
the model's weights version (`system_fingerprint` = `scalarlm-<model>-v<version>`, `scalarlm_version`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from pydantic import ValidationError
from starlette.datastructures import State

from scalarlm.config import Settings
from scalarlm.inference.engine import Engine
from scalarlm.inference.hot_swap import WeightsLease, WeightsManager
from scalarlm.inference.versions import ModelVersions
from scalarlm.inference.vllm_api import (  # vLLM's serving classes and its own error message format
    _MAX_REPORTED_ERRORS,
    ChatCompletionRequest,
    CompletionRequest,
    ErrorInfo,
    ErrorResponse,
    _format_error,
    clean_loc_for_param,
    create_error_response,
    init_app_state,
    sanitize_message,
)
from scalarlm.protocol.backend import OpenAIReply, OpenAIRoute
from scalarlm.protocol.errors import EngineUnavailable, InvalidRequest, ScalarLMError
from scalarlm.protocol.generate import EngineLoad, ModelVersion

logger = logging.getLogger(__name__)

_REQUEST_MODELS: dict[str, type[Any]] = {
    "completions": CompletionRequest,
    "chat/completions": ChatCompletionRequest,
}


def validation_error(exc: ValidationError) -> ErrorResponse:
    """vLLM's 400 body for a request body that fails validation, built with its own formatter."""
    # FastAPI reports body errors with a leading "body" in `loc` and without pydantic's docs URL.
    errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors(include_url=False)]
    param = clean_loc_for_param(errors[0]["loc"]) if errors else None
    label = "error" if len(errors) == 1 else "errors"
    reported = errors[:_MAX_REPORTED_ERRORS]
    message = f"{len(errors)} validation {label}:\n" + "".join(f"  {_format_error(e)}\n" for e in reported)
    if len(errors) > len(reported):
        message += f"  ...and {len(errors) - len(reported)} more {label}\n"
    return ErrorResponse(
        error=ErrorInfo(message=sanitize_message(message.rstrip()), type="Bad Request", code=400, param=param)
    )


def _error_reply(error: ErrorResponse) -> OpenAIReply:
    return OpenAIReply(status_code=int(error.error.code), body=error.model_dump())


class VllmOpenAIBackend:
    """`InferenceBackend` over one in-process vLLM engine; usable (answering 503) before `attach`."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.engine: Engine | None = None
        self.versions = ModelVersions(settings.base_model_name)
        self.state: State | None = None
        self.weights: WeightsManager | None = None

    async def attach(self, engine: Engine, versions: ModelVersions, weights: WeightsManager | None = None) -> None:
        """Build vLLM's OpenAI serving objects for `engine` (exactly as its API server does).

        `weights`: the hot-swap manager shared with the pull loop (interactive requests for a full-weight
        model then wait for the same swaps as batch work); a private one when None.
        """
        state = State()
        supported_tasks = await engine.llm.get_supported_tasks()
        await init_app_state(engine.llm, state, engine.args, supported_tasks)
        weights = weights or WeightsManager(engine, self.settings, versions)
        weights.serving_models = state.openai_serving_models
        for name, lora in weights.registered_loras().items():
            state.openai_serving_models.lora_requests[name] = lora
        self.weights = weights
        self.versions = weights.versions
        self.state = state
        self.engine = engine

    def detach(self) -> None:
        """Forget the engine (it is shutting down): requests answer 503 again."""
        self.engine = None
        self.state = None

    # ---- InferenceBackend -----------------------------------------------------------------------

    def load(self) -> EngineLoad:
        """The engine's current load (the worker's count, refined by vLLM's scheduler stats)."""
        if self.engine is None:
            return EngineLoad(max_num_seqs=self.settings.engine.max_num_seqs)
        return self.engine.load.snapshot()

    async def healthy(self) -> bool:
        """True when the engine is up and not errored."""
        if self.engine is None:
            return False
        try:
            await self.engine.llm.check_health()
        except Exception:  # any failure of the health probe means "not healthy"
            logger.warning("engine health check failed", exc_info=True)
            return False
        return True

    async def openai(self, route: OpenAIRoute, body: dict[str, Any], model: ModelVersion | None = None) -> OpenAIReply:
        """Serve one OpenAI request: JSON body, or an SSE byte stream exactly as vLLM's server emits it.

        `model` (the control plane's newest entry for the requested name) goes into the same catalog the
        pull loop feeds, so the request swaps in that model's weights exactly as a batch item would.
        """
        if self.engine is None or self.state is None:
            err = EngineUnavailable("the inference engine is not running yet").to_response()
            return OpenAIReply(status_code=err.error.code, body=err.model_dump(), headers={"Retry-After": "1"})
        if route == "models":
            listing = await self.state.openai_serving_models.show_available_models()
            return OpenAIReply(status_code=200, body=listing.model_dump())
        if route not in _REQUEST_MODELS:
            err = InvalidRequest(f"unknown OpenAI route '{route}'").to_response()
            return OpenAIReply(status_code=404, body=err.model_dump())
        try:
            request = _REQUEST_MODELS[route].model_validate(body)
        except ValidationError as exc:
            return _error_reply(validation_error(exc))
        if model is not None and self.weights is not None:
            self.weights.update_catalog([model])
        return await self._generate(route, request)

    # ---- internals ------------------------------------------------------------------------------

    async def _generate(self, route: OpenAIRoute, request: Any) -> OpenAIReply:
        """Call vLLM's handler; vLLM's own error mapping turns exceptions into its ErrorResponse."""
        assert self.engine is not None and self.state is not None and self.weights is not None
        load = self.engine.load
        sequences = max(1, int(getattr(request, "n", 1) or 1))
        base = self.settings.base_model_name
        model = request.model or base
        lease: WeightsLease | None = None
        if self.weights.servable(model):  # unknown names get vLLM's own 404
            try:
                lease = await self.weights.acquire(model)
            except ScalarLMError as exc:  # not servable here, or its weights failed to load (ModelLoadFailed)
                return OpenAIReply(status_code=exc.status_code, body=exc.to_response().model_dump())
        version = lease.version if lease is not None else 0
        fingerprint = f"scalarlm-{model}-v{version}"
        full_model = lease is not None and lease.lora is None and model != base
        if full_model:  # vLLM knows only the base name; the engine holds this model's weights now
            request.model = base
        streaming = bool(getattr(request, "stream", False))
        handed_to_stream = False
        if not streaming:  # a stream counts itself once it is consumed (an unread one never runs)
            load.add(sequences)
        try:
            if route == "completions":
                result = await self.state.openai_serving_completion.create_completion(request, None)
            else:
                result = await self.state.openai_serving_chat.create_chat_completion(request, None)
            if isinstance(result, ErrorResponse):
                return _error_reply(result)
            if hasattr(result, "model_dump"):
                body = result.model_dump()
                body["system_fingerprint"] = fingerprint
                body["scalarlm_version"] = version
                if full_model:
                    body["model"] = model
                return OpenAIReply(status_code=200, body=body)
            handed_to_stream = True
            rename = (f'"model":{json.dumps(base)}', f'"model":{json.dumps(model)}') if full_model else None
            return OpenAIReply(
                status_code=200,
                stream=self._sse(result, fingerprint, version, sequences, lease, rename),
                headers={"content-type": "text/event-stream; charset=utf-8"},
            )
        except Exception as exc:  # vLLM's server maps any handler exception the same way (its safety net)
            logger.info("OpenAI %s request failed: %s", route, exc)
            return _error_reply(create_error_response(exc))
        finally:
            if not streaming:
                load.done(sequences)
            if lease is not None and not handed_to_stream:
                self.weights.release(lease)

    async def _sse(
        self,
        lines: AsyncIterator[str],
        fingerprint: str,
        version: int,
        sequences: int,
        lease: WeightsLease | None,
        rename: tuple[str, str] | None,
    ) -> AsyncIterator[bytes]:
        """vLLM's SSE lines as bytes, each chunk object stamped with our fingerprint and version."""
        assert self.engine is not None
        load = self.engine.load
        stamp = f'data: {{"system_fingerprint":{json.dumps(fingerprint)},"scalarlm_version":{version},'
        load.add(sequences)
        try:
            async for line in lines:
                if line.startswith('data: {"id"'):
                    line = stamp + line[7:]
                    if rename is not None:
                        line = line.replace(*rename, 1)
                yield line.encode()
        finally:
            load.done(sequences)
            if lease is not None and self.weights is not None:
                self.weights.release(lease)
            aclose = getattr(lines, "aclose", None)
            if aclose is not None:
                await aclose()
