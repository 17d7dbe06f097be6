"""Draft vocabulary selection and the d2t / t2d tables."""

import pytest
import torch

from eaglewire.errors import EaglewireError, UsageError
from eaglewire.vocab import select_draft_vocab, sort_d2t, t2d_from_d2t, target_to_draft_ids, validate_vocab


def targets(d2t):
    return (torch.arange(d2t.numel()) + d2t).tolist()


def test_most_frequent_tokens_sorted_by_id_as_offsets():
    counts = torch.tensor([5, 9, 9, 0, 7, 9, 1, 0])
    d2t, t2d = select_draft_vocab(counts, 4)
    assert targets(d2t) == [1, 2, 4, 5] and d2t.tolist() == [1, 1, 2, 2]
    assert t2d.tolist() == [False, True, True, False, True, True, False, False]
    validate_vocab(d2t, t2d, 8)


def test_selection_matches_speculators_vocab_mapping_rule():
    """speculators src/speculators/train/vocab_mapping.py: sort by (-count, id), take the first
    `size`, pad with unseen low ids, then sort by id."""
    g = torch.Generator().manual_seed(0)
    counts = torch.randint(0, 6, (300,), generator=g) * (torch.rand(300, generator=g) < 0.5)
    rule = sorted(sorted(range(300), key=lambda t: (-int(counts[t]), t))[:64])
    d2t, _ = select_draft_vocab(counts, 64)
    assert targets(d2t) == rule


def test_unseen_tokens_pad_with_the_lowest_ids_and_always_ids_are_kept():
    d2t, _ = select_draft_vocab({"7": 10, 3: 4}, 4, vocab_size=10)  # JSON keys arrive as strings
    assert targets(d2t) == [0, 1, 3, 7]
    d2t, t2d = select_draft_vocab(torch.tensor([9, 8, 7, 6, 5, 0]), 3, always=[5])
    assert targets(d2t) == [0, 1, 5] and int(t2d.sum()) == 3


def test_full_size_is_the_identity():
    d2t, t2d = select_draft_vocab(torch.arange(6), 6)
    assert d2t.tolist() == [0] * 6 and t2d.all()
    d2t, t2d = select_draft_vocab(torch.arange(6), 100)
    assert d2t.numel() == 6 and t2d.all()


@pytest.mark.parametrize("kw,match", [
    (dict(token_counts={1: 2}, size=2), "need vocab_size"),
    (dict(token_counts=torch.tensor([1, -1, 2]), size=2), ">= 0"),
    (dict(token_counts=torch.tensor([1.0, 2.0]), size=1), "1-D integer"),
    (dict(token_counts=torch.arange(5), size=0), "positive integer"),
    (dict(token_counts=torch.arange(5), size=2, always=[9]), r"\[9\] outside 0..4"),
    (dict(token_counts=torch.arange(5), size=2, always=[0, 1, 2]), "do not fit"),
    (dict(token_counts=torch.arange(5), size=2, vocab_size=6), "cover 5 tokens"),
])
def test_selection_rejects_bad_input(kw, match):
    with pytest.raises(UsageError, match=match):
        select_draft_vocab(**kw)


def _vocab(V=100, n=60):
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(3))
    return select_draft_vocab(counts, n)


def test_absolute_ids_are_recognised_with_and_without_t2d():
    d2t, t2d = _vocab()
    absolute = torch.arange(60) + d2t
    for t in (t2d, None):
        with pytest.raises(EaglewireError, match="absolute target ids, not offsets"):
            validate_vocab(absolute, t, 100)


def test_absolute_ids_that_stay_in_range_are_caught_by_t2d():
    d2t, t2d = select_draft_vocab(torch.arange(1000).flip(0), 10)  # ids 0..9: absolute ids stay in range
    with pytest.raises(EaglewireError, match="absolute"):
        validate_vocab(torch.arange(10) + d2t + 1, t2d_from_d2t(d2t + 1, 1000), 1000)


@pytest.mark.parametrize("d2t,t2d,match", [
    ([0, 0, 8], None, r"maps draft ids \[2\] to target ids \[10\] outside 0..9"),
    ([0, -1, 5], None, r"same target ids \[0\]"),
    ([2, 4, 5], [1, 5, 7], r"t2d is False for target ids \[2\]"),
    ([2, 4, 5], [2, 5, 7, 8], "t2d marks 4 target tokens but d2t has 3"),
])
def test_bad_tables_are_named(d2t, t2d, match):
    mask = None
    if t2d is not None:
        mask = torch.zeros(10, dtype=torch.bool)
        mask[t2d] = True
    with pytest.raises(EaglewireError, match=match):
        validate_vocab(torch.tensor(d2t), mask, 10, where="ckpt/model.safetensors: d2t/t2d")


def test_wrong_types_and_shapes():
    with pytest.raises(EaglewireError, match="1-D integer"):
        validate_vocab(torch.zeros(3), None, 10)
    with pytest.raises(EaglewireError, match=r"shape \(10,\)"):
        validate_vocab(torch.zeros(3, dtype=torch.long), torch.ones(9, dtype=torch.bool), 10)
    with pytest.raises(EaglewireError, match="11 entries"):
        validate_vocab(torch.zeros(11, dtype=torch.long), None, 10)


def test_modelopt_frequency_ordered_d2t_is_valid_and_can_be_sorted():
    """NVIDIA Model-Optimizer calibrate_draft_vocab.py saves only d2t.pt, in frequency order."""
    ids = torch.tensor([7, 2, 5])  # most frequent first
    d2t = ids - torch.arange(3)
    t2d = t2d_from_d2t(d2t, 10)
    assert t2d.nonzero().flatten().tolist() == [2, 5, 7]
    validate_vocab(d2t, t2d, 10)
    new, order = sort_d2t(d2t)
    assert targets(new) == [2, 5, 7]
    lm_head = torch.tensor([[70.0], [20.0], [50.0]])  # row j scores target ids[j]
    assert lm_head[order].flatten().tolist() == [20.0, 50.0, 70.0]  # rows follow their tokens
    assert target_to_draft_ids(d2t, 10).tolist() == [-1, -1, 1, -1, -1, 2, -1, 0, -1, -1]
