"""Settings: defaults < YAML file < env < explicit overrides, loaded once."""

from pathlib import Path

import pytest
from pydantic import ValidationError

from scalarlm.config import load_settings


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("SCALARLM_"):
            monkeypatch.delenv(name)


def test_defaults_are_cpu_safe(tmp_path):
    s = load_settings()
    assert s.server.host == "127.0.0.1" and s.server.port == 8000
    # unset: float32 and 512 on CPU, the checkpoint's dtype and vLLM's auto-fitted context elsewhere
    assert s.engine.max_model_len is None and s.engine.dtype is None  # (test_engine_settings_flags)
    assert s.home.is_absolute()
    assert s.queue_path == s.home / "queue.sqlite"


def test_yaml_then_env_then_overrides(tmp_path, monkeypatch):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: /m/yaml-model\nserver:\n  port: 7000\n  host: 0.0.0.0\nengine:\n  max_num_seqs: 3\n")
    s = load_settings(cfg)
    assert (s.model, s.server.port, s.server.host, s.engine.max_num_seqs) == ("/m/yaml-model", 7000, "0.0.0.0", 3)
    assert s.base_model_name == "yaml-model"

    monkeypatch.setenv("SCALARLM_CONFIG", str(cfg))
    monkeypatch.setenv("SCALARLM_PORT", "7100")
    monkeypatch.setenv("SCALARLM_ENGINE__MAX_NUM_SEQS", "5")
    monkeypatch.setenv("SCALARLM_API_KEYS", "k1, k2")
    s = load_settings()
    assert (s.server.port, s.engine.max_num_seqs, s.server.api_keys) == (7100, 5, ["k1", "k2"])
    assert s.server.host == "0.0.0.0"  # still from the file

    s = load_settings(server={"port": 7200})
    assert s.server.port == 7200


def test_bad_values_name_the_field(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine:\n  max_model_len: -1\n")
    with pytest.raises(ValidationError, match="max_model_len"):
        load_settings(cfg)
    cfg.write_text("no_such_key: 1\n")
    with pytest.raises(ValidationError, match="no_such_key"):
        load_settings(cfg)


def test_config_file_must_be_a_mapping(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="mapping"):
        load_settings(Path(cfg))


def test_a_cpu_trainer_overlapping_generation_takes_half_the_cores(tmp_path):
    from scalarlm.config import Settings, trainer_cpu_threads

    embedded = Settings(home=tmp_path, server={"role": "embedded"})
    session = {"ranks": 1, "cores": 16, "cpu_job": True, "overlaps": True, "beside_engine": True}
    assert trainer_cpu_threads(embedded, **session) == 8
    assert trainer_cpu_threads(embedded, **{**session, "ranks": 2}) == 4
    assert trainer_cpu_threads(embedded, **{**session, "cores": 2}) == 1
    assert trainer_cpu_threads(embedded, **{**session, "cores": 1}) == 1
    # No overlap (a plain job, a synchronous session), a GPU job, a GPU node or a node without an engine: the
    # trainer keeps its share of the host (None).
    assert trainer_cpu_threads(embedded, **{**session, "overlaps": False}) is None
    assert trainer_cpu_threads(embedded, **{**session, "cpu_job": False}) is None
    gpu_node = Settings(home=tmp_path, server={"role": "embedded"}, training={"gpus_per_node": 8})
    assert trainer_cpu_threads(gpu_node, **session) is None
    assert trainer_cpu_threads(embedded, **{**session, "beside_engine": False}) is None
    # An explicit `training.cpu_threads` applies to every CPU job.
    pinned = Settings(home=tmp_path, server={"role": "api"}, training={"cpu_threads": 3})
    assert trainer_cpu_threads(pinned, **{**session, "overlaps": False, "beside_engine": False}) == 3
    assert trainer_cpu_threads(pinned, **{**session, "cpu_job": False}) is None
