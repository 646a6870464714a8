"""The trainer: megatron-core engine, data, SFT / GRPO loops (full or LoRA), RL sessions, `python -m scalarlm.training`.

Importing this package (and `scalarlm.training.rows`) does not import torch: the control plane uses
`validate_dataset` to reject bad rows at submission time.
"""

from scalarlm.training.rows import validate_dataset

__all__ = ["validate_dataset"]
