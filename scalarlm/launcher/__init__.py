"""Launchers start trainer processes for job directories: `LocalLauncher` (subprocess/mpirun), `SlurmLauncher` (sbatch).

The control plane reaches the trainer only through this package: launch, state, cancel, logs,
reconciliation after a restart. Dataset rows are checked in-process by `scalarlm.protocol.rows`.
"""

from scalarlm.config import Settings
from scalarlm.launcher.archive import copy_upload, extract_dataset
from scalarlm.launcher.base import Launcher, LaunchRecord, RunState, cancel_requested, read_record
from scalarlm.launcher.local import LocalLauncher, mark_cancelled
from scalarlm.launcher.reconcile import ResumePolicy, reconcile, reconcile_job, resume_job
from scalarlm.launcher.slurm import SlurmLauncher


def default_launchers(settings: Settings) -> dict[str, Launcher]:
    """One launcher of each kind, keyed by the name train args and launch records use."""
    return {"local": LocalLauncher(settings), "slurm": SlurmLauncher(settings)}


__all__ = [
    "Launcher", "LaunchRecord", "LocalLauncher", "ResumePolicy", "RunState", "SlurmLauncher", "cancel_requested",
    "copy_upload", "default_launchers", "extract_dataset", "mark_cancelled", "read_record", "reconcile", "reconcile_job",
    "resume_job",
]  # fmt: skip
