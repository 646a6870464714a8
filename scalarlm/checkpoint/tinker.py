"""What a Tinker training run keeps in its session's job directory, and the `tinker://` paths that name it.

`jobs/<id>/tinker/`:
  run.json                       the run as created: LoRA config, user metadata, owner, created time, and the
                                 model id the SDK derived itself for a client made from saved state (its alias)
  weights/<name>/                save_state: rank-<r>.pt per rank (trainable weights, optimizer state, step) and
                                 manifest.json, written as `.<name>.tmp/` and renamed when every rank has saved
  sampler_weights/<name>.json    save_weights_for_sampler(name): {"version", "time"}: the published
                                 `checkpoints/step-<version>` that name serves

`tinker://<run>/weights/<name>` names a saved state, `tinker://<run>/sampler_weights/<name>` a sampler's weights
(the three-part grammar of the SDK's ParsedCheckpointTinkerPath). Files, so a path stays valid across restarts of
the control plane and is readable by a trainer on another host sharing the volume.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from scalarlm.checkpoint.jobdir import JobDir, atomic_write_text
from scalarlm.protocol.training import check_name

PATH_PREFIX = "tinker://"
Kind = Literal["weights", "sampler_weights"]
KINDS: tuple[Kind, ...] = ("weights", "sampler_weights")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class TinkerPath:
    """A parsed `tinker://<run>/<kind>/<name>`."""

    run: str
    kind: Kind
    name: str

    @property
    def checkpoint_id(self) -> str:
        return f"{self.kind}/{self.name}"

    def __str__(self) -> str:
        return f"{PATH_PREFIX}{self.run}/{self.kind}/{self.name}"


def parse_tinker_path(path: str) -> TinkerPath:
    """`tinker://<run>/weights|sampler_weights/<name>`; ValueError saying what is wrong otherwise."""
    if not isinstance(path, str) or not path.startswith(PATH_PREFIX):
        raise ValueError(f"{path!r} is not a tinker path (tinker://<run>/weights/<name>)")
    parts = path[len(PATH_PREFIX) :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0] or not parts[2]:
        raise ValueError(f"{path!r}: a tinker path is tinker://<run>/weights/<name> or "
                         "tinker://<run>/sampler_weights/<name>")  # fmt: skip
    check_name(parts[2], "checkpoint name")
    return TinkerPath(parts[0], parts[1], parts[2])  # type: ignore[arg-type]


class TinkerRunDir:
    """`jobs/<id>/tinker/` of one training run."""

    def __init__(self, job: JobDir) -> None:
        self.job = job
        self.root = job.root / "tinker"

    @property
    def run_path(self) -> Path:
        return self.root / "run.json"

    def is_run(self) -> bool:
        return self.run_path.exists()

    def write_run(self, run: dict[str, Any]) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.run_path, json.dumps(run) + "\n")

    def read_run(self) -> dict[str, Any]:
        return json.loads(self.run_path.read_text()) if self.run_path.exists() else {}

    def weights_dir(self, name: str) -> Path:
        return self.root / "weights" / check_name(name, "checkpoint name")

    def weights_tmp_dir(self, name: str) -> Path:
        return self.root / "weights" / f".{check_name(name, 'checkpoint name')}.tmp"

    def read_weights_manifest(self, name: str) -> dict[str, Any] | None:
        path = self.weights_dir(name) / MANIFEST
        return json.loads(path.read_text()) if path.exists() else None

    def sampler_path(self, name: str) -> Path:
        return self.root / "sampler_weights" / f"{check_name(name, 'checkpoint name')}.json"

    def write_sampler(self, name: str, version: int) -> None:
        path = self.sampler_path(name)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(path, json.dumps({"version": version, "time": time.time()}) + "\n")

    def read_sampler(self, name: str) -> dict[str, Any] | None:
        path = self.sampler_path(name)
        return json.loads(path.read_text()) if path.exists() else None

    def checkpoints(self) -> list[dict[str, Any]]:
        """Every saved state and named sampler of the run, oldest first: kind, name, time, size_bytes."""
        found = []
        for manifest_path in sorted((self.root / "weights").glob(f"*/{MANIFEST}")):
            manifest = json.loads(manifest_path.read_text())
            found.append({"kind": "weights", "name": manifest_path.parent.name, "time": manifest["time"],
                          "size_bytes": manifest.get("size_bytes"), "user_metadata": manifest.get("user_metadata")})  # fmt: skip
        for sampler_path in sorted((self.root / "sampler_weights").glob("*.json")):
            entry = json.loads(sampler_path.read_text())
            found.append({"kind": "sampler_weights", "name": sampler_path.stem, "time": entry["time"],
                          "size_bytes": None, "user_metadata": None, "version": entry["version"]})  # fmt: skip
        return sorted(found, key=lambda c: c["time"])
