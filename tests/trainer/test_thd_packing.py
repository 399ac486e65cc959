"""Packed THD micro-batches (trainer.sequence_packing='thd'): the packed row's layout, exact
(no Megatron process group needed). The model-level proofs (THD == padded per family, layouts,
micro-batch invariance, R3) are in test_layouts.py and test_megatron_trainer.py."""

from __future__ import annotations

import pytest
import torch

from moe_async.replay.routes import PAD, pack_rows


def test_pack_rows_order_and_tail():
    x = torch.tensor([[1, 2, 3, 0], [4, 5, 0, 0], [6, 7, 8, 9]])
    assert pack_rows(x, [3, 2, 4], 11, -1).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8, 9, -1, -1]]
    r = torch.arange(2 * 3 * 2).view(2, 3, 1, 2)  # [B, S, L, K]
    p = pack_rows(r, [2, 3], 6, PAD)
    assert p.shape == (1, 6, 1, 2)
    assert torch.equal(p[0, :2], r[0, :2]) and torch.equal(p[0, 2:5], r[1]) and bool((p[0, 5] == PAD).all())
    with pytest.raises(ValueError, match="packed length 4"):
        pack_rows(x, [3, 2, 4], 4, 0)
    with pytest.raises(ValueError, match="do not fit"):
        pack_rows(x, [5, 2, 4], 20, 0)


def test_thd_entries_layout():
    """Sequences of 3 and 4 tokens packed into T = 8: tokens back to back, positions restart,
    the tail continues the last sequence's positions and is marked padding; cu_seqlens int32
    (real) and padded (last one ending at T); each response-predicting row's packed offset."""
    from moe_async.trainer.batching import packed_row

    tokens = torch.tensor([[11, 12, 13, 0], [21, 22, 23, 24]])
    # response-predicting rows (sequence, position): seq 0 predicts at 1, seq 1 at 1, 2
    logit_b, logit_s = torch.tensor([0, 1, 1]), torch.tensor([1, 1, 2])
    e = packed_row(tokens, logit_b, logit_s, [3, 4], 8)
    assert e.tokens.tolist() == [[11, 12, 13, 21, 22, 23, 24, 0]]
    assert e.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4]]
    assert e.padding_mask.tolist() == [[False] * 7 + [True]]
    assert e.cu_seqlens.dtype == torch.int32 and e.cu_seqlens.tolist() == [0, 3, 7]
    assert e.cu_seqlens_padded.tolist() == [0, 3, 8]
    assert e.max_seqlen == 5
    assert e.logit_s.tolist() == [1, 4, 5]
    # the packed offset holds the row's token: the label (next token) is the same as unpacked
    assert e.tokens[0, e.logit_s + 1].tolist() == tokens[logit_b, logit_s + 1].tolist()
