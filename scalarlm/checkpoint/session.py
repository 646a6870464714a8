"""The file contract of an RL session (a long-lived trainer taking one step per submitted batch).

`jobs/<id>/session/`:
  request-<k>.jsonl   rows of step k, written by the control plane (atomic rename)
  result-<k>.json     SessionStepResult of step k, written by the trainer after publishing step k
  end                 written by the control plane to end the session; the trainer exits COMPLETED
Files, not sockets, so the same contract holds for a local trainer and one under SLURM.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from scalarlm.checkpoint.jobdir import JobDir, atomic_write_text
from scalarlm.protocol.training import SessionStepResult


class SessionDir:
    """`jobs/<id>/session/` of one RL session."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self.root = job.root / "session"

    def create(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)

    def request_path(self, k: int) -> Path:
        return self.root / f"request-{k}.jsonl"

    def result_path(self, k: int) -> Path:
        return self.root / f"result-{k}.json"

    @property
    def end_path(self) -> Path:
        return self.root / "end"

    def next_request_index(self) -> int:
        """1 + the highest request index written so far."""
        ks = [int(p.stem.split("-")[1]) for p in self.root.glob("request-*.jsonl")]
        return max(ks, default=0) + 1

    def write_request(self, k: int, rows: list[dict[str, Any]]) -> None:
        atomic_write_text(self.request_path(k), "".join(json.dumps(r) + "\n" for r in rows))

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
