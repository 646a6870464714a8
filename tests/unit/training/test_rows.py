"""Dataset row validation: accepted shapes, and bad rows rejected with the line number (torch-free)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training import validate_dataset
from scalarlm.training.rows import read_rows


def _write(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "dataset.jsonl"
    path.write_text("".join(line + "\n" for line in lines))
    return path


def test_accepts_the_three_row_shapes_and_skips_blank_lines(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        [
            json.dumps({"input": "q", "output": "a"}),
            "",
            json.dumps({"prompt": "q", "completion": "a", "note": 1.0}),  # other keys are ignored
            json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}),
        ],
    )
    assert validate_dataset(path) == 3
    rows = read_rows(path)
    assert [r.line for r in rows] == [1, 3, 4]
    assert rows[0].prompt == "q" and rows[0].completion == "a"
    assert rows[2].messages[1] == {"role": "assistant", "content": "yo"}


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ("{not json", ["not valid JSON"]),
        (json.dumps([1, 2]), ["JSON object"]),
        (json.dumps({"input": "q"}), ["missing field 'output'"]),
        (json.dumps({"input": "q", "output": 3}), ["'output'", "string", "int"]),
        (json.dumps({"text": "q"}), ["missing fields"]),
        (json.dumps({"messages": []}), ["non-empty list"]),
        (json.dumps({"messages": [{"role": "user", "content": "hi"}]}), ["assistant turn"]),
        (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}), ["messages[0].role"]),
        (json.dumps({"messages": [{"role": "assistant", "content": None}]}), ["messages[0].content"]),
    ],
)
def test_bad_row_is_rejected_naming_its_line(tmp_path: Path, bad: str, words: list[str]) -> None:
    good = json.dumps({"input": "q", "output": "a"})
    path = _write(tmp_path, [good, good, bad, good])
    with pytest.raises(InvalidRequest) as err:
        validate_dataset(path)
    assert err.value.status_code == 400
    assert err.value.message.startswith("dataset line 3:")
    for word in words:
        assert word in err.value.message


def test_empty_dataset_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(InvalidRequest, match="empty"):
        validate_dataset(_write(tmp_path, ["", "  "]))


def test_validation_does_not_import_torch() -> None:
    code = "import sys, scalarlm.training, scalarlm.training.rows; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
