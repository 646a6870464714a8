"""Which Tinker datums run as one shared-prefix document (`tinker_ops.datum_units`) and how they lay out in a packed
micro-batch: the shared positions once, each datum's own after them, each datum's N positions found again in order."""

from __future__ import annotations

from scalarlm.training.tinker_ops import _packed_batch, datum_units, prefix_length


def _pairs(*datums: list[int]) -> list[list[tuple[int, int]]]:
    return [list(zip(d[:-1], d[1:])) for d in datums]  # input = all but the last token, target = the next token


def test_datums_of_one_prompt_share_its_positions_and_keep_their_own() -> None:
    pairs = _pairs([1, 5, 6, 7, 20, 21], [9, 9], [1, 5, 6, 7, 30], [1, 5, 6, 7, 20, 22])
    units = datum_units(pairs, budget=100)
    assert units == [[0, 2, 3], [1]]
    assert prefix_length(pairs, [0, 2, 3]) == 3  # (1,5) (5,6) (6,7); the next target differs
    batch, where = _packed_batch(pairs, units)
    tokens = batch.tokens[0].tolist()
    assert tokens == [1, 5, 6] + [7, 20] + [7] + [7, 20] + [9]
    assert batch.doc_bounds == (0, 3, 5, 6, 8, 9) and batch.doc_continues == (-1, 0, 0, 0, -1)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 3, 3, 4, 0]
    for i, datum in enumerate(pairs):  # each datum's inputs and targets, position by position
        assert [tokens[k] for k in where[i].tolist()] == [x for x, _ in datum]
        assert [batch.labels[0, k].item() for k in where[i].tolist()] == [y for _, y in datum]


def test_identical_and_one_token_datums_and_the_budget() -> None:
    same = _pairs([1, 2, 3], [1, 2, 3])
    assert datum_units(same, 100) == [[0, 1]] and prefix_length(same, [0, 1]) == 1  # each keeps one position
    single = _pairs([1, 2], [1, 2])
    assert datum_units(single, 100) == [[0], [1]]  # nothing left to share
    group = _pairs(*([1, 2, 3, 4, 5, k] for k in range(10, 16)))
    units = datum_units(group, budget=4 + 2)  # the 4 shared positions and two datums' own one each
    assert units == [[0, 1], [2, 3], [4, 5]]


def test_a_longrope_models_units_stay_on_one_side_of_its_original_context() -> None:
    """The shared prefix rotates once: with the short factors when its datums are at most the original context long,
    the long ones when they are all longer. A datum on the other side runs as its own document."""
    pairs = _pairs([1, 2, 3, 4, 5], [1, 2, 3, 4, 6], [1, 2, 3, 4, 7, 8, 9], [1, 2, 3, 4, 7, 8, 10])  # 4, 4, 6, 6 long
    assert datum_units(pairs, budget=100) == [[0, 1, 2, 3]]
    assert datum_units(pairs, budget=100, long_after=5) == [[0, 1], [2, 3]]
    batch, _ = _packed_batch(pairs, [[0, 1], [2, 3]])
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 3] + [0, 1, 2, 3, 4, 5, 5]  # each part right after its prefix
