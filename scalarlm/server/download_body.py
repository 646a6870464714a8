"""The body of POST /v1/generate/download, spooled to a temporary file page by page.

A 200k-prompt batch's results are tens of MB of JSON: writing them from SQLite pages to a file keeps
memory bounded, and the file's size gives the Content-Length that ScalarLM's SDK needs (it divides
by it while reading).
"""

from __future__ import annotations

import json
import tempfile
from collections.abc import AsyncIterator
from typing import IO

import anyio.to_thread

from scalarlm.queue import RequestQueue

PAGE = 2000
READ_CHUNK = 256 * 1024


def spool_download(queue: RequestQueue, batch_id: str, total: int, finished: int) -> tuple[IO[bytes], int]:
    """Write the `DownloadResponse` JSON (finished results only) to a temp file; return it and its size."""
    out = tempfile.TemporaryFile()
    head = {"request_id": batch_id, "current_index": finished, "total_requests": total}
    out.write(json.dumps(head)[:-1].encode() + b', "results": {')
    after: str | None = None
    sep = b""
    while page := queue.finished_page(batch_id, after, PAGE):
        body = ",".join(f"{json.dumps(r['request_id'])}:{json.dumps(r)}" for r in page).encode()
        out.write(sep + body)
        sep = b","
        after = page[-1]["request_id"]
    out.write(b"}}")
    size = out.tell()
    out.seek(0)
    return out, size


async def file_chunks(file: IO[bytes]) -> AsyncIterator[bytes]:
    """Stream a spooled body and close it when done (or when the client goes away)."""
    try:
        while chunk := await anyio.to_thread.run_sync(file.read, READ_CHUNK):
            yield chunk
    finally:
        file.close()
