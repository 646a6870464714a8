"""Reject prompts that cannot fit the model before they are queued (400 naming the prompt).

Counts tokens with the `tokenizers` library from the model directory's `tokenizer.json` (no torch).
A model given as a hub id, or one without `tokenizer.json`, is not checked here: the worker then
reports an over-long prompt as that item's error. The limit is the engine's own context length as its load reports
it (`engine_limit`: vLLM's choice where `engine.max_model_len` is unset), else the setting; with neither (split
mode before any worker reported, the setting unset) nothing is checked here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from pathlib import Path

from tokenizers import Tokenizer

from scalarlm.protocol.errors import InvalidRequest

logger = logging.getLogger(__name__)


class PromptChecker:
    """Checks `max_tokens` and prompt lengths against the engine's `max_model_len`."""

    def __init__(self, max_model_len: int | None, tokenizer: Tokenizer | None = None) -> None:
        self.configured = max_model_len
        self.engine_limit: Callable[[], int | None] = lambda: None  # the serving engine's, once one reports it
        self.tokenizer = tokenizer
        # Tokens a prompt can have beyond one per UTF-8 byte: the special tokens the tokenizer adds,
        # plus slack for a prefix-space token.
        self._slack = (len(tokenizer.encode("").ids) + 2) if tokenizer is not None else 0

    @property
    def max_model_len(self) -> int | None:
        """The context length prompts are checked against (None: not checked here)."""
        limit = self.engine_limit()
        return limit if limit is not None else self.configured

    @classmethod
    def from_model_dir(cls, model: str | Path, max_model_len: int | None) -> "PromptChecker":
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
        limit = self.max_model_len
        if limit is not None and max_tokens > limit:
            raise InvalidRequest(f"{param}={max_tokens} is larger than the model's max_model_len ({limit})",
                                 param=param)  # fmt: skip

    def check_prompts(self, prompts: Sequence[tuple[int, str]]) -> None:
        """Raise for the first (index, text) prompt that leaves no room for output in max_model_len."""
        limit = self.max_model_len
        if self.tokenizer is None or not prompts or limit is None:
            return
        # Every token covers at least one byte, so only prompts with nearly max_model_len bytes can
        # overflow: tokenizing is skipped for the rest (it dominates the cost of a 200k-prompt batch).
        suspects = [(i, text) for i, text in prompts if not self._surely_fits(text, limit)]
        if not suspects:
            return
        encodings = self.tokenizer.encode_batch([text for _, text in suspects])
        for (index, _), encoding in zip(suspects, encodings):
            count = len(encoding.ids)
            if count >= limit:
                raise InvalidRequest(
                    f"prompts[{index}] is {count} tokens long; the model's max_model_len is {limit}",
                    param=f"prompts[{index}]",
                )

    def _surely_fits(self, text: str, max_model_len: int) -> bool:
        limit = max_model_len - self._slack
        return 4 * len(text) < limit or len(text.encode("utf-8")) < limit
