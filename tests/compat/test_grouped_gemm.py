"""Compat mend 17's CPU grouped GEMM (``moe_async.compat.grouped_gemm.gmm``) has grouped_gemm's
``ops.gmm`` contract: per-expert products of the rows split by ``batch_sizes``, ``trans_b``,
experts without rows, gradients (exactly those of per-expert ``torch.matmul``), and refusals of
inputs that do not match. The GroupedMLP built on it: tests/trainer/test_grouped_mlp_cpu.py."""

from __future__ import annotations

import pytest
import torch

from moe_async.compat.grouped_gemm import gmm


def _inputs(sizes, k=6, n=5, trans_b=False, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(sum(sizes), k, generator=g, dtype=dtype, requires_grad=True)
    shape = (len(sizes), n, k) if trans_b else (len(sizes), k, n)
    b = torch.randn(*shape, generator=g, dtype=dtype, requires_grad=True)
    return a, b, torch.tensor(sizes, dtype=torch.int64)


@pytest.mark.parametrize("trans_b", [False, True])
@pytest.mark.parametrize("sizes", [[3, 0, 4, 1], [0, 0, 2, 0], [5]])
def test_equals_per_expert_matmul_forward_and_backward(sizes, trans_b):
    a, b, bs = _inputs(sizes, trans_b=trans_b)
    out = gmm(a, b, bs, trans_b=trans_b)
    assert out.shape == (sum(sizes), 5) and out.dtype == a.dtype
    ref_a, ref_b = a.detach().clone().requires_grad_(), b.detach().clone().requires_grad_()
    rows, ref = 0, []
    for e, s in enumerate(sizes):
        w = ref_b[e].t() if trans_b else ref_b[e]
        ref.append(ref_a[rows:rows + s] @ w)
        rows += s
    ref_out = torch.cat(ref)
    assert torch.equal(out, ref_out)
    gy = torch.randn_like(out)
    out.backward(gy)
    ref_out.backward(gy)
    assert torch.equal(a.grad, ref_a.grad) and torch.equal(b.grad, ref_b.grad)
    for e, s in enumerate(sizes):
        if s == 0:  # an expert without rows: a zero gradient, not None
            assert bool((b.grad[e] == 0).all())


def test_bf16():
    a, b, bs = _inputs([2, 3], dtype=torch.bfloat16)
    out = gmm(a, b, bs)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out[:2], a[:2] @ b[0]) and torch.equal(out[2:], a[2:] @ b[1])


@pytest.mark.parametrize("change,needle", [
    (lambda a, b, bs: (a, b, torch.tensor([3, 0, 4, 2])), r"do not match .*sum\(batch_sizes\)"),
    (lambda a, b, bs: (a, b, torch.tensor([3, 0, 5])), "do not match"),
    (lambda a, b, bs: (a, b, bs.float()), "batch_sizes must be a 1-D CPU integer tensor"),
    (lambda a, b, bs: (a[:, :4], b, bs), "a has 4 columns, b's experts take 6"),
])
def test_mismatched_inputs_are_refused(change, needle):
    a, b, bs = _inputs([3, 0, 4, 1])
    with pytest.raises(ValueError, match=needle):
        gmm(*change(a, b, bs))
