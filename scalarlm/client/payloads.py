"""Turn `generate(...)` arguments into the wire payloads of the batch routes."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import ValidationError

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.generate import PromptObject, SamplingParams, SubmittedSampling

# Batches above this go through one file upload instead of one JSON request (as ScalarLM's SDK does).
UPLOAD_THRESHOLD = 128

PromptInput = str | Sequence[Mapping[str, Any]] | Mapping[str, Any]


def _is_messages(value: object) -> bool:
    return (
        isinstance(value, Sequence)
        and not isinstance(value, str)
        and len(value) > 0
        and all(isinstance(m, Mapping) and "role" in m for m in value)
    )


def normalize_prompt(prompt: PromptInput, index: int) -> str | dict[str, Any]:
    """One prompt in wire form: a string, or {"prompt": ...} / {"messages": [...]}."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping) and "role" in prompt:
        raise InvalidRequest(
            f"prompt {index} is a single chat message; pass a conversation as a list: [[{{'role': ...}}]]",
            param=f"prompts[{index}]",
        )
    if _is_messages(prompt):
        candidate: dict[str, Any] = {"messages": [dict(m) for m in prompt]}  # type: ignore[union-attr]
    elif isinstance(prompt, Mapping):
        candidate = dict(prompt)
    else:
        raise InvalidRequest(
            f"prompt {index} must be a string, a list of chat messages, or a dict with 'prompt' or 'messages'",
            param=f"prompts[{index}]",
        )
    try:
        PromptObject.model_validate(candidate)
    except ValidationError as exc:
        raise InvalidRequest(f"prompt {index}: {exc.errors()[0]['msg']}", param=f"prompts[{index}]") from None
    return candidate


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[str | dict[str, Any]]:
    """Every prompt in wire form; a lone string or a lone dict prompt counts as a batch of one."""
    if isinstance(prompts, (str, Mapping)):
        prompts = [prompts]
    items = list(prompts)
    if not items:
        raise InvalidRequest("prompts must not be empty", param="prompts")
    return [normalize_prompt(p, i) for i, p in enumerate(items)]


def sampling_fields(max_tokens: int | None, sampling: Mapping[str, Any]) -> dict[str, Any]:
    """Validated sampling kwargs as wire fields (only those the caller set).

    An unknown keyword raises TypeError, as a Python call would; a bad value raises InvalidRequest.
    """
    unknown = sorted(set(sampling) - set(SamplingParams.model_fields))
    if unknown:
        raise TypeError(f"generate() got an unexpected keyword argument {unknown[0]!r}")
    given = {k: v for k, v in sampling.items() if v is not None}
    if max_tokens is not None:
        given["max_tokens"] = max_tokens
    try:
        params = SubmittedSampling.model_validate(given)  # the server's own submission checks
    except ValidationError as exc:
        first = exc.errors()[0]
        field = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"{field}: {first['msg']}" if field else first["msg"], param=field or None) from None
    return params.model_dump(exclude_unset=True)


def generate_payload(
    prompts: list[str | dict[str, Any]], model_name: str | None, fields: dict[str, Any]
) -> dict[str, Any]:
    """The JSON body of POST /v1/generate: store and answer at once (the client polls)."""
    payload: dict[str, Any] = {"prompts": prompts, "wait_seconds": 0, **fields}
    if model_name is not None:
        payload["model"] = model_name
    return payload


def upload_rows(
    prompts: list[str | dict[str, Any]], model_name: str | None, fields: dict[str, Any]
) -> bytes:
    """The JSON file for POST /v1/generate/upload: one ScalarLM-style row per prompt."""
    rows = []
    for prompt in prompts:
        row: dict[str, Any] = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
        row.update(model=model_name, max_tokens=fields.get("max_tokens"), request_type="generate")
        row.update({k: v for k, v in fields.items() if k != "max_tokens"})
        rows.append(row)
    return json.dumps(rows).encode()


def result_index(key: str) -> int:
    """The prompt index of a download result key `<batch>_<index>`."""
    return int(key.rsplit("_", 1)[-1])
