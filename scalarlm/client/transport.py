"""Run flows over HTTP: httpx.Client for the sync client, httpx.AsyncClient for the async one."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx

from scalarlm.client.connection import decode
from scalarlm.client.flows import Call, Flow, Sleep
from scalarlm.protocol.errors import ScalarLMError


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
        response = http.request(step.method, step.path, **_request_kwargs(step, http.timeout))
        try:
            to_send = decode(response)
        except ScalarLMError as exc:
            to_throw = exc


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
        response = await http.request(step.method, step.path, **_request_kwargs(step, http.timeout))
        try:
            to_send = decode(response)
        except ScalarLMError as exc:
            to_throw = exc
