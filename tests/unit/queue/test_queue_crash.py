"""Crash safety: a real process enqueues and leases, is SIGKILLed, and nothing is lost or doubled."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from scalarlm.protocol.generate import Completion, WorkResult
from scalarlm.queue import RequestQueue

CHILD = textwrap.dedent(
    """
    import sys, time
    from scalarlm.queue import RequestQueue
    q = RequestQueue(sys.argv[1], lease_seconds=float(sys.argv[2]))
    batch = q.enqueue(({"prompt": f"p{i}"} for i in range(500)), "m")
    q.lease(120, "doomed-worker")
    print(batch.batch_id, flush=True)
    time.sleep(600)
    """
)


def _killed_child(path: Path, lease_seconds: float) -> str:
    proc = subprocess.Popen(
        [sys.executable, "-c", CHILD, str(path), str(lease_seconds)], stdout=subprocess.PIPE, text=True
    )
    batch_id = proc.stdout.readline().strip()
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    return batch_id


def _drain(queue: RequestQueue, now: float) -> list[str]:
    done: list[str] = []
    while items := queue.lease(64, "survivor", now=now):
        queue.complete([WorkResult(request_id=i.request_id, model=i.model, outputs=[Completion(text=i.prompt)]) for i in items])
        done.extend(i.request_id for i in items)
    return done


def test_sigkill_then_reopen_completes_every_item_exactly_once(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite"
    batch_id = _killed_child(path, lease_seconds=30)
    queue = RequestQueue(path, lease_seconds=30)
    counts = queue.counts()
    assert (counts.queued, counts.leased) == (380, 120)
    first = _drain(queue, now=time.time())
    assert len(first) == 380  # the dead worker's leases are not handed out early
    later = _drain(queue, now=time.time() + 31)  # ...but come back once they expire
    assert len(later) == 120
    assert len(set(first + later)) == 500
    progress = queue.batch_progress(batch_id)
    assert progress.finished == 500
    assert all(r.response == f"p{int(rid.rsplit('_', 1)[1])}" for rid, r in progress.results.items())
    queue.close()


def test_restart_of_embedded_server_requeues_its_dead_leases_at_once(tmp_path: Path) -> None:
    path = tmp_path / "queue.sqlite"
    _killed_child(path, lease_seconds=3600)
    queue = RequestQueue(path)
    assert queue.requeue_all_leased() == 120
    assert len(_drain(queue, now=time.time())) == 500
    assert queue.counts().completed == 500
    queue.close()
