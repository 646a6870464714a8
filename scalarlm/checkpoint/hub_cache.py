"""Models named by a hub id resolve offline, from the local Hugging Face cache; nothing here downloads.

The cache layout (`huggingface_hub`'s): ``<cache>/models--<org>--<name>/refs/<revision>`` holds a commit hash and
``snapshots/<hash>/`` the files (symlinks into ``blobs/``). `model` (server setting) and `llm_name` (train arg)
may be a local directory or such an id, optionally ``id@revision``; an id that is not in the cache is an
InvalidRequest naming it (HTTP 400 at submission), never a download attempt.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from scalarlm.config import Settings
from scalarlm.protocol.errors import InvalidRequest

# Hub repo ids: `name` or `org/name` (letters, digits, '-', '_', '.'), optionally `@revision`.
HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}(?:@[\w./-]{1,128})?$")
_HASH = re.compile(r"^[0-9a-f]{40}$")


def is_hub_id(name: str) -> bool:
    """True if `name` has the shape of a hub repo id (which does not mean it is cached)."""
    return bool(HUB_ID.match(name)) and ".." not in name


def cached_snapshot(repo_id: str, cache_dir: Path) -> Path | None:
    """The snapshot directory of `repo_id` (`id` or `id@revision`) in the cache, or None if it is not there."""
    repo_id, _, revision = repo_id.partition("@")
    repo = Path(cache_dir) / ("models--" + repo_id.replace("/", "--"))
    revision = revision or "main"
    commit = revision if _HASH.match(revision) else None
    ref = repo / "refs" / revision
    if commit is None and ref.is_file():
        commit = ref.read_text().strip()
    if commit is None:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


def resolve_model(name: str, cache_dir: Path, param: str = "model") -> Path:
    """A local model directory for `name`: the directory itself, or the cached snapshot of a hub id."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"model directory {name!r} has no config.json", param=param)
        return path.resolve()
    snapshot = cached_snapshot(name, cache_dir) if is_hub_id(name) else None
    if snapshot is None:
        raise InvalidRequest(
            f"unknown model {name!r}: not a local model directory, and not a hub id in the local Hugging Face "
            f"cache {cache_dir} (this server does not download models)",
            param=param,
        )
    return snapshot


def has_chat_template(model_dir: Path) -> bool:
    """True if the model directory ships a chat template (chat rows are rendered with it)."""
    model_dir = Path(model_dir)
    if (model_dir / "chat_template.jinja").is_file() or (model_dir / "chat_template.json").is_file():
        return True
    config = model_dir / "tokenizer_config.json"
    try:
        return bool(json.loads(config.read_text()).get("chat_template")) if config.is_file() else False
    except (OSError, ValueError, AttributeError):
        return False


def with_local_model(settings: Settings) -> Settings:
    """Settings whose `model` is a local directory: a hub id becomes its cached snapshot, still served (and
    trained) under the id's name. Called once at the entry point."""
    if Path(settings.model).expanduser().is_dir():
        return settings
    local = resolve_model(settings.model, settings.hf_cache)
    return settings.model_copy(update={"model": str(local), "served_model_name": settings.served_model_name
                                       or settings.model.partition("@")[0]})  # fmt: skip
