"""Row checks that need no tokenizer live in protocol/: SFT and GRPO rows, errors naming the line and the field."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.rows import (
    check_groups,
    check_step_row,
    check_step_rows,
    first_row_scored,
    group_count,
    read_rl_objects,
    rl_row_from_object,
    summarize_dataset,
    validate_dataset,
)


def _write(tmp_path: Path, rows: list) -> Path:
    path = tmp_path / "dataset.jsonl"
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
SCORED = {"prompt": "2+2=", "completion": "4", "reward": 1.0}
SCORED_CHAT = {"messages": [{"role": "user", "content": "2+2?"}], "completion": "4", "reward": 0.5}


def test_grpo_rows_accept_a_prompt_or_a_chat_prompt_without_an_assistant_turn(tmp_path: Path) -> None:
    path = _write(tmp_path, [SCORED, "", SCORED_CHAT])
    assert validate_dataset(path, "grpo") == 2
    assert read_rl_objects(path)[1] == SCORED_CHAT
    unscored = {k: v for k, v in SCORED_CHAT.items() if k != "reward"}
    with pytest.raises(InvalidRequest, match="dataset line 2: field 'messages' needs at least one assistant"):
        validate_dataset(_write(tmp_path, [CHAT, unscored]), "sft")  # an SFT chat row must have something to train on


@pytest.mark.parametrize(
    ("bad", "words"),
    [
        ({"prompt": "x", "completion": "y"}, ["field 'reward'", "required"]),
        ({"prompt": "x", "completion": "y", "reward": "high"}, ["field 'reward'"]),
        ({"completion": "y", "reward": 1}, ["exactly one of fields 'prompt' or 'messages'"]),
        ({**SCORED, "score": 1}, ["unknown field 'score'"]),
        ({**SCORED_CHAT, "messages": [{"role": "robot", "content": "x"}]}, ["field 'messages[0].role'", "robot"]),
        ({**SCORED_CHAT, "messages": [{"role": "user", "content": 3}]}, ["field 'messages[0].content'"]),
        ({**SCORED, "logprobs": ["a"]}, ["field 'logprobs.0'"]),
        ({**SCORED, "reward": float("nan")}, ["field 'reward'", "finite"]),  # json.dumps writes NaN, Python reads it
        ({**SCORED, "logprobs": [-0.5, float("-inf")]}, ["field 'logprobs.1'", "finite"]),
        ([1, 2], ["JSON object"]),
    ],
)
def test_bad_grpo_row_names_its_line_and_field(tmp_path: Path, bad, words: list[str]) -> None:
    with pytest.raises(InvalidRequest) as err:
        validate_dataset(_write(tmp_path, [SCORED, SCORED, bad]), "dr_grpo")
    assert err.value.status_code == 400 and err.value.message.startswith("dataset line 3: "), err.value.message
    for word in words:
        assert word in err.value.message


def test_mask_truncated_completions_needs_every_rows_finish_reason(tmp_path: Path) -> None:
    """With train arg mask_truncated_completions a row that does not say why it stopped is a 400 at submission (job
    dataset and session step alike); without it, finish_reason is optional."""
    stopped = {**SCORED, "finish_reason": "stop"}
    assert validate_dataset(_write(tmp_path, [stopped, SCORED]), "grpo") == 2
    with pytest.raises(InvalidRequest, match="^dataset line 2: field 'finish_reason' is required"):
        summarize_dataset(_write(tmp_path, [stopped, SCORED]), "grpo", finish_reasons=True)
    check_step_rows([stopped, {**SCORED, "finish_reason": "length"}], "grpo", finish_reasons=True)
    with pytest.raises(InvalidRequest, match=r"^rows\[1\]: field 'finish_reason' is required") as err:
        check_step_rows([stopped, SCORED], "grpo", finish_reasons=True)
    assert err.value.param == "rows"


def test_session_step_rows_are_named_by_index() -> None:
    """A session step's rows: scored rows (with `reward`) or SFT rows, named `rows[i]` with param `rows`."""
    with pytest.raises(InvalidRequest, match=r"^row 4: field 'reward'"):
        rl_row_from_object({"prompt": "x", "completion": "y"}, "row 4")
    check_step_row(0, SCORED_CHAT)
    check_step_row(1, CHAT)
    for index, bad, words in [
        (2, {**SCORED, "reward": None}, "rows[2]: field 'reward'"),
        (3, {"messages": [{"role": "user", "content": "hi"}]}, "rows[3]: field 'messages' needs"),
        (4, {"input": "q", "output": 1}, "rows[4]: field 'output' must be a string"),
        (5, "text", "rows[5]: must be a JSON object"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            check_step_row(index, bad)
        assert err.value.message.startswith(words) and err.value.param == "rows", err.value.message


def test_a_step_holds_the_rows_its_session_loss_trains() -> None:
    """Scored rows for an RL loss, SFT rows for 'sft': a row of the other kind is refused, never trained otherwise."""
    check_step_rows([SCORED, SCORED_CHAT], "grpo")
    check_step_rows([CHAT, {"input": "q", "output": "a"}], "sft")
    for rows, loss, words in [
        ([SCORED, CHAT], "grpo", "rows[1]: field 'reward' is required: this session trains loss 'grpo'"),
        ([{"prompt": "q", "completion": "a"}], "dr_grpo", "rows[0]: field 'reward' is required"),
        ([CHAT, SCORED], "sft", "rows[1]: field 'reward' needs an RL loss, and this session was created with loss"),
        ([SCORED, {**SCORED, "reward": "x"}], "grpo", "rows[1]: field 'reward'"),
    ]:
        with pytest.raises(InvalidRequest) as err:
            check_step_rows(rows, loss)
        assert err.value.message.startswith(words) and err.value.param == "rows", err.value.message


def test_scored_rows_whose_every_group_holds_one_completion_are_refused_without_a_kl_term(tmp_path: Path) -> None:
    """A group of one has advantage 0: a dataset or step of such groups trains nothing unless kl_coef > 0."""
    lone = [SCORED, SCORED_CHAT, {**SCORED, "group": "g"}]  # three groups: a prompt, a chat prompt, a named group
    summary = summarize_dataset(_write(tmp_path, lone), "grpo")
    assert (summary.rows, summary.groups) == (3, 3) and group_count(lone) == 3
    with pytest.raises(InvalidRequest) as err:
        check_groups(summary.rows, summary.groups, 0.0, "dataset", "dataset")
    assert err.value.message.startswith("dataset: every group holds one completion (3 rows in 3 groups)")
    assert "kl_coef > 0" in err.value.message and err.value.param == "dataset"
    check_groups(3, 3, 0.1, "rows", "rows")  # the KL term still trains
    paired = [*lone, {**SCORED, "completion": "5", "reward": 0.0}]  # the prompt's group now holds two
    assert group_count(paired) == 3
    check_groups(len(paired), group_count(paired), 0.0, "rows", "rows")
    assert summarize_dataset(_write(tmp_path, [CHAT]), "sft").groups == 0


def test_an_sft_dataset_refuses_scores_it_would_ignore(tmp_path: Path) -> None:
    """loss 'sft' would train every completion whatever its reward: the row is refused, naming the fix."""
    path = _write(tmp_path, [SCORED, SCORED])
    assert first_row_scored(path) and validate_dataset(path, "grpo") == 2
    with pytest.raises(InvalidRequest) as err:
        validate_dataset(path, "sft")
    assert err.value.message.startswith("dataset line 1: field 'reward' is for an RL loss"), err.value.message
    assert "loss 'grpo'" in err.value.message
    assert not first_row_scored(_write(tmp_path, ["", CHAT, SCORED])) and not first_row_scored(_write(tmp_path, []))
    assert not first_row_scored(_write(tmp_path, ["{not json", SCORED]))


def test_sft_chat_field_errors_name_the_field(tmp_path: Path) -> None:
    bad = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant"}]}
    with pytest.raises(InvalidRequest, match=r"^dataset line 2: field 'messages\[1\].content' must be a string"):
        validate_dataset(_write(tmp_path, [CHAT, bad]))


def test_row_checks_import_neither_torch_nor_trainer_code() -> None:
    code = ("import sys, scalarlm.protocol.rows; "
            "sys.exit(any(m == 'torch' or m.startswith('scalarlm.training') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
