"""Compat mend 17's CPU grouped GEMM (``moe_async.compat.grouped_gemm.gmm``) has grouped_gemm's
``ops.gmm`` contract: per-expert products of the rows split by ``batch_sizes``, ``trans_b``,
experts without rows, forward and gradients bit-equal to the sequential expert MLP's linear
(Megatron-Core's ``linear_with_grad_accumulation_and_async_allreduce`` on each expert's row-major
``[N, K]`` weight: the same GEMMs, so bf16 rounds alike on any CPU), and refusals of inputs that
do not match. The GroupedMLP built on it: tests/trainer/test_grouped_mlp_cpu.py."""

from __future__ import annotations

import pytest
import torch

from megatron.core.tensor_parallel.layers import linear_with_grad_accumulation_and_async_allreduce

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
    # the sequential MLP's weights: expert e's [N, K] row-major, its own leaf
    ref_a = a.detach().clone().requires_grad_()
    ref_w = [(b[e].detach() if trans_b else b[e].detach().t()).contiguous().requires_grad_() for e in range(len(sizes))]
    rows, ref = 0, []
    for e, s in enumerate(sizes):
        ref.append(linear_with_grad_accumulation_and_async_allreduce(
            ref_a[rows:rows + s], ref_w[e], None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
            sequence_parallel=False))
        rows += s
    ref_out = torch.cat(ref)
    assert torch.equal(out, ref_out)
    gy = torch.randn_like(out)
    out.backward(gy)
    ref_out.backward(gy)
    assert torch.equal(a.grad, ref_a.grad)
    for e in range(len(sizes)):
        assert torch.equal(b.grad[e], ref_w[e].grad if trans_b else ref_w[e].grad.t())
    for e, s in enumerate(sizes):
        if s == 0:  # an expert without rows: a zero gradient, not None
            assert bool((b.grad[e] == 0).all())


def test_bf16():
    a, b, bs = _inputs([2, 3], dtype=torch.bfloat16)
    out = gmm(a, b, bs)
    assert out.dtype == torch.bfloat16
    w = [b[e].detach().t().contiguous() for e in (0, 1)]  # the sequential MLP's weight layout
    assert torch.equal(out[:2], a[:2] @ w[0].t()) and torch.equal(out[2:], a[2:] @ w[1].t())


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
