"""Client-side rewards for RL loops: `f(completion, reference) -> float`, 1.0 for right and 0.0 for wrong.

User reward code always runs on the client, never on the server; these cover the common cases:

    reward = numeric_answer(completion, "42")        # the last number in the completion equals 42
    reward = exact_match(completion, "Paris")        # equal after trimming (and case-folding)
    reward = regex_match(completion, r"^\\d+$")       # the completion matches a pattern
    reward = format_reward(completion, r"<answer>.*</answer>")  # the completion follows a format
"""

from __future__ import annotations

import math
import re

__all__ = ["exact_match", "format_reward", "last_number", "numeric_answer", "regex_match"]

_NUMBER = re.compile(r"[-+]?(?:\d[\d,]*\.?\d*|\.\d+)(?:[eE][-+]?\d+)?")


def exact_match(completion: str, reference: str, *, ignore_case: bool = True, strip: bool = True) -> float:
    """1.0 when the completion equals the reference (after trimming whitespace and, by default, case)."""
    a, b = (completion.strip(), reference.strip()) if strip else (completion, reference)
    if ignore_case:
        a, b = a.casefold(), b.casefold()
    return 1.0 if a == b else 0.0


def last_number(text: str) -> float | None:
    """The last number written in `text` (thousands separators allowed), or None when there is none."""
    for match in reversed(_NUMBER.findall(text)):
        try:
            return float(match.replace(",", ""))
        except ValueError:
            continue
    return None


def numeric_answer(completion: str, reference: str | float, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> float:
    """1.0 when the last number in the completion equals the reference number within tolerance."""
    got = last_number(completion)
    want = float(reference) if isinstance(reference, (int, float)) else last_number(reference)
    if got is None or want is None:
        return 0.0
    return 1.0 if math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol) else 0.0


def regex_match(completion: str, pattern: str, *, full: bool = False, flags: int = 0) -> float:
    """1.0 when `pattern` is found in the completion (or matches all of it with `full=True`)."""
    compiled = re.compile(pattern, flags)
    hit = compiled.fullmatch(completion.strip()) if full else compiled.search(completion)
    return 1.0 if hit else 0.0


def format_reward(completion: str, pattern: str = r"^\s*\S.*$", *, flags: int = re.DOTALL) -> float:
    """1.0 when the whole completion follows the format `pattern` (default: not empty), ignoring outer space."""
    return 1.0 if re.fullmatch(pattern, completion.strip(), flags) else 0.0
