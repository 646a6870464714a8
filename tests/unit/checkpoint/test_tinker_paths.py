"""tinker:// paths and the files a Tinker training run keeps (checkpoint/tinker.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scalarlm.checkpoint import JobDir
from scalarlm.checkpoint.tinker import MANIFEST, TinkerPath, TinkerRunDir, parse_tinker_path


def test_parse_round_trips_the_sdk_grammar() -> None:
    path = parse_tinker_path("tinker://session-1:train:0/weights/after-2")
    assert path == TinkerPath("session-1:train:0", "weights", "after-2")
    assert path.checkpoint_id == "weights/after-2" and str(path) == "tinker://session-1:train:0/weights/after-2"
    assert parse_tinker_path("tinker://run/sampler_weights/s1").kind == "sampler_weights"


@pytest.mark.parametrize("bad", ["s3://bucket/x", "tinker://run/weights", "tinker://run/other/x",
                                 "tinker://run/weights/a/b", "tinker:///weights/x", "tinker://run/weights/..",
                                 "tinker://run/weights/.hidden", 7])  # fmt: skip
def test_parse_refuses_what_is_not_a_tinker_path(bad: object) -> None:
    with pytest.raises(ValueError):
        parse_tinker_path(bad)  # type: ignore[arg-type]


def test_run_dir_lists_states_and_samplers_oldest_first(tmp_path: Path) -> None:
    files = TinkerRunDir(JobDir(tmp_path / "session-1"))
    files.write_run({"created": 1.0, "alias": None})
    for name, t in (("late", 30.0), ("early", 10.0)):
        files.weights_dir(name).mkdir(parents=True)
        (files.weights_dir(name) / MANIFEST).write_text(json.dumps({"time": t, "size_bytes": 5}))
    (files.weights_tmp_dir("half")).mkdir()  # a save in progress is not listed
    files.write_sampler("s", 3)
    listed = files.checkpoints()
    assert [(c["kind"], c["name"]) for c in listed[:2]] == [("weights", "early"), ("weights", "late")]
    assert listed[2]["kind"] == "sampler_weights" and listed[2]["version"] == 3
    assert files.read_run()["created"] == 1.0 and files.read_sampler("missing") is None
    with pytest.raises(ValueError):
        files.weights_dir("../escape")
