"""Chat rows through the model's own chat template, with a loss mask on the assistant tokens only.

The rendered conversation is tokenized once, as a whole (so tokens match what the model sees at inference).
The mask comes from the template itself when it marks assistant output with ``{% generation %}`` blocks
(transformers' ``return_assistant_tokens_mask``). Otherwise it is found by rendering prefix by prefix: assistant
turn i covers the characters that ``render(messages[:i + 1])`` adds to ``render(messages[:i],
add_generation_prompt=True)`` (its content and end-of-turn marker), and every token overlapping them is a target.
A template that does not render turn by turn (a later turn rewrites an earlier one) is refused for chat rows.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from scalarlm.protocol.errors import InvalidRequest

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _template(tokenizer: Any, where: str) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise InvalidRequest(f"{where}: chat rows need a tokenizer with a chat template", param="dataset")
    if not isinstance(template, str):
        raise InvalidRequest(f"{where}: named chat templates are not supported for chat rows", param="dataset")
    return template


def has_generation_tags(template: str) -> bool:
    """True if the template marks assistant output with `{% generation %}` (transformers' assistant mask)."""
    return bool(_GENERATION_TAG.search(template))


def _render(tokenizer: Any, messages: Sequence[dict[str, Any]], generation_prompt: bool) -> str:
    return tokenizer.apply_chat_template(list(messages), tokenize=False, add_generation_prompt=generation_prompt)


def assistant_spans(tokenizer: Any, messages: Sequence[dict[str, Any]], where: str) -> tuple[str, list[tuple[int, int]]]:
    """The rendered chat and the character span each assistant turn adds to its prompt (prefix by prefix)."""
    full = _render(tokenizer, messages, False)
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        prefix = _render(tokenizer, messages[:i], True) if i else ""
        turn = _render(tokenizer, messages[: i + 1], False)
        if not (full.startswith(turn) and turn.startswith(prefix)):
            raise InvalidRequest(
                f"{where}: the chat template does not render turn by turn; cannot mask assistant turn {i}",
                param="dataset",
            )
        spans.append((len(prefix), len(turn)))
    return full, spans


def _mask_from_spans(offsets: Sequence[tuple[int, int]], spans: Sequence[tuple[int, int]]) -> list[bool]:
    """Per token: does its (non-empty) character range overlap an assistant span."""
    return [e > s and any(s < end and e > start for start, end in spans) for s, e in offsets]


def _by_pieces(tokenizer: Any, full: str, spans: Sequence[tuple[int, int]]) -> tuple[list[int], list[bool]]:
    """Tokenize the text between span bounds piece by piece (tokenizers without character offsets)."""
    bounds = sorted({0, len(full), *(b for span in spans for b in span)})
    ids: list[int] = []
    mask: list[bool] = []
    for start, end in zip(bounds, bounds[1:]):
        piece = tokenizer(full[start:end], add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [any(a <= start < b for a, b in spans)] * len(piece)
    return ids, mask


def _fallback(tokenizer: Any, messages: Sequence[dict[str, Any]], where: str) -> tuple[list[int], list[bool]]:
    full, spans = assistant_spans(tokenizer, messages, where)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    except NotImplementedError:  # a Python tokenizer: no offsets
        return _by_pieces(tokenizer, full, spans)
    return list(enc["input_ids"]), _mask_from_spans(enc["offset_mapping"], spans)


def encode_chat(
    tokenizer: Any, messages: Sequence[dict[str, Any]], where: str, use_template_mask: bool = True
) -> tuple[list[int], list[bool]]:
    """Token ids of the rendered chat and, per token, whether it is assistant output (in the loss).

    `where` names the row in errors. `use_template_mask=False` forces the prefix-by-prefix fallback (tests).
    """
    template = _template(tokenizer, where)
    if use_template_mask and has_generation_tags(template):
        out = tokenizer.apply_chat_template(
            list(messages), tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        return list(out["input_ids"]), [bool(m) for m in out["assistant_masks"]]
    return _fallback(tokenizer, messages, where)


def prompt_ids(tokenizer: Any, messages: Sequence[dict[str, Any]], where: str) -> list[int]:
    """Token ids of a chat prompt rendered with the template's generation prompt (a GRPO row's prompt)."""
    _template(tokenizer, where)
    return list(tokenizer(_render(tokenizer, messages, True), add_special_tokens=False)["input_ids"])
