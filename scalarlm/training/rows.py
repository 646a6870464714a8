"""Dataset rows for the trainer: the shapes and checks live in `scalarlm.protocol.rows` (torch-free, shared with
the control plane, which validates rows in-process at submission); re-exported here for trainer code."""

from __future__ import annotations

from scalarlm.protocol.rows import (
    CHAT_ROLES,
    Row,
    check_messages,
    iter_rows,
    parse_row,
    read_rl_objects,
    read_rows,
    rl_row_from_object,
    row_from_object,
    validate_dataset,
)

__all__ = [
    "CHAT_ROLES", "Row", "check_messages", "iter_rows", "parse_row", "read_rl_objects", "read_rows",
    "rl_row_from_object", "row_from_object", "validate_dataset",
]
