"""Tinker's `asample` through our engine: one OpenAI completions request on token ids (the path `/v1/completions`
takes), with the sampled tokens' logprobs, translated into the SDK's SampleResponse."""

from __future__ import annotations

import math
from typing import Any

from scalarlm.protocol.backend import InferenceBackend
from scalarlm.protocol.errors import Conflict, InvalidRequest, ScalarLMError
from scalarlm.server.models import ModelCatalog
from scalarlm.server.routers.tinker import wire
from scalarlm.server.routers.tinker.service import Sampler

DEFAULT_MAX_TOKENS = 16


def prompt_tokens(prompt: dict[str, Any]) -> list[int]:
    """The token ids of a ModelInput (token chunks only)."""
    tokens: list[int] = []
    for chunk in prompt.get("chunks") or []:
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise InvalidRequest(f"only token chunks can be sampled from, not {chunk.get('type')!r}", param="prompt")
        tokens += [int(t) for t in chunk.get("tokens") or []]
    if not tokens:
        raise InvalidRequest("the prompt has no tokens", param="prompt")
    return tokens


def completions_body(sampler: Sampler, tokens: list[int], request: dict[str, Any]) -> dict[str, Any]:
    """The SDK's SamplingParams as a vLLM completions request."""
    params = request.get("sampling_params") or {}
    body: dict[str, Any] = {
        "model": sampler.model, "prompt": tokens, "n": int(request.get("num_samples") or 1),
        "max_tokens": params.get("max_tokens") or DEFAULT_MAX_TOKENS, "temperature": params.get("temperature", 1.0),
        "top_p": params.get("top_p", 1.0), "top_k": params.get("top_k", -1), "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }  # fmt: skip
    if params.get("seed") is not None:
        body["seed"] = params["seed"]
    stop = params.get("stop")
    if isinstance(stop, str):
        body["stop"] = [stop]
    elif isinstance(stop, list) and stop and all(isinstance(s, int) for s in stop):
        body["stop_token_ids"] = stop
    elif isinstance(stop, list) and stop:
        body["stop"] = stop
    elif stop == []:
        body["ignore_eos"] = True
    if request.get("prompt_logprobs"):
        body["prompt_logprobs"] = 0
    unsupported = [k for k in ("topk_prompt_logprobs", "topk_sample_logprobs", "prompt_alt_tokens_k")
                   if request.get(k)]  # fmt: skip
    if unsupported or request.get("target_prompt_logprobs") is not None:
        raise InvalidRequest(f"not supported by this server: {', '.join(unsupported) or 'target_prompt_logprobs'}",
                             param="sampling_params")  # fmt: skip
    return body


def _token_id(text: str) -> int:
    return int(text.split(":", 1)[1]) if text.startswith("token_id:") else int(text)


def _prompt_logprobs(tokens: list[int], entries: list[Any] | None) -> list[float | None] | None:
    if entries is None:
        return None
    out: list[float | None] = []
    for token, entry in zip(tokens, entries):
        # Keyed by token id: an int in-process (vLLM's dict[int, Logprob] dumped), a string once sent as JSON.
        hit = (entry or {}).get(token, (entry or {}).get(str(token)))
        value = hit.get("logprob") if isinstance(hit, dict) else getattr(hit, "logprob", None)
        out.append(None if value is None else float(value))
    return out


async def sample(backend: InferenceBackend, catalog: ModelCatalog, sampler: Sampler, request: dict[str, Any]) -> bytes:
    """Sample `num_samples` completions with the sampler's weights; the SampleResponse protobuf."""
    tokens = prompt_tokens(request.get("prompt") or {})
    body = completions_body(sampler, tokens, request)
    entry = catalog.entry(sampler.model)
    if entry.version != sampler.version:
        raise Conflict(f"this sampler holds version {sampler.version} of {sampler.model}, which has since published "
                       f"version {entry.version}; only a model's newest version is served: call "
                       "save_weights_for_sampler again for a sampler of the newest weights", param="model_path")  # fmt: skip
    reply = await backend.openai("completions", body, entry)
    if reply.status_code != 200 or reply.body is None:
        message = ((reply.body or {}).get("error") or {}).get("message") if reply.body else None
        error = InvalidRequest if 400 <= reply.status_code < 500 else ScalarLMError
        raise error(f"sampling failed ({reply.status_code}): {message or reply.body}")
    choices = sorted(reply.body["choices"], key=lambda c: c["index"])
    sequences = []
    for choice in choices:
        logprobs = choice.get("logprobs") or {}
        sequences.append({
            "tokens": [_token_id(t) for t in logprobs.get("tokens") or []],
            "logprobs": [v if v is not None and math.isfinite(v) else -9999.0 for v in logprobs.get("token_logprobs") or []],
            "stop_reason": "length" if choice.get("finish_reason") == "length" else "stop",
        })  # fmt: skip
    prompt = _prompt_logprobs(tokens, choices[0].get("prompt_logprobs")) if request.get("prompt_logprobs") else None
    last_n = request.get("prompt_logprobs_last_n")
    if prompt is not None and last_n:  # only the last N tokens are scored; the SDK checks that the rest are none
        prompt = [None] * max(0, len(prompt) - int(last_n)) + prompt[max(0, len(prompt) - int(last_n)) :]
    return wire.encode_sample_response(sequences, prompt)
