"""Durable request queue on SQLite: enqueue a batch, lease, complete, expire, count, clear."""

from scalarlm.queue.service import QueueService
from scalarlm.queue.store import BatchProgress, EnqueuedBatch, RequestQueue, Throughput, request_id_for

__all__ = ["BatchProgress", "EnqueuedBatch", "QueueService", "RequestQueue", "Throughput", "request_id_for"]
