"""Taking the dataset out of an uploaded training archive, and nothing else (uploaded code is never run)."""

from __future__ import annotations

import posixpath
import tarfile
from pathlib import Path
from typing import IO

from scalarlm.protocol.errors import InvalidRequest, PayloadTooLarge

# The member name the ScalarLM SDK writes; a bundled `ml/` directory beside it is ignored.
DATASET_MEMBERS = ("dataset.jsonlines", "dataset.jsonl")


def _check_member(member: tarfile.TarInfo) -> None:
    """Reject members that could escape a directory or are not plain files/directories."""
    name = member.name
    if name.startswith("/") or "\\" in name or ".." in name.split("/") or "\x00" in name:
        raise InvalidRequest(f"archive member {name!r} has an unsafe path", param="file")
    if member.issym() or member.islnk():
        raise InvalidRequest(f"archive member {name!r} is a link; links are not accepted", param="file")
    if not (member.isfile() or member.isdir()):
        raise InvalidRequest(f"archive member {name!r} is a device or special file", param="file")


def _copy_capped(src: IO[bytes], dest: Path, max_bytes: int) -> int:
    written = 0
    with open(dest, "wb") as out:
        while block := src.read(1 << 20):
            written += len(block)
            if written > max_bytes:
                raise PayloadTooLarge(f"dataset is larger than the {max_bytes}-byte limit", param="file")
            out.write(block)
    return written


def extract_dataset(upload: Path, dest: Path, max_bytes: int) -> int:
    """Write the archive's `dataset.jsonlines` to `dest` (a plain JSONL upload is copied as is); return its size.

    Every member is checked first: absolute paths, `..`, links and devices make the whole upload a 400.
    """
    if not tarfile.is_tarfile(upload):
        with open(upload, "rb") as src:
            return _copy_capped(src, dest, max_bytes)
    try:
        with tarfile.open(upload, mode="r:*") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
            found = [m for m in members if posixpath.normpath(m.name) in DATASET_MEMBERS and m.isfile()]
            if not found:
                raise InvalidRequest("the archive holds no dataset.jsonlines", param="file")
            src = tar.extractfile(found[0])
            if src is None:
                raise InvalidRequest("the archive's dataset.jsonlines cannot be read", param="file")
            with src:
                return _copy_capped(src, dest, max_bytes)
    except (tarfile.TarError, EOFError, OSError) as e:
        dest.unlink(missing_ok=True)
        raise InvalidRequest(f"the training archive is corrupt: {e}", param="file") from None


def copy_upload(src: IO[bytes], dest: Path, max_bytes: int) -> int:
    """Stream an uploaded file to disk, refusing more than `max_bytes` (413)."""
    try:
        return _copy_capped(src, dest, max_bytes)
    except PayloadTooLarge:
        dest.unlink(missing_ok=True)
        raise


