"""Dataset rows: the accepted JSONL shapes and their validation. Torch-free, so the control plane imports it.

A row is one JSON object per line in one of three shapes:

* ScalarLM: ``{"input": str, "output": str}`` -- loss on ``output``;
* prompt/completion: ``{"prompt": str, "completion": str}`` -- loss on ``completion``;
* chat: ``{"messages": [{"role": str, "content": str}, ...]}`` with at least one ``assistant`` turn --
  rendered with the tokenizer's chat template, loss on the assistant turns.

Other keys are allowed and ignored (they carry e.g. rewards for later loss kinds). Blank lines are skipped.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from scalarlm.protocol.errors import InvalidRequest

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Row:
    """One validated row: a prompt and a completion, or a chat conversation."""

    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _bad(line: int, why: str) -> InvalidRequest:
    return InvalidRequest(f"dataset line {line}: {why}", param="dataset")


def _text_field(obj: dict[str, Any], key: str, line: int) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise _bad(line, f"field {key!r} must be a string, got {type(value).__name__}")
    return value


def _messages(obj: dict[str, Any], line: int) -> tuple[dict[str, str], ...]:
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        raise _bad(line, "field 'messages' must be a non-empty list")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(line, f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(line, f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        if not isinstance(content, str):
            raise _bad(line, f"messages[{i}].content must be a string, got {type(content).__name__}")
        out.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in out):
        raise _bad(line, "'messages' needs at least one assistant turn to train on")
    return tuple(out)


def parse_row(text: str, line: int) -> Row:
    """Validate one JSONL line (1-based `line` for messages) and return it as a Row."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(line, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(line, f"must be a JSON object, got {type(obj).__name__}")
    if "messages" in obj:
        return Row(line=line, messages=_messages(obj, line))
    for prompt_key, completion_key in (("input", "output"), ("prompt", "completion")):
        if prompt_key in obj or completion_key in obj:
            for key in (prompt_key, completion_key):
                if key not in obj:
                    raise _bad(line, f"missing field {key!r} (rows with {prompt_key!r} need {completion_key!r})")
            return Row(
                line=line,
                prompt=_text_field(obj, prompt_key, line),
                completion=_text_field(obj, completion_key, line),
            )
    raise _bad(line, "missing fields: expected 'input'+'output', 'prompt'+'completion' or 'messages'")


def iter_rows(path: str | Path) -> Iterator[Row]:
    """Yield the validated rows of a JSONL file; raise InvalidRequest naming the first bad line."""
    with open(path, encoding="utf-8", errors="strict") as f:
        line = 0
        try:
            for line, text in enumerate(f, start=1):
                if text.strip():
                    yield parse_row(text, line)
        except UnicodeDecodeError:
            raise _bad(line + 1, "not valid UTF-8") from None


def read_rows(path: str | Path) -> list[Row]:
    """Every validated row of a JSONL file; raise InvalidRequest if one is bad or there are none."""
    rows = list(iter_rows(path))
    if not rows:
        raise InvalidRequest("dataset is empty: no rows to train on", param="dataset")
    return rows


def validate_dataset(path: str | Path) -> int:
    """Check every row of a JSONL dataset before training; return the row count.

    Raises InvalidRequest (HTTP 400) whose message names the first bad line number.
    """
    count = 0
    for _ in iter_rows(path):
        count += 1
    if not count:
        raise InvalidRequest("dataset is empty: no rows to train on", param="dataset")
    return count
