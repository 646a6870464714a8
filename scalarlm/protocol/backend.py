"""The two seams between the control plane and an inference worker, as structural protocols.

`server` and `inference` never import each other: the worker implements `InferenceBackend`
(the control plane forwards OpenAI requests to it and reads its load), and the control plane
implements `WorkSource` (the worker's pull loop leases batch work from it). In the embedded
default both are plain in-process objects; in split mode each has an HTTP implementation.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeVar, runtime_checkable

from scalarlm.protocol.generate import (
    EngineLoad,
    FinishWorkRequest,
    FinishWorkResponse,
    GetWorkRequest,
    GetWorkResponse,
    ModelVersion,
)

OpenAIRoute = Literal["models", "completions", "chat/completions"]

# Split mode: the HTTP header carrying an OpenAI request's `model` entry (a ModelVersion as JSON) to a worker.
MODEL_HEADER = "X-ScalarLM-Model"


@dataclass
class OpenAIReply:
    """A worker's answer to one OpenAI request: a JSON body, or an SSE byte stream."""

    status_code: int
    body: dict[str, Any] | None = None
    stream: AsyncIterator[bytes] | None = None
    headers: dict[str, str] = field(default_factory=dict)


# An OpenAI reply for a client that went away before it was ready (nginx's "client closed request"); never read.
CLIENT_GONE = OpenAIReply(status_code=499, body={})

T = TypeVar("T")


async def unless_disconnected(receive: Callable[[], Awaitable[Mapping[str, Any]]], work: Awaitable[T],
                              gone: T) -> T:  # fmt: skip
    """`work`'s result, or `gone` as soon as the client disconnects (ASGI `http.disconnect` on `receive`, read after
    the request body): `work` is then cancelled, and vLLM aborts a request whose handler is cancelled, freeing its
    sequences. What vLLM's own server does for each request (`with_cancellation`); a handler called directly, as the
    control plane and the split worker call it, does not get that."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await receive()).get("type") != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler itself was cancelled (shutdown): so is the work
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    return gone


@runtime_checkable
class InferenceBackend(Protocol):
    """What the control plane needs from an inference worker."""

    async def openai(self, route: OpenAIRoute, body: dict[str, Any], model: ModelVersion | None = None) -> OpenAIReply:
        """Serve one OpenAI request with vLLM's own OpenAI code (wire format identical to vLLM's).

        `model`: the control plane's newest entry for `body["model"]` (kind, path, version). The worker
        loads or swaps those weights before the request, as for batch work, so a model is servable as
        soon as the control plane lists it, whether or not a get_work reply has named it yet.
        """
        ...

    def load(self) -> EngineLoad:
        """The engine's current load (sequences running/waiting, KV cache use)."""
        ...

    async def healthy(self) -> bool:
        """True when the engine answers."""
        ...


@runtime_checkable
class WorkSource(Protocol):
    """What a worker's pull loop needs from the control plane's queue."""

    async def get_work(self, request: GetWorkRequest) -> GetWorkResponse: ...

    async def finish_work(self, request: FinishWorkRequest) -> FinishWorkResponse: ...


@runtime_checkable
class EmbeddedWorker(Protocol):
    """An inference worker living inside the control plane's process (the embedded default).

    The control plane's lifespan calls `start(source)` once its queue is open (the engine must be
    built inside the running event loop) and `stop()` on shutdown; `backend` serves OpenAI routes.
    """

    backend: InferenceBackend

    async def start(self, source: WorkSource) -> None: ...

    async def stop(self) -> None: ...
