"""Hub ids resolve offline from the Hugging Face cache layout (refs -> snapshots -> blobs); nothing downloads."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from scalarlm.checkpoint.hub_cache import cached_snapshot, has_chat_template, is_hub_id, resolve_model, with_local_model
from scalarlm.config import Settings, default_hf_cache
from scalarlm.protocol.errors import InvalidRequest

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def cache_repo(cache: Path, repo_id: str, files: dict[str, str], commit: str = COMMIT, ref: str | None = "main") -> Path:
    """Lay `files` out as huggingface_hub does: content-addressed blobs, snapshot symlinks, refs/<ref>."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, text in files.items():
        blob = repo / "blobs" / hashlib.sha256(text.encode()).hexdigest()
        blob.write_text(text)
        (snapshot / name).symlink_to(Path("../..") / "blobs" / blob.name)
    if ref:
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def test_a_cached_id_resolves_to_its_snapshot(tmp_path: Path) -> None:
    snapshot = cache_repo(tmp_path, "org/tiny-model", {"config.json": json.dumps({"model_type": "llama"})})
    assert resolve_model("org/tiny-model", tmp_path) == snapshot
    assert resolve_model(f"org/tiny-model@{COMMIT}", tmp_path) == snapshot
    assert json.loads((snapshot / "config.json").read_text())["model_type"] == "llama"
    cache_repo(tmp_path, "solo", {"config.json": "{}"}, commit="f" * 40, ref="v1")
    assert cached_snapshot("solo@v1", tmp_path) == tmp_path / "models--solo" / "snapshots" / ("f" * 40)
    assert cached_snapshot("solo", tmp_path) is None  # no refs/main


def test_an_uncached_id_is_a_400_naming_it(tmp_path: Path) -> None:
    cache_repo(tmp_path, "org/no-config", {"README.md": "x"})  # an incomplete snapshot does not count
    for name in ("org/not-cached", "org/no-config", "../../no-such-place", "/no/such/dir"):
        with pytest.raises(InvalidRequest) as err:
            resolve_model(name, tmp_path, param="llm_name")
        assert err.value.status_code == 400 and repr(name) in err.value.message and err.value.param == "llm_name"
        assert "does not download" in err.value.message
    assert not is_hub_id("../x") and is_hub_id("Qwen/Qwen3-0.6B") and is_hub_id("gpt2")


def test_a_local_directory_needs_a_config(tmp_path: Path) -> None:
    (tmp_path / "m").mkdir()
    with pytest.raises(InvalidRequest, match="has no config.json"):
        resolve_model(str(tmp_path / "m"), tmp_path)
    (tmp_path / "m" / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path / "m"), tmp_path) == (tmp_path / "m").resolve()


def test_settings_serve_a_hub_id_from_its_snapshot_under_its_name(tmp_path: Path) -> None:
    snapshot = cache_repo(tmp_path / "hub", "org/tiny", {"config.json": "{}"})
    settings = with_local_model(Settings(home=tmp_path, model="org/tiny", hf_cache=tmp_path / "hub"))
    assert settings.model == str(snapshot) and settings.base_model_name == "org/tiny"
    local = Settings(home=tmp_path, model=str(snapshot))
    assert with_local_model(local) is local


def test_default_cache_follows_the_hf_variables(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    assert default_hf_cache() == tmp_path / "hf" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert Settings(home=tmp_path).hf_cache == tmp_path / "c"


def test_chat_template_found_in_any_of_its_files(tmp_path: Path) -> None:
    assert not has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": ""}))
    assert not has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert has_chat_template(tmp_path)
    (tmp_path / "tokenizer_config.json").unlink()
    (tmp_path / "chat_template.jinja").write_text("{{ messages }}")
    assert has_chat_template(tmp_path)
