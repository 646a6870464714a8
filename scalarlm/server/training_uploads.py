"""Chunked training uploads (`/v1/megatron/upload/init|chunk|finalize`), as the ScalarLM SDK sends large archives.

A session lives in `$SCALARLM_HOME/uploads/<upload_id>/`: `session.json` plus one file per received
chunk. Re-sending init with the same archive hash resumes it (the SDK skips chunks already received). A session no
chunk reached for `upload.abandoned_upload_seconds` is removed (`remove_abandoned`, swept by the app).
"""

from __future__ import annotations

import hashlib
import math
import os
import shutil
import time
from pathlib import Path

from scalarlm.checkpoint.jobdir import atomic_write_text
from scalarlm.config import UploadSettings
from scalarlm.protocol.errors import ChecksumMismatch, InvalidRequest, NotFound, PayloadTooLarge
from scalarlm.protocol.training import UploadChunkResponse, UploadInitRequest, UploadInitResponse

SESSION_FILE = "session.json"


class UploadSessions:
    """Chunk sessions under `root`, within the size limits of `limits`."""

    def __init__(self, root: Path, limits: UploadSettings) -> None:
        self.root = root
        self.limits = limits

    def _dir(self, upload_id: str) -> Path:
        if len(upload_id) != 32 or any(c not in "0123456789abcdef" for c in upload_id):
            raise NotFound(f"upload {upload_id!r} does not exist", param="upload_id")
        return self.root / f"chunked-{upload_id}"

    def session(self, upload_id: str) -> UploadInitRequest:
        """The init request of an open session; NotFound if there is none."""
        path = self._dir(upload_id) / SESSION_FILE
        if not path.exists():
            raise NotFound(f"upload {upload_id!r} does not exist", param="upload_id")
        return UploadInitRequest.model_validate_json(path.read_text())

    def received(self, upload_id: str) -> list[int]:
        d = self._dir(upload_id)
        return sorted(int(p.name[6:]) for p in d.glob("chunk-*") if p.name[6:].isdigit())

    def init(self, request: UploadInitRequest) -> UploadInitResponse:
        """Open (or resume) the session for this archive; sizes beyond the limits are 413."""
        limits = self.limits
        if request.total_size > limits.max_upload_bytes:
            raise PayloadTooLarge(
                f"upload of {request.total_size} bytes exceeds the limit of {limits.max_upload_bytes}", param="total_size"
            )
        if request.chunk_size > limits.max_chunk_bytes:
            raise PayloadTooLarge(
                f"chunk_size {request.chunk_size} exceeds the limit of {limits.max_chunk_bytes}", param="chunk_size"
            )
        if request.num_chunks != math.ceil(request.total_size / request.chunk_size):
            raise InvalidRequest(
                f"num_chunks {request.num_chunks} does not match total_size / chunk_size", param="num_chunks"
            )
        key = f"{request.total_hash.lower()}:{request.chunk_size}:{sorted(request.params.items())!r}"
        upload_id = hashlib.sha256(key.encode()).hexdigest()[:32]
        d = self._dir(upload_id)
        d.mkdir(parents=True, exist_ok=True)
        atomic_write_text(d / SESSION_FILE, request.model_dump_json())
        return UploadInitResponse(upload_id=upload_id, received_chunks=self.received(upload_id))

    def chunk(self, upload_id: str, index: int, sha256: str | None, data: bytes) -> UploadChunkResponse:
        """Store one chunk after checking its index, size and hash (422 on a hash mismatch: the SDK retries)."""
        session = self.session(upload_id)
        if not 0 <= index < session.num_chunks:
            raise InvalidRequest(f"chunk index {index} is outside 0..{session.num_chunks - 1}", param="X-Chunk-Index")
        if len(data) > session.chunk_size:
            raise PayloadTooLarge(f"chunk of {len(data)} bytes exceeds chunk_size {session.chunk_size}", param="body")
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256.lower():
            raise ChecksumMismatch(f"chunk {index} does not match its X-Chunk-Hash", param="X-Chunk-Hash")
        d = self._dir(upload_id)
        tmp = d / f".chunk-{index}.{os.getpid()}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, d / f"chunk-{index}")
        return UploadChunkResponse(upload_id=upload_id, chunk_index=index, received_chunks=len(self.received(upload_id)))

    def assemble(self, upload_id: str) -> tuple[Path, UploadInitRequest]:
        """Join the chunks into one archive and check its size and hash; return it with the session's request."""
        session = self.session(upload_id)
        missing = sorted(set(range(session.num_chunks)) - set(self.received(upload_id)))
        if missing:
            raise InvalidRequest(f"upload {upload_id} is missing chunks {missing[:10]}", param="upload_id")
        d = self._dir(upload_id)
        archive = d / "archive"
        digest = hashlib.sha256()
        with open(archive, "wb") as out:
            for index in range(session.num_chunks):
                data = (d / f"chunk-{index}").read_bytes()
                digest.update(data)
                out.write(data)
        size = archive.stat().st_size
        if size != session.total_size or digest.hexdigest() != session.total_hash.lower():
            archive.unlink()
            raise ChecksumMismatch(
                f"assembled upload is {size} bytes with a different hash than declared", param="total_hash"
            )
        return archive, session

    def discard(self, upload_id: str) -> None:
        shutil.rmtree(self._dir(upload_id), ignore_errors=True)

    def remove_abandoned(self) -> list[str]:
        """Remove the sessions whose last chunk (or init) is `abandoned_upload_seconds` old, and the spool files of
        single-POST uploads (`single-*`) written to that long ago (a process killed mid-request leaves one); the
        session ids and spool names."""
        now = time.time()
        removed = []
        paths = sorted(self.root.glob("chunked-*")) + sorted(self.root.glob("single-*")) if self.root.is_dir() else []
        for path in paths:
            try:
                last = max(p.stat().st_mtime for p in (path, *(path.iterdir() if path.is_dir() else ())))
            except OSError:  # finalized or removed meanwhile
                continue
            if now - last >= self.limits.abandoned_upload_seconds:
                if path.is_dir():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    path.unlink(missing_ok=True)
                removed.append(path.name.removeprefix("chunked-"))
        return removed
