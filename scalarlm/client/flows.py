"""What each client method does, written once for the sync and the async client.

A flow is a generator that yields `Call`s (one HTTP request each) or `Sleep`s and receives the decoded
JSON body back (or has the typed error thrown into it). `ScalarLM` drives flows with httpx.Client,
`AsyncScalarLM` with httpx.AsyncClient, so both clients behave identically.
"""

from __future__ import annotations

import sys
from collections.abc import Awaitable, Callable, Generator
from dataclasses import dataclass, field
from typing import Any

from tqdm.auto import tqdm

from scalarlm.client.errors import GenerationFailed
from scalarlm.client.payloads import (
    UPLOAD_THRESHOLD,
    PromptInput,
    generate_payload,
    normalize_prompts,
    result_index,
    sampling_fields,
    upload_rows,
)
from scalarlm.protocol.errors import NotFound
from scalarlm.protocol.generate import DownloadResponse, GenerateResponse, GenerateResult, UploadResponse

# Long-poll window asked of the server per results request.
POLL_WAIT_SECONDS = 2.0
# Pause after a poll that brought nothing new, in case the server answers without waiting.
IDLE_PAUSE_SECONDS = 0.05


@dataclass(frozen=True)
class Call:
    """One HTTP request: method, path below the API URL, and a JSON body or multipart files."""

    method: str
    path: str
    json: Any = None
    files: dict[str, tuple[str | None, bytes, str]] | None = None
    # A raw body with its headers (chunked training upload).
    content: bytes | None = None
    headers: dict[str, str] | None = None
    # Read timeout needed beyond the client default (long polls).
    extra_timeout: float = 0.0
    # Safe to send again after a dropped connection or a gateway error (a read of durable results).
    retry: bool = False


@dataclass(frozen=True)
class Sleep:
    seconds: float


Flow = Generator[Call | Sleep, Any, Any]
# What clients and handles hold to run a flow (transport.SyncRunner / AsyncRunner).
Run = Callable[[Flow], Any]
AsyncRun = Callable[[Flow], Awaitable[Any]]


@dataclass
class _Progress:
    """A tqdm bar that is shown only on a terminal unless asked for."""

    total: int
    enabled: bool | None
    bar: Any = field(init=False)

    def __post_init__(self) -> None:
        show = sys.stderr.isatty() if self.enabled is None else self.enabled
        self.bar = tqdm(total=self.total, disable=not show, desc="generate", unit="prompt")

    def advance_to(self, done: int) -> None:
        if done > self.bar.n:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        self.bar.close()


def _check(result: GenerateResult) -> bool:
    """True when the prompt is finished; raise if it failed."""
    if result.error is not None:
        raise GenerationFailed(result.request_id, result.error)
    return result.response is not None


def submit(prompts: PromptInput | list[PromptInput], model_name: str | None, max_tokens: int | None,
           sampling: dict[str, Any]) -> Flow:
    """POST /v1/generate without waiting; return the request ids in prompt order."""
    wire = normalize_prompts(prompts)
    payload = generate_payload(wire, model_name, sampling_fields(max_tokens, sampling))
    body = yield Call("POST", "/v1/generate", json=payload)
    return [r.request_id for r in GenerateResponse.model_validate(body).results]


def get_results(request_ids: list[str], wait_seconds: float | None = None) -> Flow:
    """POST /v1/generate/get_results for these ids (long-polls up to wait_seconds)."""
    payload: dict[str, Any] = {"request_ids": list(request_ids)}
    if wait_seconds is not None:
        payload["wait_seconds"] = wait_seconds
    body = yield Call("POST", "/v1/generate/get_results", json=payload, extra_timeout=wait_seconds or 0.0,
                      retry=True)
    return GenerateResponse.model_validate(body).results


def _poll_small(results: list[GenerateResult], progress: _Progress) -> Flow:
    """Long-poll get_results for the unfinished ids until every prompt is done."""
    by_id = {r.request_id: r for r in results}
    order = [r.request_id for r in results]
    pending = [rid for rid in order if not _check(by_id[rid])]
    progress.advance_to(len(order) - len(pending))
    while pending:
        fresh = yield from get_results(pending, POLL_WAIT_SECONDS)
        for r in fresh:
            by_id[r.request_id] = r
        still = [rid for rid in pending if not _check(by_id[rid])]
        if len(still) == len(pending):
            yield Sleep(IDLE_PAUSE_SECONDS)
        pending = still
        progress.advance_to(len(order) - len(pending))
    return [by_id[rid] for rid in order]


def _upload_and_download(wire: list[Any], model_name: str | None, fields: dict[str, Any],
                         progress: _Progress) -> Flow:
    """POST /v1/generate/upload, then poll /v1/generate/download until every prompt is done."""
    body = yield Call("POST", "/v1/generate/upload",
                      files={"file": ("requests.json", upload_rows(wire, model_name, fields), "application/json")})
    batch = UploadResponse.model_validate(body)
    collected: dict[int, GenerateResult] = {}
    while True:
        body = yield Call("POST", "/v1/generate/download",
                          json={"request_id": batch.request_id, "wait_seconds": POLL_WAIT_SECONDS},
                          extra_timeout=POLL_WAIT_SECONDS, retry=True)
        page = DownloadResponse.model_validate(body)
        before = len(collected)
        for key, result in page.results.items():
            if _check(result):
                collected[result_index(key)] = result
        progress.advance_to(len(collected))
        if len(collected) >= batch.total_requests:
            return [collected[i] for i in sorted(collected)]
        if len(collected) == before:
            yield Sleep(IDLE_PAUSE_SECONDS)


def generate(prompts: PromptInput | list[PromptInput], model_name: str | None, max_tokens: int | None,
             return_details: bool, progress: bool | None, sampling: dict[str, Any]) -> Flow:
    """Submit a batch, wait for every prompt, return texts (or full results) in prompt order."""
    wire = normalize_prompts(prompts)
    fields = sampling_fields(max_tokens, sampling)
    bar = _Progress(len(wire), progress)
    try:
        if len(wire) > UPLOAD_THRESHOLD:
            results = yield from _upload_and_download(wire, model_name, fields, bar)
        else:
            body = yield Call("POST", "/v1/generate", json=generate_payload(wire, model_name, fields))
            stored = GenerateResponse.model_validate(body).results
            results = yield from _poll_small(stored, bar)
    finally:
        bar.close()
    if return_details:
        return results
    return [r.response for r in results]


def get_json(path: str) -> Flow:
    """GET a JSON route."""
    return (yield Call("GET", path))


def post_json(path: str, payload: Any = None) -> Flow:
    """POST a JSON route."""
    return (yield Call("POST", path, json=payload))


def list_models() -> Flow:
    """ScalarLM's /v1/megatron/list_models, or OpenAI's /v1/models where that route is absent."""
    try:
        return (yield Call("GET", "/v1/megatron/list_models"))
    except NotFound:
        return (yield Call("GET", "/v1/models"))


def count(path: str, key: str) -> Flow:
    """GET a route answering {key: n} and return n."""
    body = yield Call("GET", path)
    return int(body[key])
