"""The shared-directory contract between training and inference (see ARCHITECTURE.md).

`jobs/<id>/` holds the job's config, dataset, status, metrics, logs, published HF-format checkpoints
(`checkpoints/step-<N>/`, renamed into place when complete, named by `checkpoints/latest`) and resume state.
"""

from scalarlm.checkpoint.jobdir import JobDir
from scalarlm.checkpoint.publish import latest_step, list_steps, publish_step, read_manifest, repair_latest

__all__ = ["JobDir", "latest_step", "list_steps", "publish_step", "read_manifest", "repair_latest"]
