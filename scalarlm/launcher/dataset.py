"""Dataset row validation for the control plane, which may not import the trainer package directly."""

from __future__ import annotations

from pathlib import Path


def validate_rows(path: Path) -> int:
    """Check every row of a JSONL dataset; return the row count or raise InvalidRequest naming the bad line."""
    # scalarlm.training.rows is torch-free; the import stays here so the server reaches it only through us.
    from scalarlm.training.rows import validate_dataset

    return validate_dataset(path)
