"""Dataset rows: the accepted JSONL shapes and the checks that need no tokenizer (the control plane runs them
in-process at submission; the trainer runs the same ones before it builds anything).

An SFT row is one JSON object per line in one of three shapes:

* ScalarLM: ``{"input": str, "output": str}`` -- loss on ``output``;
* prompt/completion: ``{"prompt": str, "completion": str}`` -- loss on ``completion``;
* chat: ``{"messages": [{"role": str, "content": str}, ...]}`` with at least one ``assistant`` turn --
  rendered with the model's chat template, loss on the assistant turns.

Other keys are allowed and ignored, except ``reward``: an SFT loss would train on every completion whatever its
reward, so a scored row is refused there (a job whose rows carry rewards and that names no `loss` trains GRPO).
Blank lines are skipped. A GRPO row (`loss` "grpo" / "dr_grpo" / "dapo") is an `RLRow`: exactly one of ``prompt`` or
``messages`` (a chat prompt, rendered with the template's generation prompt), a ``completion`` and a ``reward``.
Every error names the line and the field: ``dataset line 3: field 'messages[0].role' ...``.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import RLRow

CHAT_ROLES = frozenset({"system", "user", "assistant", "tool"})


@dataclass(frozen=True)
class Row:
    """One validated SFT row: a prompt and a completion, or a chat conversation."""

    line: int
    prompt: str | None = None
    completion: str | None = None
    messages: tuple[dict[str, str], ...] | None = None


def _bad(where: str, why: str, param: str = "dataset") -> InvalidRequest:
    return InvalidRequest(f"{where}: {why}", param=param)


def _text_field(obj: dict[str, Any], key: str, where: str, param: str) -> str:
    value = obj[key]
    if not isinstance(value, str):
        raise _bad(where, f"field {key!r} must be a string, got {type(value).__name__}", param)
    return value


def check_messages(
    msgs: Any, where: str, need_assistant: bool = True, param: str = "dataset"
) -> tuple[dict[str, str], ...]:
    """Validate a chat (`role` in CHAT_ROLES, string `content`); SFT chats need an assistant turn to train on."""
    if not isinstance(msgs, list) or not msgs:
        raise _bad(where, "field 'messages' must be a non-empty list", param)
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise _bad(where, f"field 'messages[{i}]' must be an object with 'role' and 'content'", param)
        role, content = m.get("role"), m.get("content")
        if not isinstance(role, str) or role not in CHAT_ROLES:
            raise _bad(where, f"field 'messages[{i}].role' must be one of {sorted(CHAT_ROLES)}, got {role!r}", param)
        if not isinstance(content, str):
            raise _bad(where, f"field 'messages[{i}].content' must be a string, got {type(content).__name__}", param)
        out.append({"role": role, "content": content})
    if need_assistant and not any(m["role"] == "assistant" for m in out):
        raise _bad(where, "field 'messages' needs at least one assistant turn to train on", param)
    return tuple(out)


def _json_object(text: str, line: int) -> dict[str, Any]:
    where = f"dataset line {line}"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as e:
        raise _bad(where, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(where, f"must be a JSON object, got {type(obj).__name__}")
    return obj


def row_from_object(obj: dict[str, Any], line: int, where: str | None = None, param: str = "dataset") -> Row:
    """Validate one decoded SFT row and return it as a Row; errors name `where` (default: its 1-based line)."""
    where = where or f"dataset line {line}"
    if "reward" in obj:
        raise _bad(where, "field 'reward' is for an RL loss, and this job's loss is 'sft', which would train on "
                   "every completion whatever its reward: send train arg loss 'grpo', 'dr_grpo' or 'dapo' (a job "
                   "naming no loss trains GRPO on rows with a 'reward'), or drop 'reward' to fine-tune on them", param)
    if "messages" in obj:
        return Row(line=line, messages=check_messages(obj["messages"], where, param=param))
    for prompt_key, completion_key in (("input", "output"), ("prompt", "completion")):
        if prompt_key in obj or completion_key in obj:
            for key in (prompt_key, completion_key):
                if key not in obj:
                    raise _bad(where, f"missing field {key!r} (rows with {prompt_key!r} need {completion_key!r})",
                               param)  # fmt: skip
            return Row(line=line, prompt=_text_field(obj, prompt_key, where, param),
                       completion=_text_field(obj, completion_key, where, param))  # fmt: skip
    raise _bad(where, "missing fields: expected 'input'+'output', 'prompt'+'completion' or 'messages'", param)


def parse_row(text: str, line: int) -> Row:
    """Validate one SFT JSONL line (1-based `line` for messages) and return it as a Row."""
    return row_from_object(_json_object(text, line), line)


def rl_row_from_object(obj: Any, where: str, param: str = "dataset") -> RLRow:
    """Validate one scored GRPO row; the error names `where` (e.g. "dataset line 3") and the field."""
    if not isinstance(obj, dict):
        raise _bad(where, f"must be a JSON object, got {type(obj).__name__}", param)
    try:
        row = RLRow.model_validate(obj)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "row"
        kind = "unknown field" if err["type"] == "extra_forbidden" else "field"
        raise _bad(where, f"{kind} {field!r}: {err['msg']}", param) from None
    if (row.prompt is None) == (row.messages is None):
        raise _bad(where, "give exactly one of fields 'prompt' or 'messages'", param)
    if row.messages is not None:
        check_messages(row.messages, where, need_assistant=False, param=param)
    return row


def check_step_row(index: int, obj: Any) -> None:
    """One row of an RL session step: scored (`reward` present) or SFT; errors name `rows[index]` and the field."""
    where = f"rows[{index}]"
    if isinstance(obj, dict) and "reward" in obj:
        rl_row_from_object(obj, where, param="rows")
    elif isinstance(obj, dict):
        row_from_object(obj, index + 1, where, param="rows")
    else:
        raise _bad(where, f"must be a JSON object, got {type(obj).__name__}", "rows")


def check_finish_reason(obj: dict[str, Any], where: str, param: str) -> None:
    """A scored row needs `finish_reason` when train arg `mask_truncated_completions` reads it."""
    if obj.get("finish_reason") is None:
        raise _bad(where, "field 'finish_reason' is required: train arg mask_truncated_completions leaves out the "
                   "completions that stopped at max_tokens (finish_reason 'length'); send each generate output's "
                   "finish_reason", param)  # fmt: skip


def check_step_rows(rows: list[Any], loss: str, finish_reasons: bool = False) -> None:
    """Every row of an RL session step (`check_step_row`), of the kind the session's `loss` trains: scored rows for
    an RL loss, SFT rows for 'sft'. A row of the other kind is refused, never trained another way (an SFT step on
    scored rows would train every completion whatever its reward; a scored step cannot train a row with no score).
    With `finish_reasons` (train arg mask_truncated_completions) every row must say why it stopped."""
    rl = loss != "sft"
    for i, row in enumerate(rows):
        check_step_row(i, row)
        if finish_reasons:
            check_finish_reason(row, f"rows[{i}]", "rows")
        if rl and "reward" not in row:
            raise _bad(f"rows[{i}]", f"field 'reward' is required: this session trains loss {loss!r} on scored "
                       "completions; SFT rows need a session created with train arg loss 'sft'", "rows")  # fmt: skip
        if not rl and "reward" in row:
            raise _bad(f"rows[{i}]", "field 'reward' needs an RL loss, and this session was created with loss 'sft', "
                       "which would train on every completion whatever its reward: create the session with train "
                       "arg loss 'grpo' (the default), 'dr_grpo' or 'dapo'", "rows")  # fmt: skip


def group_count(objs: Iterable[dict[str, Any]]) -> int:
    """How many GRPO groups validated scored rows form (`RLRow.group_key`: their `group`, else their prompt)."""
    return len({RLRow.model_validate(obj).group_key() for obj in objs})


def check_groups(rows: int, groups: int, kl_coef: float, where: str, param: str) -> None:
    """Refuse scored rows whose every group holds one completion when no KL term trains either: a GRPO advantage is
    a reward minus its group's mean, 0 for a group of one, so the step would train nothing (TRL refuses
    num_generations < 2)."""
    if kl_coef == 0 and groups == rows:
        raise _bad(where, f"every group holds one completion ({rows} rows in {groups} groups): GRPO trains a "
                   "completion by its reward against the mean of its group, so none would train. Send two or more "
                   "completions of each prompt (rows group by field 'group', else by their prompt or messages), or "
                   "set train arg kl_coef > 0", param)  # fmt: skip


def first_row_scored(path: str | Path) -> bool:
    """Whether a JSONL dataset's first row carries a `reward` (False when it cannot be read as an object: the row
    checks say why)."""
    for line, text in _lines(path):
        try:
            obj = json.loads(text)
        except json.JSONDecodeError:
            return False
        return isinstance(obj, dict) and "reward" in obj
    return False


def _lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line; a line that is not UTF-8 is a bad row."""
    with open(path, encoding="utf-8", errors="strict") as f:
        line = 0
        try:
            for line, text in enumerate(f, start=1):
                if text.strip():
                    yield line, text
        except UnicodeDecodeError:
            raise _bad(f"dataset line {line + 1}", "not valid UTF-8") from None


def iter_rows(path: str | Path) -> Iterator[Row]:
    """Yield the validated SFT rows of a JSONL file; raise InvalidRequest naming the first bad line."""
    for line, text in _lines(path):
        yield parse_row(text, line)


def read_rows(path: str | Path) -> list[Row]:
    """Every validated SFT row of a JSONL file; raise InvalidRequest if one is bad or there are none."""
    rows = list(iter_rows(path))
    if not rows:
        raise InvalidRequest("dataset is empty: no rows to train on", param="dataset")
    return rows


def _rl_objects(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    raw = []
    for line, text in _lines(path):
        obj = _json_object(text, line)
        rl_row_from_object(obj, f"dataset line {line}")
        raw.append((line, obj))
    if not raw:
        raise InvalidRequest("dataset is empty: no rows to train on", param="dataset")
    return raw


def read_rl_objects(path: str | Path) -> list[dict[str, Any]]:
    """The scored rows of a GRPO dataset as decoded objects, each validated as an RLRow."""
    return [obj for _, obj in _rl_objects(path)]


@dataclass(frozen=True)
class DatasetSummary:
    """What the control plane learns from checking a dataset: its row count, the first chat row's line, and how
    many groups its scored rows form (0 for SFT rows)."""

    rows: int
    first_chat_line: int | None = None
    groups: int = 0


def summarize_dataset(path: str | Path, loss: str = "sft", finish_reasons: bool = False) -> DatasetSummary:
    """Check every row of a JSONL dataset for a job with this `loss` (scored rows with `finish_reason` when
    `finish_reasons`); InvalidRequest naming the first bad one."""
    if loss != "sft":
        lines = [(line, obj) for line, obj in _rl_objects(path)]
        for line, obj in lines if finish_reasons else []:
            check_finish_reason(obj, f"dataset line {line}", "dataset")
        chat = next((line for line, obj in lines if "messages" in obj), None)
        return DatasetSummary(len(lines), chat, group_count(obj for _, obj in lines))
    count, chat = 0, None
    for row in iter_rows(path):
        count += 1
        if chat is None and row.messages is not None:
            chat = row.line
    if not count:
        raise InvalidRequest("dataset is empty: no rows to train on", param="dataset")
    return DatasetSummary(count, chat)


def validate_dataset(path: str | Path, loss: str = "sft") -> int:
    """Check every row of a JSONL dataset for a job with this `loss` before training; return the row count.

    Raises InvalidRequest (HTTP 400) whose message names the first bad line and its field.
    """
    return summarize_dataset(path, loss).rows
