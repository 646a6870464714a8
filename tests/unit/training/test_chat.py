"""Chat rows use the model's own template; the loss covers exactly the assistant tokens (checked by hand), from
the template's `{% generation %}` mask or, without one, from the prefix-by-prefix fallback (same mask)."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.protocol.training import RLRow
from scalarlm.training.chat import encode_chat, has_generation_tags, prompt_ids
from scalarlm.training.data import encode_row
from scalarlm.training.grpo import encode_rl_rows
from scalarlm.training.rows import Row

QWEN = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{GEN}{{ m['content'] }}<|im_end|>\n{END}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3 = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{% if m['role'] == 'assistant' %}{GEN}{{ m['content'] }}<|eot_id|>{END}"
    "{% else %}{{ m['content'] }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
SPECIALS = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

CHAT = [
    {"role": "system", "content": "Be short."},
    {"role": "user", "content": "What is two plus two?"},
    {"role": "assistant", "content": "It is four."},
    {"role": "user", "content": "And the capital of France?"},
    {"role": "assistant", "content": "Paris"},
]


def _template(kind: str, generation: bool) -> str:
    text = QWEN if kind == "qwen" else LLAMA3
    tags = ("{% generation %}", "{% endgeneration %}") if generation else ("", "")
    return text.replace("{GEN}", tags[0]).replace("{END}", tags[1])


@pytest.fixture(scope="module")
def base_tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    tok.add_special_tokens({"additional_special_tokens": SPECIALS})
    return tok


def _tokenizer(base, kind: str, generation: bool):
    tok = copy.deepcopy(base)
    tok.chat_template = _template(kind, generation)
    return tok


def _hand(tok, kind: str) -> tuple[list[int], list[bool]]:
    """Ids and mask of CHAT written out by hand, piece by piece: (text, in the loss)."""
    if kind == "qwen":
        turn = lambda role, text: f"<|im_start|>{role}\n{text}<|im_end|>\n"  # noqa: E731
        pieces = [(turn("system", "Be short.") + turn("user", "What is two plus two?") + "<|im_start|>assistant\n", False),
                  ("It is four.<|im_end|>\n", True),
                  (turn("user", "And the capital of France?") + "<|im_start|>assistant\n", False),
                  ("Paris<|im_end|>\n", True)]  # fmt: skip
    else:
        head = lambda role: f"<|start_header_id|>{role}<|end_header_id|>\n\n"  # noqa: E731
        pieces = [("<s>" + head("system") + "Be short.<|eot_id|>" + head("user") + "What is two plus two?<|eot_id|>"
                   + head("assistant"), False),
                  ("It is four.<|eot_id|>", True),
                  (head("user") + "And the capital of France?<|eot_id|>" + head("assistant"), False),
                  ("Paris<|eot_id|>", True)]  # fmt: skip
    ids: list[int] = []
    mask: list[bool] = []
    for text, target in pieces:
        piece = tok(text, add_special_tokens=False)["input_ids"]
        ids += piece
        mask += [target] * len(piece)
    return ids, mask


@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_mask_covers_exactly_the_assistant_tokens(base_tokenizer, kind: str) -> None:
    with_tags = _tokenizer(base_tokenizer, kind, generation=True)
    without = _tokenizer(base_tokenizer, kind, generation=False)
    assert has_generation_tags(with_tags.chat_template) and not has_generation_tags(without.chat_template)
    hand_ids, hand_mask = _hand(with_tags, kind)
    assert encode_chat(with_tags, CHAT, "row 0") == (hand_ids, hand_mask)  # the template's own mask
    assert encode_chat(without, CHAT, "row 0") == (hand_ids, hand_mask)  # the fallback gives the same
    assert encode_chat(with_tags, CHAT, "row 0", use_template_mask=False) == (hand_ids, hand_mask)
    doc = encode_row(without, Row(line=1, messages=tuple(CHAT)))
    assert (list(doc.tokens), list(doc.targets)) == (hand_ids, hand_mask)


class _NoOffsets:
    """A tokenizer without character offsets (as Python tokenizers are): the fallback tokenizes piece by piece."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.chat_template = tok.chat_template

    def apply_chat_template(self, *args, **kwargs):
        return self.tok.apply_chat_template(*args, **kwargs)

    def __call__(self, text, return_offsets_mapping: bool = False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self.tok(text, **kwargs)


@pytest.mark.parametrize("kind", ["qwen", "llama3"])
def test_tokenizers_without_offsets_get_the_same_mask(base_tokenizer, kind: str) -> None:
    tok = _tokenizer(base_tokenizer, kind, generation=False)
    assert encode_chat(_NoOffsets(tok), CHAT, "row 0") == _hand(tok, kind)


def test_the_two_templates_give_different_tokens(base_tokenizer) -> None:
    qwen, llama = (_tokenizer(base_tokenizer, k, generation=False) for k in ("qwen", "llama3"))
    assert encode_chat(qwen, CHAT, "row 0")[0] != encode_chat(llama, CHAT, "row 0")[0]
    prompt = CHAT[:2]
    q, l3 = prompt_ids(qwen, prompt, "row 0"), prompt_ids(llama, prompt, "row 0")
    assert q != l3
    tail = qwen("<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    assert q[-len(tail) :] == tail
    assert l3[0] == llama.bos_token_id


def test_the_template_mask_is_used_where_the_template_has_one(base_tokenizer) -> None:
    """A template that puts only the content in `{% generation %}` keeps its end-of-turn token out of the loss."""
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = QWEN.replace("{GEN}{{ m['content'] }}<|im_end|>\n{END}",
                                     "{% generation %}{{ m['content'] }}{% endgeneration %}<|im_end|>\n")
    ids, mask = encode_chat(tok, CHAT, "row 0")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert not any(m for i, m in zip(ids, mask) if i == im_end)
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == "It is four.Paris"


def test_grpo_chat_prompts_use_the_template(base_tokenizer) -> None:
    tok = _tokenizer(base_tokenizer, "qwen", generation=True)
    row = RLRow(messages=CHAT[:2], completion="It is four.", reward=1.0)
    other = RLRow(messages=CHAT[:2], completion="Five.", reward=0.0)
    docs, _ = encode_rl_rows(tok, [row, other], "group", max_len=128)
    prompt = prompt_ids(tok, CHAT[:2], "row 0")
    assert list(docs[0].doc.tokens[: len(prompt)]) == prompt
    assert not any(docs[0].doc.targets[: len(prompt)]) and all(docs[0].doc.targets[len(prompt) :])


def test_a_template_that_rewrites_earlier_turns_is_refused(base_tokenizer) -> None:
    tok = copy.deepcopy(base_tokenizer)  # renders only the last assistant turn, as reasoning templates may
    tok.chat_template = ("{% for m in messages %}{% if m['role'] != 'assistant' or loop.last %}"
                         "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                         "{% if add_generation_prompt %}assistant: {% endif %}")  # fmt: skip
    with pytest.raises(InvalidRequest, match="dataset line 7: the chat template does not render turn by turn"):
        encode_row(tok, Row(line=7, messages=tuple(CHAT)))


def test_chat_rows_need_a_template(base_tokenizer) -> None:
    tok = copy.deepcopy(base_tokenizer)
    tok.chat_template = None
    with pytest.raises(InvalidRequest, match="row 2: chat rows need a tokenizer with a chat template"):
        prompt_ids(tok, CHAT[:2], "row 2")
