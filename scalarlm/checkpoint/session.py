"""The file contract of an RL session (a long-lived trainer taking one step per submitted batch).

`jobs/<id>/session/`:
  meta-<k>.json       SessionRequestMeta of request k (the version that generated its rows, when accepted),
                      written by the control plane just before the request
  request-<k>.jsonl   rows of step k, written by the control plane (atomic rename)
  result-<k>.json     SessionStepResult of step k, written by the trainer after publishing step k (or refusing it)
  end                 written by the control plane to end the session; the trainer exits COMPLETED
Files, not sockets, so the same contract holds for a local trainer and one under SLURM. Requests may be written
while earlier ones train (up to the session's `max_staleness + 1` in flight); the trainer takes them in order.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalarlm.checkpoint.jobdir import JobDir, atomic_write_text
from scalarlm.protocol.training import SessionRequestMeta, SessionStepResult


class SessionDir:
    """`jobs/<id>/session/` of one RL session."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self.root = job.root / "session"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def request_path(self, k: int) -> Path:
        return self.root / f"request-{k}.jsonl"

    def meta_path(self, k: int) -> Path:
        return self.root / f"meta-{k}.json"

    def result_path(self, k: int) -> Path:
        return self.root / f"result-{k}.json"

    @property
    def end_path(self) -> Path:
        return self.root / "end"

    def next_request_index(self) -> int:
        """1 + the highest request index written so far."""
        ks = [int(p.stem.split("-")[1]) for p in self.root.glob("request-*.jsonl")]
        return max(ks, default=0) + 1

    def write_request(self, k: int, rows: list[dict[str, Any]], meta: SessionRequestMeta | None = None) -> None:
        """Request k: its meta first, then the rows (the trainer starts on the rows file)."""
        if meta is not None:
            atomic_write_text(self.meta_path(k), meta.model_dump_json())
        atomic_write_text(self.request_path(k), "".join(json.dumps(r) + "\n" for r in rows))

    def read_meta(self, k: int) -> SessionRequestMeta:
        """Request k's meta (an empty one for requests written without, e.g. by an older control plane)."""
        p = self.meta_path(k)
        return SessionRequestMeta.model_validate_json(p.read_text()) if p.exists() else SessionRequestMeta()

    def last_result_index(self) -> int:
        """The highest request index with a result (0: none); the trainer answers requests in order."""
        return max((int(p.stem.split("-")[1]) for p in self.root.glob("result-*.json")), default=0)

    def pending(self) -> list[int]:
        """Request indices written that have no result yet, in order."""
        return list(range(self.last_result_index() + 1, self.next_request_index()))

    def read_request(self, k: int) -> list[dict[str, Any]] | None:
        p = self.request_path(k)
        if not p.exists():
            return None
        return [json.loads(line) for line in p.read_text().splitlines() if line.strip()]

    def write_result(self, k: int, result: SessionStepResult) -> None:
        atomic_write_text(self.result_path(k), result.model_dump_json())

    def read_result(self, k: int) -> SessionStepResult | None:
        p = self.result_path(k)
        return SessionStepResult.model_validate_json(p.read_text()) if p.exists() else None

    def request_end(self) -> None:
        atomic_write_text(self.end_path, "end\n")

    def end_requested(self) -> bool:
        return self.end_path.exists()


def batch_version(version: int | None, rows: list[dict[str, Any]]) -> int | None:
    """The version that generated a batch: the oldest of the request's `version` and its rows' (None: unknown)."""
    versions = [v for v in [version, *(r.get("version") for r in rows)] if isinstance(v, int)]
    return min(versions, default=None)


def stale_message(session_id: str, generated: int, current: int, max_staleness: int) -> str:
    """The refusal of a batch generated with version `generated` for weights at version `current` (409)."""
    return (f"session {session_id}: batch generated with version {generated} is {current - generated} versions "
            f"older than the weights at version {current} (max_staleness {max_staleness}); generate again with "
            f"the newest version, or create the session with stale_policy 'reweight' to train it with its "
            f"importance ratio")  # fmt: skip
