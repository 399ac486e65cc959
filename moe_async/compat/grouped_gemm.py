"""Mend 17: Megatron-Core's legacy grouped expert MLP (``GroupedMLP``) on a host without CUDA.

Answers ``transformer/moe/grouped_gemm_util.py``, whose ``ops`` is None without the
``grouped_gemm`` CUDA package (``GroupedMLP.__init__`` asserts it), and
``transformer/moe/experts.py``, whose ``GroupedMLP.forward`` asserts ``config.bf16`` (the CUDA
kernel's only dtype), and builds its activation closures with ``jit_fuser`` (``torch.compile``:
on CPU an inductor C++ build per new token count, and fused numerics unlike the sequential
MLP's eager ops). :func:`gmm` has grouped_gemm's ``ops.gmm`` contract and runs each expert's
rows with the sequential expert MLP's own GEMMs and operand layouts (bit-equal to it in bf16 on
any CPU), in any float dtype; the forward then runs
for fp32 models too, the activations eager, Megatron's own code otherwise unchanged.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

import copy
import functools
import types

import torch


def gmm(a: torch.Tensor, b: torch.Tensor, batch_sizes: torch.Tensor, trans_b: bool = False) -> torch.Tensor:
    """Grouped GEMM with grouped_gemm's ``ops.gmm`` semantics: rows ``a[s_e : s_e + n_e]`` of
    ``a [sum(n), K]`` times ``b[e]`` (``b [E, K, N]``; ``[E, N, K]`` transposed with ``trans_b``)
    for expert ``e`` with ``n = batch_sizes`` (int64, CPU, ``[E]``). Returns ``[sum(n), N]`` in
    ``a``'s dtype; differentiable in ``a`` and ``b`` (an expert with no rows gets a zero grad).

    Raises:
        ValueError: ``batch_sizes`` is not a CPU integer tensor of ``E`` sizes summing to the
            rows of ``a``, or the inner dimensions differ.
    """
    if batch_sizes.device.type != "cpu" or batch_sizes.dtype.is_floating_point or batch_sizes.dim() != 1:
        raise ValueError(f"gmm: batch_sizes must be a 1-D CPU integer tensor, got {batch_sizes.dtype} "
                         f"{tuple(batch_sizes.shape)} on {batch_sizes.device}")
    sizes = [int(n) for n in batch_sizes.tolist()]
    if a.dim() != 2 or b.dim() != 3 or len(sizes) != b.shape[0] or sum(sizes) != a.shape[0]:
        raise ValueError(f"gmm: a {tuple(a.shape)}, b {tuple(b.shape)} and batch_sizes {sizes} do not match "
                         "(a [sum(batch_sizes), K], b [E, K, N] with E = len(batch_sizes))")
    k = b.shape[2] if trans_b else b.shape[1]
    if a.shape[1] != k:
        raise ValueError(f"gmm: a has {a.shape[1]} columns, b's experts take {k} (trans_b={trans_b})")
    parts = torch.split(a, sizes, dim=0)
    return torch.cat([_ExpertLinear.apply(x, b[e] if trans_b else b[e].t()) for e, x in enumerate(parts)], dim=0)


class _ExpertLinear(torch.autograd.Function):
    """``x [n, K] @ w.T`` for ``w [N, K]`` (any strides) with the sequential expert MLP's own
    GEMMs and operand layouts (Megatron-Core's ``LinearWithGradAccumulationAndAsyncCommunication``
    without TE: ``x @ W.t()``, ``dy @ W``, ``dy.t() @ x`` on a row-major ``W``), so a bf16 CPU
    BLAS picks the same kernels and rounds alike on any host; ``w``'s gradient is returned in
    ``w``'s layout."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        w = w.contiguous()
        ctx.save_for_backward(x, w)
        return torch.matmul(x, w.t())

    @staticmethod
    def backward(ctx, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, w = ctx.saved_tensors
        return dy.matmul(w), dy.t().matmul(x)


def patch_grouped_mlp() -> bool:
    """Install :func:`gmm` as ``grouped_gemm_util.ops.gmm`` where the ``grouped_gemm`` package is
    absent, and let ``GroupedMLP.forward`` run without ``config.bf16`` (it sees a copy of its
    config with ``bf16=True`` for the call; nothing else in the forward reads that field), its
    activation closures eager (``experts.jit_fuser``, used by GroupedMLP alone, set to Megatron's
    ``noop_decorator``). Idempotent; only without CUDA. Returns True when the mend is in place."""
    if torch.cuda.is_available():
        return False
    from megatron.core.jit import noop_decorator
    from megatron.core.transformer.moe import experts
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    if gg.grouped_gemm is None:
        gg.grouped_gemm = types.SimpleNamespace(ops=types.SimpleNamespace(gmm=gmm), moe_async_cpu_gmm=True)
        gg.ops = gg.grouped_gemm.ops
    experts.jit_fuser = noop_decorator
    cls = experts.GroupedMLP
    if getattr(cls, "_moe_async_cpu_mend", False):
        return True
    orig = cls.forward

    @functools.wraps(orig)
    def forward(self, *args, **kwargs):
        cfg = self.config
        if cfg.bf16:
            return orig(self, *args, **kwargs)
        view = copy.copy(cfg)  # no __post_init__: the same field values, bf16 only for the assert
        view.bf16 = True
        self.config = view
        try:
            return orig(self, *args, **kwargs)
        finally:
            self.config = cfg

    cls.forward = forward
    cls._moe_async_cpu_mend = True
    return True


def cpu_gmm_installed() -> bool:
    """True when ``grouped_gemm_util.ops.gmm`` is this module's :func:`gmm` (the mend applied)."""
    from megatron.core.transformer.moe import grouped_gemm_util as gg

    return bool(getattr(gg.grouped_gemm, "moe_async_cpu_gmm", False))
