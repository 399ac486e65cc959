"""The embedded engine's double-buffered parameters (ParamArena), no server: layout covers
every HF tensor as one contiguous span, standby writes never show in the live model before
the swap, a partial update keeps the other tensors, the swap copies nothing."""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from _tiny import make_tiny_mixtral
    from transformers import AutoModelForCausalLM

    d = str(tmp_path_factory.mktemp("arena_mixtral"))
    make_tiny_mixtral(d, tie=False)
    return AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()


def _fresh(model):
    from moe_async.engines.embedded.weights import HFWeightMap, ParamArena

    wm = HFWeightMap(model)
    return wm, ParamArena(wm)


def test_layout_is_a_tiling_of_the_arena(model):
    wm, arena = _fresh(model)
    names = arena.names()
    assert sorted(names) == sorted(wm.names())
    lay = arena.layout()
    assert lay["names"] == names and lay["dtypes"] == ["float32"] * len(names)
    assert lay["shapes"] == [list(wm.shape(n)) for n in names]
    # all fp32: no padding, every name starts where the previous one ends (fused experts too)
    off = 0
    for n in names:
        o, nb = arena.slot[n]
        assert o == off
        off += nb
    assert off == arena.nbytes == sum(p.numel() * 4 for p in model.parameters())
    e = "model.layers.0.block_sparse_moe.experts.1"
    i1, i3 = names.index(f"{e}.w1.weight"), names.index(f"{e}.w3.weight")
    assert i3 == i1 + 1  # gate rows then up rows of one expert: adjacent in gate_up_proj


def test_standby_swap_partial_update_and_spans(model):
    from moe_async.models.checksum import tensor_checksum

    wm, arena = _fresh(model)
    before = {n: wm.view(n).clone() for n in wm.names()}
    arena.bind()
    assert all(torch.equal(wm.view(n), before[n]) for n in wm.names())  # bind changes no value
    names = arena.names()
    g = torch.Generator().manual_seed(5)
    sent = names[3:9]
    new = {n: torch.randn(wm.shape(n), generator=g) for n in sent}
    # consecutive names: one standby span, laid out as the flattened bucket
    span = arena.span(sent, [list(wm.shape(n)) for n in sent], [torch.float32] * len(sent))
    assert span is not None and span.numel() == sum(t.numel() * 4 for t in new.values())
    span.copy_(torch.cat([new[n].reshape(-1) for n in sent]).view(torch.uint8))
    arena.mark(sent)
    # not consecutive, or another dtype: no span (the engine receives elsewhere and copies)
    assert arena.span([names[0], names[2]], [list(wm.shape(names[0])), list(wm.shape(names[2]))],
                      [torch.float32] * 2) is None
    assert arena.span(sent[:1], [list(wm.shape(sent[0]))], [torch.bfloat16]) is None
    # the live model is untouched until the swap
    assert all(torch.equal(wm.view(n), before[n]) for n in wm.names())
    assert arena.fill_stale() == len(names) - len(sent)
    ptrs = {k: p.data_ptr() for k, p in model.named_parameters()}
    arena.swap()
    assert all(p.data_ptr() != ptrs[k] for k, p in model.named_parameters())  # pointers moved
    for n in names:
        assert torch.equal(wm.view(n), new[n] if n in new else before[n]), n
    # the next update starts from the old live buffer: a full-model fill keeps the new values
    arena.mark([])
    arena.fill_stale()
    arena.swap()
    sums = wm.checksums()
    assert sums == {n: tensor_checksum(new[n] if n in new else before[n]) for n in names}
    # a discarded update leaves nothing behind
    arena.standby(names[0]).fill_(123.0)
    arena.mark([names[0]])
    arena.discard()
    arena.fill_stale()
    arena.swap()
    assert torch.equal(wm.view(names[0]), before[names[0]])


def test_versioned_call_by_call_copies_what_changed_not_the_model(model):
    """An atomic update applied call by call (every call versioned, as slime's sender does)
    fills the standby from the live buffer only where they differ (the previous call's
    tensors), never the whole model; the served values are right after every call."""
    wm, arena = _fresh(model)
    arena.bind()
    names = arena.names()
    want = {n: wm.view(n).clone() for n in names}
    assert arena.fill_stale() == len(names)  # the first fill after bind: the standby is empty
    arena.swap()
    g = torch.Generator().manual_seed(11)
    calls = [names[i:i + 4] for i in range(0, len(names), 4)]
    prev: list[str] = []
    for call in calls:
        for n in call:
            want[n] = torch.randn(wm.shape(n), generator=g)
            arena.standby(n).copy_(want[n])
        arena.mark(call)
        assert arena.fill_stale() == len(set(prev) - set(call))  # the previous call's tensors only
        arena.swap()
        assert all(torch.equal(wm.view(n), want[n]) for n in names)
        prev = call
    # a disk update writes the live parameters directly: their standby bytes are refilled
    wm.view(names[0]).fill_(7.0)
    arena.live_written([names[0]])
    arena.mark([])
    assert arena.fill_stale() == len(set(prev) | {names[0]})
    arena.swap()
    assert torch.equal(wm.view(names[0]), torch.full_like(want[names[0]], 7.0))
