"""Tokenization with completion masks, chat templates, truncation, packing with per-document masks, the seeded
resumable block stream and DP sharding, on the tiny model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scalarlm.protocol.errors import InvalidRequest
from scalarlm.training.data import (
    chunks,
    filler_micro,
    BlockStream,
    Document,
    collate,
    collate_packed,
    encode_row,
    encode_rows,
    pack,
    spread_batch,
    step_batch,
)
from scalarlm.training.rows import Row


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _target_text(tokenizer, doc: Document) -> str:
    return tokenizer.decode([t for t, m in zip(doc.tokens, doc.targets) if m])


def test_prompt_completion_row_trains_on_completion_and_eos_only(tokenizer) -> None:
    doc = encode_row(tokenizer, Row(line=1, prompt="What is the capital of France? ", completion="Paris"))
    assert doc.tokens[-1] == tokenizer.eos_token_id and doc.targets[-1]
    assert _target_text(tokenizer, doc) == "Paris</s>"
    assert not any(doc.targets[: doc.targets.index(True)])
    assert tokenizer.decode(doc.tokens, skip_special_tokens=True) == "What is the capital of France? Paris"


def test_chat_row_trains_on_assistant_turns_only(tokenizer) -> None:
    messages = (
        {"role": "system", "content": "Be short."},
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there"},
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "four"},
    )
    doc = encode_row(tokenizer, Row(line=1, messages=messages))
    rendered = tokenizer.apply_chat_template([dict(m) for m in messages], tokenize=False)
    assert tokenizer.decode(doc.tokens) == rendered
    target = _target_text(tokenizer, doc)
    assert "Hi there" in target and "four" in target
    for not_trained in ("Be short.", "Hello", "two plus two", "<|user|>", "<|assistant|>"):
        assert not_trained not in target


def test_long_rows_are_truncated_and_counted_never_a_crash(tokenizer) -> None:
    rows = [
        Row(line=1, prompt="Q ", completion="one two three " * 30),  # truncated, keeps some completion
        Row(line=2, prompt="seven " * 80, completion="lost"),  # prompt alone fills max_len: dropped
        Row(line=3, prompt="Q ", completion="A"),
    ]
    docs, stats = encode_rows(tokenizer, rows, max_len=32)
    assert (stats.rows, stats.documents, stats.truncated_rows, stats.dropped_rows) == (3, 2, 2, 1)
    assert all(len(d.tokens) <= 32 for d in docs)
    with pytest.raises(InvalidRequest, match="no trainable rows"):
        encode_rows(tokenizer, rows[1:2], max_len=32)


def test_packed_documents_do_not_attend_across_and_positions_restart() -> None:
    a = Document(tokens=(10, 11, 12), targets=(False, True, True))
    b = Document(tokens=(20, 21, 22, 23), targets=(False, False, True, True))
    (block,) = pack([a, b], [0, 1], max_len=16, packing=True)
    batch = collate([block], pad_id=0, multiple=8)
    assert batch.tokens[0].tolist() == [10, 11, 12, 20, 21, 22, 23, 0]
    assert batch.position_ids[0, :7].tolist() == [0, 1, 2, 0, 1, 2, 3]
    visible = ~batch.attention_mask[0, 0]  # True = may attend
    assert visible[3:7, 0:3].sum() == 0 and visible[0:3, 3:7].sum() == 0  # no attention across documents
    assert torch.equal(visible[3:7, 3:7], torch.ones(4, 4, dtype=torch.bool).tril())
    # Predicting a token of the next document is never in the loss; padding never is.
    assert batch.loss_mask[0].tolist() == [1, 1, 0, 0, 1, 1, 0, 0]
    assert batch.labels[0, :2].tolist() == [11, 12] and batch.labels[0, 4:6].tolist() == [22, 23]
    assert len(pack([a, b], [0, 1], max_len=16, packing=False)) == 2
    assert len(pack([a, b], [0, 1], max_len=6, packing=True)) == 2


def test_padding_free_rows_hold_the_same_tokens_labels_and_loss_mask_as_padded_ones() -> None:
    a = Document(tokens=(10, 11, 12), targets=(False, True, True))
    b = Document(tokens=(20, 21, 22, 23), targets=(False, False, True, True))
    c = Document(tokens=(30, 31), targets=(False, True))
    blocks = pack([a, b], [0, 1], max_len=16, packing=True) + pack([c], [0], max_len=16, packing=True)
    padded, packed = collate(blocks, pad_id=0, multiple=8), collate_packed(blocks, pad_id=0)
    assert packed.tokens.shape == (1, 9) and packed.attention_mask is None
    assert packed.doc_bounds == (0, 3, 7, 9)  # attention stays inside each document
    assert packed.position_ids[0].tolist() == [0, 1, 2, 0, 1, 2, 3, 0, 1]
    real = padded.tokens != 0
    assert torch.equal(packed.tokens[0], padded.tokens[real])
    assert torch.equal(packed.loss_mask[0], padded.loss_mask[real])
    in_loss = packed.loss_mask[0] > 0
    assert torch.equal(packed.labels[0][in_loss], padded.labels[real][padded.loss_mask[real] > 0])


def _docs(n: int) -> list[Document]:
    return [Document(tuple(range(100 * i, 100 * i + 3 + i % 4)), (False,) + (True,) * (2 + i % 4)) for i in range(n)]


def test_block_stream_is_seeded_reshuffles_each_epoch_and_resumes_exactly() -> None:
    docs = _docs(20)
    first = BlockStream(docs, max_len=12, seed=7)
    blocks = first.take(40)  # crosses several epochs
    assert blocks == BlockStream(docs, max_len=12, seed=7).take(40)
    assert blocks != BlockStream(docs, max_len=12, seed=8).take(40)
    epoch0 = BlockStream(docs, max_len=12, seed=7)._epoch_blocks()
    epoch1 = BlockStream(docs, max_len=12, seed=7, epoch=1)._epoch_blocks()
    assert epoch0 != epoch1

    stream = BlockStream(docs, max_len=12, seed=7)
    stream.take(13)
    resumed = BlockStream(docs, max_len=12, seed=7)
    resumed.load_state_dict(stream.state_dict())
    assert resumed.take(27) == blocks[13:]


def test_dp_ranks_split_the_global_batch_and_share_its_token_count() -> None:
    blocks = BlockStream(_docs(20), max_len=12, seed=0).take(8)
    one = step_batch(blocks, batch_size=2, accum=4, dp_size=1, dp_rank=0, pad_id=0)
    ranks = [step_batch(blocks, batch_size=2, accum=2, dp_size=2, dp_rank=r, pad_id=0) for r in range(2)]
    assert one.global_loss_tokens == ranks[0].global_loss_tokens == ranks[1].global_loss_tokens
    assert one.global_loss_tokens == sum(int(m.loss_mask.sum()) for m in one.micro_batches)
    seen = sorted(tuple(row.tolist()) for r in ranks for m in r.micro_batches for row in m.tokens)
    assert seen == sorted(tuple(row.tolist()) for m in one.micro_batches for row in m.tokens)


def test_a_session_batch_spreads_its_blocks_over_ranks_padding_free() -> None:
    blocks = pack(_docs(9), range(9), max_len=12, packing=True)
    one = spread_batch(blocks, batch_size=2, dp_size=1, dp_rank=0, pad_id=0)
    ranks = [spread_batch(blocks, batch_size=2, dp_size=2, dp_rank=r, pad_id=0) for r in range(2)]
    assert all(m.attention_mask is None and m.tokens.shape[0] == 1 for r in (one, *ranks) for m in r.micro_batches)
    in_loss = sum(int(m.loss_mask.sum()) for m in one.micro_batches)
    assert one.global_loss_tokens == ranks[0].global_loss_tokens == in_loss
    seen = sorted(t for r in ranks for m in r.micro_batches for t in m.tokens[0].tolist())
    assert seen == sorted(t for b in blocks for t in b.tokens)
    assert spread_batch(blocks[:1], 2, dp_size=2, dp_rank=1, pad_id=0).micro_batches == []  # nothing for rank 1


def test_chunks_are_full_then_the_rest_and_empty_up_to_the_count_asked() -> None:
    assert chunks(7, 3) == [range(0, 3), range(3, 6), range(6, 7)]
    assert chunks(7, 4, count=3) == [range(0, 4), range(4, 7), range(7, 7)]
    assert chunks(0, 4, count=2) == [range(0, 0), range(0, 0)]
    with pytest.raises(ValueError, match="do not fit in 2 chunks of at most 3"):
        chunks(7, 3, count=2)


def test_under_expert_parallelism_every_rank_gets_as_many_micro_batches_fillers_first() -> None:
    """A session batch of 5 blocks over 2 ranks, 2 blocks per micro-batch: rank 0 has 3 blocks (2 micro-batches),
    rank 1 two (1 micro-batch, as without EP), so rank 1 runs a filler first, one pad token that trains nothing."""
    blocks = pack(_docs(20), range(20), max_len=12, packing=True)[:5]
    ranks = [spread_batch(blocks, 2, dp_size=2, dp_rank=r, pad_id=0, even=True) for r in range(2)]
    plain = [spread_batch(blocks, 2, dp_size=2, dp_rank=r, pad_id=0) for r in range(2)]
    assert [len(r.micro_batches) for r in ranks] == [2, 2] and [len(r.micro_batches) for r in plain] == [2, 1]
    assert [m.filler for r in ranks for m in r.micro_batches] == [False, False, True, False]
    assert torch.equal(ranks[1].micro_batches[1].tokens, plain[1].micro_batches[0].tokens)  # the same partition
    filler = ranks[1].micro_batches[0]
    assert filler.tokens.tolist() == [[0]] and filler.loss_mask.sum() == 0 and filler.doc_bounds == (0, 1)
    assert vars(filler).keys() == vars(filler_micro(0)).keys()
    (alone,) = spread_batch(blocks[:1], 2, dp_size=2, dp_rank=1, pad_id=0, even=True).micro_batches
    assert alone.filler  # a rank with no block at all


def test_a_micro_batch_padded_for_sequence_parallelism_keeps_every_real_token_as_it_was() -> None:
    """Padding to a multiple of TP adds positions at the end that nothing sees and nothing learns from: packed, a
    document of their own; masked, rows that see only themselves; the padding mask marks exactly them."""
    blocks = pack(_docs(6), range(6), max_len=12, packing=True)[:2]
    packed = collate_packed(blocks, pad_id=0)
    length = packed.tokens.shape[1]
    grown, padding = packed.padded(3)
    assert grown.tokens.shape == (1, length + 3) and padding.tolist() == [[False] * length + [True] * 3]
    assert torch.equal(grown.tokens[:, :length], packed.tokens) and torch.equal(grown.labels[:, :length], packed.labels)
    assert grown.loss_mask[:, length:].sum() == 0 and torch.equal(grown.loss_mask[:, :length], packed.loss_mask)
    assert grown.doc_bounds == (*packed.doc_bounds, length + 3) and grown.position_ids[0, length:].tolist() == [0, 1, 2]
    same, none = packed.padded(0)
    assert same is packed and not none.any()

    masked = collate(blocks, pad_id=0)
    rows, width = masked.tokens.shape
    grown, padding = masked.padded(2)
    assert grown.attention_mask.shape == (rows, 1, width + 2, width + 2) and padding.shape == (rows, width + 2)
    assert torch.equal(grown.attention_mask[:, :, :width, :width], masked.attention_mask)
    assert grown.attention_mask[:, :, :width, width:].all() and grown.attention_mask[:, :, width:, :width].all()
    assert (~grown.attention_mask[:, 0, width:, width:]).sum().item() == rows * 2  # each sees only itself
