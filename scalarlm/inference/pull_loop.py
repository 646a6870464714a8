"""The worker's pull loop: lease batch work sized by the engine's free capacity, run it, post results.

One task pulls (`get_work`) whenever enough sequence slots are free, keeping a small prefetch margin
queued inside vLLM so the engine never idles between pulls; every item runs as its own `generate`
task; a flusher posts finished results (`finish_work`) in coalesced batches.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from typing import Any

from scalarlm.config import Settings
from scalarlm.inference.engine import Engine
from scalarlm.inference.hot_swap import WeightsLease, WeightsManager
from scalarlm.inference.results import error_result, to_work_result
from scalarlm.inference.sampling import SamplingCache, engine_prompts
from scalarlm.inference.versions import ModelVersions
from scalarlm.inference.vllm_api import EngineDeadError
from scalarlm.protocol.backend import WorkSource
from scalarlm.protocol.generate import FinishWorkRequest, GetWorkRequest, WorkItem, WorkResult

logger = logging.getLogger(__name__)

KV_CACHE_FULL = 0.95  # no new work above this KV cache use (the engine would preempt)
MAX_BACKOFF = 0.5  # seconds between polls of an empty queue, at most (or generate.poll_interval, if longer)
FLUSH_DELAY = 0.02  # results finishing within this window go in one finish_work call (unless the engine is idle)
FLUSH_MAX = 64  # ... unless this many are ready
STOP_TIMEOUT = 30.0  # seconds stop() lets in-flight items finish


def _describe(exc: BaseException) -> str:
    """A one-line message for an item's error result (vLLM wraps some causes)."""
    cause = exc.__cause__ if str(exc) == "" and exc.__cause__ is not None else exc
    return f"{type(cause).__name__}: {cause}"


class PullLoop:
    """Keeps one engine busy with work leased from a `WorkSource`."""

    def __init__(
        self,
        engine: Engine,
        source: WorkSource,
        settings: Settings,
        worker_id: str,
        versions: ModelVersions | None = None,
        weights: WeightsManager | None = None,
    ) -> None:
        self.engine = engine
        self.source = source
        self.settings = settings
        self.worker_id = worker_id
        self.weights = weights or WeightsManager(engine, settings, versions)
        self.versions = self.weights.versions
        max_seqs = engine.load.max_num_seqs
        # Keep up to one more engine-full of work queued inside vLLM: short generations can free every
        # slot in one step, and the queued work fills them before the next pull returns.
        self.prefetch = max_seqs
        self.min_pull = max(1, max_seqs // 4)
        self._tokenizer: Any = None
        self._sampling = SamplingCache(settings.generate.default_max_tokens)
        self._ids = itertools.count()
        self._tasks: set[asyncio.Task[None]] = set()
        self._results: list[WorkResult] = []
        self._results_ready = asyncio.Event()
        self._batch_full = asyncio.Event()
        self._slot_freed = asyncio.Event()
        self._wake = asyncio.Event()
        self._stopping = False
        self._closing = False
        self._pull_task: asyncio.Task[None] | None = None
        self._flush_task: asyncio.Task[None] | None = None

    # ---- lifecycle ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start pulling and posting (call inside the running event loop)."""
        self._tokenizer = self.engine.llm.get_tokenizer()
        self._pull_task = asyncio.create_task(self._pull_forever(), name=f"pull-loop-{self.worker_id}")
        self._flush_task = asyncio.create_task(self._flush_forever(), name=f"flush-{self.worker_id}")

    async def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop pulling, let in-flight items finish (bounded), post their results."""
        self._stopping = True
        self._wake.set()
        self._slot_freed.set()
        if self._pull_task is not None:
            await self._pull_task
        if self._tasks:
            _, pending = await asyncio.wait(set(self._tasks), timeout=timeout)
            for task in pending:  # their leases expire and the queue hands them out again
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        self._closing = True
        self._results_ready.set()
        if self._flush_task is not None:
            await self._flush_task

    @property
    def in_flight(self) -> int:
        """Items submitted to the engine and not finished yet."""
        return len(self._tasks)

    # ---- pulling --------------------------------------------------------------------------------

    def capacity(self) -> int:
        """How many sequences to ask for now: 0 until enough slots are free to make a pull worthwhile."""
        load = self.engine.load
        if load.in_flight > 0 and load.kv_cache_usage >= KV_CACHE_FULL:
            return 0
        deficit = load.max_num_seqs + self.prefetch - load.in_flight
        if deficit < self.min_pull and load.in_flight > 0:
            return 0
        return min(deficit, self.settings.generate.max_lease_batch)

    async def _pull_forever(self) -> None:
        """Ask for work while there is room; back off while the queue is empty.

        `generate.poll_interval` is the first wait after an empty answer from a source that answers at once (and the
        wait for a free slot); the wait doubles while the queue stays empty, up to MAX_BACKOFF or poll_interval."""
        poll = self.settings.generate.poll_interval
        longest = max(MAX_BACKOFF, poll)
        backoff = poll
        while not self._stopping:
            if self.engine.llm.errored:
                logger.error("engine is dead; worker %s stops pulling", self.worker_id)
                return
            capacity = self.capacity()
            if capacity <= 0:
                self._slot_freed.clear()
                await self._pause(self._slot_freed, poll)
                continue
            request = GetWorkRequest(
                worker_id=self.worker_id,
                capacity=capacity,
                load=self.engine.load.snapshot(),
                loaded=self.versions.loaded(),
                holding=self.weights.holding,
            )
            asked = time.monotonic()
            try:
                reply = await self.source.get_work(request)
            except Exception as exc:  # the loop outlives any trouble reaching the control plane
                logger.warning("get_work failed (%s: %s); retrying in %.2fs", type(exc).__name__, exc, backoff)
                await self._pause(self._wake, backoff)
                backoff = min(backoff * 2, longest)
                continue
            self.weights.update_catalog(reply.models)  # an empty reply still names the newest versions
            if not reply.requests:
                # A source that long-polls (the control plane waits for new work before answering empty) has
                # already waited: ask again at once, or work queued during a pause would wait for it. Only a
                # source that answered at once gets the growing back-off.
                if time.monotonic() - asked < poll:
                    await self._pause(self._wake, backoff)
                    backoff = min(backoff * 2, longest)
                continue
            backoff = poll
            prompts = await asyncio.to_thread(engine_prompts, reply.requests, self._tokenizer, self.engine.llm.renderer)
            for item, prompt in zip(reply.requests, prompts):
                self._submit(item, prompt)

    async def _pause(self, event: asyncio.Event, seconds: float) -> None:
        """Sleep up to `seconds`, waking early when `event` is set."""
        try:
            await asyncio.wait_for(event.wait(), timeout=seconds)
        except TimeoutError:
            pass

    def _submit(self, item: WorkItem, prompt: dict[str, Any] | Exception) -> None:
        """Start one item (its engine prompt already tokenized) as its own engine request."""
        if not self.weights.servable(item.model):
            self._post(error_result(item, f"model '{item.model}' is not served by this worker", 0))
            return
        sequences = item.sampling.n
        self.engine.load.add(sequences)
        task = asyncio.create_task(self._run_item(item, prompt, sequences))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run_item(self, item: WorkItem, prompt: dict[str, Any] | Exception, sequences: int) -> None:
        """Generate one item on its model's newest weights; any failure of this item becomes its error result."""
        result: WorkResult | None = None
        lease: WeightsLease | None = None
        version = 0
        try:
            lease = await self.weights.acquire(item.model)
            version = lease.version
            if isinstance(prompt, Exception):  # its chat messages could not be rendered
                raise prompt
            params = self._sampling.get(item.sampling)
            final = None
            request_id = f"{item.request_id}#{next(self._ids)}"
            generation = self.engine.llm.generate(prompt, params, request_id=request_id, lora_request=lease.lora)
            async for output in generation:
                final = output
            if final is None:
                result = error_result(item, "the engine returned no output", version)
            else:
                result = to_work_result(item, final, version)
        except EngineDeadError:
            logger.error("engine died while running %s; its lease will expire", item.request_id)
        except Exception as exc:  # one bad item must not take down the loop
            result = error_result(item, _describe(exc), version)
        finally:
            if lease is not None:
                self.weights.release(lease)
            self.engine.load.done(sequences)
            self._slot_freed.set()
        if result is not None:
            self._post(result)

    # ---- posting --------------------------------------------------------------------------------

    def _post(self, result: WorkResult) -> None:
        """Queue a result for the next finish_work call."""
        self._results.append(result)
        self._results_ready.set()
        # Nothing else runs on the engine, so nothing else will finish within FLUSH_DELAY: post at once.
        if len(self._results) >= FLUSH_MAX or self.engine.load.in_flight == 0:
            self._batch_full.set()

    async def _flush_forever(self) -> None:
        """Post results in batches: whatever finished within FLUSH_DELAY, or FLUSH_MAX at once."""
        while True:
            await self._results_ready.wait()
            if not self._closing and len(self._results) < FLUSH_MAX:
                await self._pause(self._batch_full, FLUSH_DELAY)
            self._results_ready.clear()
            self._batch_full.clear()
            batch, self._results = self._results, []
            if batch:
                await self._send(batch)
            if self._closing and not self._results:
                return

    async def _send(self, batch: list[WorkResult]) -> None:
        """finish_work with retries; while closing, give up after a few tries (leases then expire)."""
        delay = self.settings.generate.poll_interval
        attempt = 0
        while True:
            attempt += 1
            try:
                await self.source.finish_work(FinishWorkRequest(worker_id=self.worker_id, results=batch))
                return
            except Exception as exc:  # keep the results and retry: the control plane may be restarting
                if self._closing and attempt >= 3:
                    logger.error("dropping %d results after %d failed finish_work calls", len(batch), attempt)
                    return
                logger.warning("finish_work failed (attempt %d, %s: %s); retrying", attempt, type(exc).__name__, exc)
                await asyncio.sleep(delay)
                delay = min(delay * 2, MAX_BACKOFF * 4)
