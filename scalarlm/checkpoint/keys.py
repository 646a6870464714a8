"""Internal keys kept on the shared volume: one private file each, created once by whoever needs it first.

`internal/notify.key`: the trainers' credential for announcing published steps. `internal/worker.key`: the
credential between the control plane and its inference workers in split mode (workers present it on the queue's
worker routes; the control plane presents it to every worker route). A worker key may instead come from a file
the operator mounts (`server.worker_key_file`, e.g. the Helm Secret). Keys travel only in files and headers,
never on a command line or in a log.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

NOTIFY_KEY_FILE = Path("internal") / "notify.key"
WORKER_KEY_FILE = Path("internal") / "worker.key"


def shared_key(path: Path) -> str:
    """The key in `path`: created once (0600 in a 0700 directory), then reused across restarts and processes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    os.chmod(path.parent, 0o700)
    if not path.exists():
        # Write a private temp file, then link it into place: a reader never sees an empty key, and of two
        # processes creating it at once (the control plane and a worker starting together), one key wins and
        # both return it.
        tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass
        finally:
            tmp.unlink(missing_ok=True)
    if path.stat().st_mode & 0o077:
        os.chmod(path, 0o600)
    return path.read_text().strip()


def worker_key(home: Path, key_file: Path | None) -> str:
    """The split-mode worker key: the operator's file when configured (it must exist and hold a key), else the
    one on the shared volume."""
    if key_file is None:
        return shared_key(home / WORKER_KEY_FILE)
    key = key_file.read_text().strip()
    if not key:
        raise ValueError(f"server.worker_key_file {key_file} is empty")
    return key
