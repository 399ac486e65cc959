"""Compat mend 12: the CPU stand-in for Apex's ``fused_weight_gradient_mlp_cuda`` accumulates
``main_grad += grad_output^T @ input`` (what Megatron's linear layers call with
``gradient_accumulation_fusion=True``). The trainer-level checks (the mend is still needed,
the trainer turns it on, parity with transformers and between layouts with it on) are in
_trainer_checks.py / _layout_checks.py."""

from __future__ import annotations

import torch

from moe_async.compat import _CpuFusedWeightGradient as F


def test_fp32_accumulates_in_place():
    g = torch.Generator().manual_seed(0)
    x, go = torch.randn(37, 16, generator=g), torch.randn(37, 8, generator=g)
    main = torch.randn(8, 16, generator=g)
    want = main.double() + go.double().t() @ x.double()
    buf = main.clone()
    ptr = buf.data_ptr()
    F.wgrad_gemm_accum_fp32(x, go, buf)
    F.wgrad_gemm_accum_fp32(x, go, buf)  # accumulates again
    want = want + go.double().t() @ x.double()
    assert buf.data_ptr() == ptr and buf.dtype == torch.float32
    assert ((buf.double() - want).abs().max() / want.abs().max()) < 1e-6


def test_bf16_activations_fp32_main_grad_match_unfused_numerics():
    g = torch.Generator().manual_seed(1)
    x, go = torch.randn(21, 16, generator=g).bfloat16(), torch.randn(21, 8, generator=g).bfloat16()
    main = torch.randn(8, 16, generator=g)
    buf = main.clone()
    F.wgrad_gemm_accum_fp32(x, go, buf)
    # Megatron's unfused path: bf16 weight grad, then DDP's fp32 main_grad.add_
    assert torch.equal(buf, main + go.t().matmul(x))
