"""The planned PEFT export (:mod:`moe_async.lora.peft_tensors`): a rule's split is turned into
row copies once (found by splitting row numbers), and the planned copies give exactly what the
split gives; a split that is not a choice of rows is called as it is."""

from __future__ import annotations

import types

import torch

from moe_async.lora.peft_tensors import PeftPlan, _row_steps, signature
from moe_async.models.family import qkv_split
from moe_async.models.mapping import split_rows_2


def _run(steps, B: torch.Tensor) -> dict[str, torch.Tensor]:
    state = {"w": (torch.zeros(4, 3), B)}
    return PeftPlan(signature(state), tuple(steps), [], []).run(state)


def test_row_splits_become_row_copies_equal_to_the_split():
    a = types.SimpleNamespace(num_key_value_heads=2, head_dim=3, heads_per_group=2)  # q 12 rows, k 6, v 6
    B = torch.randn(2 * (2 + 2) * 3, 4)
    steps = _row_steps(["q", "k", "v"], "w", B, lambda t: qkv_split(t, a))
    assert [s.kind for s in steps] == ["rows"] * 3 and steps[0].index is not None  # q: rows of both groups
    out = _run(steps, B)
    for n, ref in zip("qkv", qkv_split(B, a)):
        assert torch.equal(out[n], ref)
    halves = _row_steps(["gate", "up"], "w", B, lambda t: split_rows_2(t, None))
    assert [(s.kind, s.start, s.index) for s in halves] == [("rows", 0, None), ("rows", 12, None)]  # one block each
    out = _run(halves, B)
    assert torch.equal(out["gate"], B[:12]) and torch.equal(out["up"], B[12:])


def test_split_that_is_not_a_choice_of_rows_is_called():
    B = torch.randn(6, 4)
    steps = _row_steps(["flipped", "scaled"], "w", B, lambda t: [t.flip(1), 2 * t])
    assert [s.kind for s in steps] == ["split", "split"]
    out = _run(steps, B)
    assert torch.equal(out["flipped"], B.flip(1)) and torch.equal(out["scaled"], 2 * B)
