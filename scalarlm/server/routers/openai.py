"""OpenAI-compatible routes: checked and admitted here, served by the worker with vLLM's own code.

The control plane does not model OpenAI bodies: it checks only that the body is a JSON object and
names a known model, then forwards it and returns the worker's JSON or SSE bytes unchanged.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from scalarlm.protocol.backend import CLIENT_GONE, OpenAIReply, OpenAIRoute, unless_disconnected
from scalarlm.protocol.errors import InvalidRequest
from scalarlm.server.deps import ServerState, get_backend, get_state
from scalarlm.server.models import ModelCatalog

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["openai"])


async def read_json_object(request: Request) -> dict[str, Any]:
    """The request body as a JSON object, or 400 saying what is wrong with it."""
    raw = await request.body()
    try:
        body = json.loads(raw, parse_constant=_not_json)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}", param="body") from None
    if not isinstance(body, dict):
        raise InvalidRequest("request body must be a JSON object", param="body")
    return body


def _not_json(constant: str) -> float:
    """Python's json reads NaN and Infinity, which JSON does not have (and a forwarded body could not carry)."""
    raise InvalidRequest(f"request body is not valid JSON: {constant} is not a JSON number", param="body")


# The routes below take the app state with plain calls, not `Depends`: FastAPI runs a sync dependency in
# its thread pool, a thread hand-off per request that cost ~10% of the front end's CPU under load.


@router.get("/models")
async def list_models(request: Request) -> Response:
    """The worker's model list (vLLM's wire format) with every trained model and its `scalarlm_version`."""
    state, backend = get_state(request), get_backend(request)
    reply = await backend.openai("models", {})
    if reply.stream is None and reply.status_code == 200 and isinstance(reply.body, dict):
        reply = dataclasses.replace(reply, body=with_trained_models(reply.body, state.catalog))
    return _reply(reply)


def with_trained_models(body: dict[str, Any], catalog: ModelCatalog) -> dict[str, Any]:
    """Stamp the base entry with version 0 and add (or update) one entry per trained model. The catalog names what
    is served: an entry the engine still holds for a deleted job (a model it loaded before) is left out."""
    trained = catalog.trained()
    served = {catalog.base} | {model.name for model in trained}
    data = [dict(entry) for entry in body.get("data", []) if isinstance(entry, dict) and entry.get("id") in served]
    by_id = {entry.get("id"): entry for entry in data}
    base = by_id.get(catalog.base, {})
    if base:
        base.update(scalarlm_version=0, scalarlm_kind="base")
    for model in trained:
        entry = by_id.get(model.name)
        if entry is None:
            entry = {
                "id": model.name, "object": "model", "created": int(model.created), "owned_by": "scalarlm",
                "root": model.path, "parent": catalog.base, "max_model_len": base.get("max_model_len"),
                "permission": [],
            }  # fmt: skip
            data.append(entry)
            by_id[model.name] = entry
        entry.update(scalarlm_version=model.version, scalarlm_kind=model.kind)
    return {**body, "data": data}


@router.post("/completions")
async def completions(request: Request) -> Response:
    """OpenAI completions, streamed or not."""
    return await _forward("completions", request)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    """OpenAI chat completions, streamed or not."""
    return await _forward("chat/completions", request)


async def _forward(route: OpenAIRoute, request: Request) -> Response:
    state: ServerState = get_state(request)
    backend = get_backend(request)
    body = await read_json_object(request)
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise InvalidRequest("model must be a string", param="model")
    body["model"] = state.catalog.resolve(model)  # the name the worker serves it under
    entry = state.catalog.entry(body["model"])  # its newest weights: the worker loads them if it has not yet
    ticket = state.admission.admit(backend.load())
    streaming = False
    try:
        # A client that leaves before its (non-streamed) answer ends the engine's work on it and frees its slot.
        reply = await unless_disconnected(request.receive, backend.openai(route, body, entry), CLIENT_GONE)
        if reply.stream is not None:
            streaming = True  # the slot is released when the stream ends
            stream = state.admission.guard_stream(ticket, reply.stream)
            return StreamingResponse(
                stream, status_code=reply.status_code, media_type="text/event-stream", headers=reply.headers
            )
        return _reply(reply)
    finally:
        if not streaming:
            state.admission.release(ticket)


def _reply(reply: OpenAIReply) -> Response:
    if reply.stream is not None:
        return StreamingResponse(reply.stream, status_code=reply.status_code, media_type="text/event-stream")
    return JSONResponse(reply.body, status_code=reply.status_code, headers=reply.headers)
