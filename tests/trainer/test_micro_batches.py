"""Micro-batch cutting (moe_async/trainer/micro_batches.py): exact ranges, the token budget
respected, every sample in exactly one micro-batch, DP equalisation."""

from __future__ import annotations

import random

import pytest

from moe_async.trainer.micro_batches import micro_batch_ranges, padded_len, split_to_count


def test_padded_len():
    assert padded_len([9, 17, 5], min_len=64, multiple=1) == 64
    assert padded_len([9, 70], min_len=64, multiple=4) == 72
    assert padded_len([9], min_len=1, multiple=1, fixed_len=30) == 30


def test_count_only_is_fixed_size_chunks():
    assert micro_batch_ranges([5] * 7, 3) == [(0, 3), (3, 6), (6, 7)]


def test_token_budget_exact_ranges():
    # budget 100 padded positions, no floor: [40,40] -> 2x40=80 fits, +50 -> 3x50=150 no
    lens = [40, 40, 50, 10, 10, 90, 120, 5]
    assert micro_batch_ranges(lens, 8, 100) == [(0, 2), (2, 4), (4, 5), (5, 6), (6, 7), (7, 8)]
    # 120 > budget: alone, not dropped
    # with the 64-position floor every micro-batch costs >= 64 per sequence: one per micro-batch
    assert micro_batch_ranges([10, 10, 10], 8, 100, min_len=64) == [(0, 1), (1, 2), (2, 3)]
    assert micro_batch_ranges([10, 10, 10], 8, 128, min_len=64) == [(0, 2), (2, 3)]


@pytest.mark.parametrize("seed", range(20))
def test_random_batches_cover_and_respect_budget(seed):
    rng = random.Random(seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    mbs, budget, floor, mult = rng.randint(1, 8), rng.randint(50, 1200), rng.choice([1, 64]), rng.choice([1, 2, 4])
    r = micro_batch_ranges(lens, mbs, budget, min_len=floor, multiple=mult)
    assert [i for s, e in r for i in range(s, e)] == list(range(len(lens)))  # each once, in order
    for s, e in r:
        assert 1 <= e - s <= mbs
        S = padded_len(lens[s:e], min_len=floor, multiple=mult)
        assert (e - s) * S <= budget or e - s == 1
        if e < len(lens) and e - s < mbs:  # greedy: the next sample would not have fitted
            assert (e + 1 - s) * padded_len(lens[s : e + 1], min_len=floor, multiple=mult) > budget
    k = rng.randint(len(r), len(lens))
    split = split_to_count(r, k)
    assert len(split) == k and [i for s, e in split for i in range(s, e)] == list(range(len(lens)))
    assert all(any(s0 <= s and e <= e0 for s0, e0 in r) for s, e in split)  # only ever split


def test_split_to_count_refuses():
    with pytest.raises(ValueError, match="into 4"):
        split_to_count([(0, 2), (2, 3)], 4)
    with pytest.raises(ValueError, match="into 1"):
        split_to_count([(0, 2), (2, 3)], 1)
    assert split_to_count([(0, 4), (4, 5)], 3) == [(0, 2), (2, 4), (4, 5)]


def test_bad_sizes():
    with pytest.raises(ValueError, match="micro_batch_size"):
        micro_batch_ranges([1], 0)
    with pytest.raises(ValueError, match="max_tokens"):
        micro_batch_ranges([1], 1, 0)


def test_packed_budget_counts_real_tokens():
    """Packed THD rows cost T = sum of lengths rounded up (floor, multiple), not B x S."""
    lens = [40, 40, 50, 10, 10, 90, 120, 5]
    # [40,40] = 80 fits 100 (padded: 80 too); [50,10,10] = 70 (padded 3 x 50 = 150 would not)
    assert micro_batch_ranges(lens, 8, 100, packed=True) == [(0, 2), (2, 5), (5, 6), (6, 7), (7, 8)]
    # floor 64 applies to the whole row: three 10-token sequences cost 64, not 3 x 64
    assert micro_batch_ranges([10, 10, 10], 8, 64, min_len=64, packed=True) == [(0, 3)]
    assert micro_batch_ranges([33, 33], 8, 66, multiple=4, packed=True) == [(0, 1), (1, 2)]  # 68 > 66


@pytest.mark.parametrize("seed", range(10))
def test_packed_random_batches_respect_budget(seed):
    rng = random.Random(100 + seed)
    lens = [rng.randint(1, 300) for _ in range(rng.randint(1, 40))]
    mbs, budget, floor, mult = rng.randint(1, 8), rng.randint(50, 1200), rng.choice([1, 64]), rng.choice([1, 2, 4])
    r = micro_batch_ranges(lens, mbs, budget, min_len=floor, multiple=mult, packed=True)
    assert [i for s, e in r for i in range(s, e)] == list(range(len(lens)))
    for s, e in r:
        assert 1 <= e - s <= mbs
        assert padded_len([sum(lens[s:e])], min_len=floor, multiple=mult) <= budget or e - s == 1
        if e < len(lens) and e - s < mbs:
            assert padded_len([sum(lens[s : e + 1])], min_len=floor, multiple=mult) > budget
