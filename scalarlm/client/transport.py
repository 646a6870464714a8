"""Run flows over HTTP: httpx.Client for the sync client, httpx.AsyncClient for the async one.

`SyncRunner` / `AsyncRunner` are what clients and their handles (jobs, sessions, step futures) hold: a
callable that runs one flow. Handles never hold a client, so nothing in `scalarlm.client` imports back up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx

from scalarlm.client.connection import decode
from scalarlm.client.flows import Call, Flow, Sleep
from scalarlm.protocol.errors import ScalarLMError

logger = logging.getLogger(__name__)

# A batch's results are durable on the server, so a poll survives a short network or gateway outage.
RETRIES = 6
FIRST_BACKOFF_SECONDS = 0.5
MAX_BACKOFF_SECONDS = 8.0
GATEWAY_STATUSES = frozenset({502, 503, 504})


def _backoff(attempt: int) -> float:
    return min(MAX_BACKOFF_SECONDS, FIRST_BACKOFF_SECONDS * 2**attempt)


def _should_retry(call: Call, attempt: int, response: httpx.Response | None, exc: Exception | None) -> bool:
    if not call.retry or attempt >= RETRIES:
        return False
    if exc is None and (response is None or response.status_code not in GATEWAY_STATUSES):
        return False
    logger.warning("%s %s failed (%s); retrying in %.1f s", call.method, call.path,
                   exc or f"HTTP {response.status_code}", _backoff(attempt))
    return True


def _request_kwargs(call: Call, timeout: httpx.Timeout) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if call.json is not None:
        kwargs["json"] = call.json
    if call.files is not None:
        kwargs["files"] = call.files
    if call.content is not None:
        kwargs["content"] = call.content
    if call.headers is not None:
        kwargs["headers"] = call.headers
    if call.extra_timeout:
        read = (timeout.read or 0.0) + call.extra_timeout
        kwargs["timeout"] = httpx.Timeout(timeout.connect, read=read, write=timeout.write, pool=timeout.pool)
    return kwargs


def run_sync(http: httpx.Client, flow: Flow) -> Any:
    """Drive a flow to completion with blocking requests."""
    to_send: Any = None
    to_throw: ScalarLMError | None = None
    while True:
        try:
            step = flow.throw(to_throw) if to_throw is not None else flow.send(to_send)
        except StopIteration as done:
            return done.value
        to_send, to_throw = None, None
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            continue
        try:
            to_send = decode(_send_sync(http, step))
        except ScalarLMError as exc:
            to_throw = exc


def _send_sync(http: httpx.Client, call: Call) -> httpx.Response:
    """One request, resent after transient failures when the call allows it."""
    attempt = 0
    while True:
        try:
            response = http.request(call.method, call.path, **_request_kwargs(call, http.timeout))
        except httpx.TransportError as exc:
            if not _should_retry(call, attempt, None, exc):
                raise
        else:
            if not _should_retry(call, attempt, response, None):
                return response
        time.sleep(_backoff(attempt))
        attempt += 1


async def run_async(http: httpx.AsyncClient, flow: Flow) -> Any:
    """Drive a flow to completion without blocking the event loop."""
    to_send: Any = None
    to_throw: ScalarLMError | None = None
    while True:
        try:
            step = flow.throw(to_throw) if to_throw is not None else flow.send(to_send)
        except StopIteration as done:
            return done.value
        to_send, to_throw = None, None
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            continue
        try:
            to_send = decode(await _send_async(http, step))
        except ScalarLMError as exc:
            to_throw = exc


async def _send_async(http: httpx.AsyncClient, call: Call) -> httpx.Response:
    """One request, resent after transient failures when the call allows it."""
    attempt = 0
    while True:
        try:
            response = await http.request(call.method, call.path, **_request_kwargs(call, http.timeout))
        except httpx.TransportError as exc:
            if not _should_retry(call, attempt, None, exc):
                raise
        else:
            if not _should_retry(call, attempt, response, None):
                return response
        await asyncio.sleep(_backoff(attempt))
        attempt += 1


class SyncRunner:
    """Runs flows with one pooled httpx.Client (blocking)."""

    def __init__(self, api_url: str, headers: dict[str, str], timeout: float) -> None:
        self.http = httpx.Client(base_url=api_url, headers=headers, timeout=timeout)

    def __call__(self, flow: Flow) -> Any:
        return run_sync(self.http, flow)

    def close(self) -> None:
        self.http.close()


class AsyncRunner:
    """Runs each flow with its own httpx.AsyncClient, so one runner works across event loops."""

    def __init__(self, api_url: str, headers: dict[str, str], timeout: float) -> None:
        self.api_url, self.headers, self.timeout = api_url, headers, timeout

    async def __call__(self, flow: Flow) -> Any:
        async with httpx.AsyncClient(base_url=self.api_url, headers=self.headers, timeout=self.timeout) as http:
            return await run_async(http, flow)
