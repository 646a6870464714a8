"""Reject prompts that cannot fit the model before they are queued (400 naming the prompt).

Counts tokens with the `tokenizers` library from the model directory's `tokenizer.json` (no torch).
A model given as a hub id, or one without `tokenizer.json`, is not checked here: the worker then
reports an over-long prompt as that item's error.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer

from scalarlm.protocol.errors import InvalidRequest

logger = logging.getLogger(__name__)


class PromptChecker:
    """Checks `max_tokens` and prompt lengths against the engine's `max_model_len`."""

    def __init__(self, max_model_len: int, tokenizer: Tokenizer | None = None) -> None:
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        # Tokens a prompt can have beyond one per UTF-8 byte: the special tokens the tokenizer adds,
        # plus slack for a prefix-space token.
        self._slack = (len(tokenizer.encode("").ids) + 2) if tokenizer is not None else 0

    @classmethod
    def from_model_dir(cls, model: str | Path, max_model_len: int) -> "PromptChecker":
        """Load the model's tokenizer.json if it is a local directory that has one."""
        path = Path(model) / "tokenizer.json"
        if not path.is_file():
            logger.warning("no %s: prompt lengths are checked by the worker only", path)
            return cls(max_model_len)
        return cls(max_model_len, Tokenizer.from_file(str(path)))

    def check_max_tokens(self, max_tokens: int | None, param: str = "max_tokens") -> None:
        """`max_tokens` must be positive and at most max_model_len."""
        if max_tokens is None:
            return
        if max_tokens <= 0:
            raise InvalidRequest(f"{param} must be at least 1, got {max_tokens}", param=param)
        if max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"{param}={max_tokens} is larger than the model's max_model_len ({self.max_model_len})", param=param
            )

    def check_prompts(self, prompts: Sequence[tuple[int, str]]) -> None:
        """Raise for the first (index, text) prompt that leaves no room for output in max_model_len."""
        if self.tokenizer is None or not prompts:
            return
        # Every token covers at least one byte, so only prompts with nearly max_model_len bytes can
        # overflow: tokenizing is skipped for the rest (it dominates the cost of a 200k-prompt batch).
        suspects = [(i, text) for i, text in prompts if not self._surely_fits(text)]
        if not suspects:
            return
        encodings = self.tokenizer.encode_batch([text for _, text in suspects])
        for (index, _), encoding in zip(suspects, encodings):
            count = len(encoding.ids)
            if count >= self.max_model_len:
                raise InvalidRequest(
                    f"prompts[{index}] is {count} tokens long; the model's max_model_len is {self.max_model_len}",
                    param=f"prompts[{index}]",
                )

    def _surely_fits(self, text: str) -> bool:
        limit = self.max_model_len - self._slack
        return 4 * len(text) < limit or len(text.encode("utf-8")) < limit
