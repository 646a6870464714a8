"""Client-side rewards: right answers score 1.0, wrong ones 0.0, in the shapes completions come in."""

from __future__ import annotations

from scalarlm.rewards import exact_match, format_reward, last_number, numeric_answer, regex_match


def test_exact_match_trims_and_ignores_case_by_default() -> None:
    assert exact_match("  Paris\n", "paris") == 1.0
    assert exact_match("Paris", "paris", ignore_case=False) == 0.0
    assert exact_match("Paris!", "Paris") == 0.0


def test_numeric_answer_compares_the_last_number_with_tolerance() -> None:
    assert numeric_answer("3+4=7", "7") == 1.0
    assert numeric_answer("The answer is 1,234.", 1234) == 1.0
    assert numeric_answer("x = 0.1 + 0.2 = 0.30000000000000004", "0.3") == 1.0
    assert numeric_answer("-5", "-5.0") == 1.0
    assert numeric_answer("7 then 8", "7") == 0.0
    assert numeric_answer("no number", "7") == 0.0
    assert numeric_answer("2.5e3", 2500) == 1.0
    assert last_number("a 1 b 22 c") == 22.0 and last_number("none") is None


def test_regex_match_searches_or_matches_whole() -> None:
    assert regex_match("answer: 42", r"\d+") == 1.0
    assert regex_match("answer: 42", r"\d+", full=True) == 0.0
    assert regex_match(" 42 ", r"\d+", full=True) == 1.0


def test_format_reward_checks_the_whole_completion() -> None:
    assert format_reward("<answer>7</answer>", r"<answer>\d+</answer>") == 1.0
    assert format_reward("so <answer>7</answer>", r"<answer>\d+</answer>") == 0.0
    assert format_reward("   ") == 0.0 and format_reward("x") == 1.0


def test_rewards_score_a_group_in_a_loop() -> None:
    completions = ["7", " 7", "8", "seven"]
    assert [numeric_answer(c, "7") for c in completions] == [1.0, 1.0, 0.0, 0.0]
