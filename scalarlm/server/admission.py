"""Admission control for interactive (OpenAI) requests: beyond capacity, 429 with `Retry-After`.

Capacity is `admit_factor x max_num_seqs` of the engine(s) behind the control plane: up to that many
requests may be in flight through this process; the next is told when to come back, estimated from
recent latency and how far over capacity we are (as ScalarLM does).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from scalarlm.protocol.errors import QueueFull
from scalarlm.protocol.generate import EngineLoad

logger = logging.getLogger(__name__)


@dataclass
class Ticket:
    """One admitted request; hand it back with `Admission.release` when its answer is complete."""

    started: float
    released: bool = False


class Admission:
    """Counts interactive requests in flight and refuses those beyond capacity."""

    def __init__(self, admit_factor: float, latency_smoothing: float = 0.2) -> None:
        self.admit_factor = admit_factor
        self.smoothing = latency_smoothing
        self.in_flight = 0
        self.avg_latency = 1.0

    def capacity(self, load: EngineLoad) -> int:
        """How many interactive requests may be in flight at once."""
        return max(1, int(self.admit_factor * load.max_num_seqs))

    def admit(self, load: EngineLoad) -> Ticket:
        """Take a slot or raise QueueFull with a Retry-After estimate."""
        limit = self.capacity(load)
        if self.in_flight >= limit:
            overload = (self.in_flight + 1) / limit
            retry_after = max(1.0, self.avg_latency * overload * 1.5)
            raise QueueFull(
                f"server busy: {self.in_flight} requests in flight, capacity {limit}; retry after {retry_after:.0f}s",
                retry_after=retry_after,
            )
        self.in_flight += 1
        return Ticket(started=time.monotonic())

    def release(self, ticket: Ticket) -> None:
        """Give the slot back (idempotent) and fold the request's latency into the estimate."""
        if ticket.released:
            return
        ticket.released = True
        self.in_flight -= 1
        latency = time.monotonic() - ticket.started
        self.avg_latency += self.smoothing * (latency - self.avg_latency)

    async def guard_stream(self, ticket: Ticket, stream: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """Pass a streamed answer through, releasing the slot when it ends or the client leaves."""
        try:
            async for chunk in stream:
                yield chunk
        finally:
            self.release(ticket)
            aclose = getattr(stream, "aclose", None)
            if aclose is not None:
                await aclose()
