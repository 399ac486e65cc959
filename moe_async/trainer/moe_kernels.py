"""MoE kernel choices of the trainer that depend on what the host has: the token dispatcher
('flex' needs DeepEP and CUDA) and the grouped expert MLP (Transformer Engine's grouped GEMM, the
``grouped_gemm`` package's, or without CUDA the compat stand-in).

:func:`check_flex_dispatcher` returns the extra ``TransformerConfig`` fields of Megatron-Core's
flex dispatcher or refuses, naming ``trainer.moe_token_dispatcher_type``;
:func:`grouped_gemm_available` says whether the grouped expert MLP can be built here.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from moe_async.trainer.config import TrainerConfig


def check_flex_dispatcher() -> dict[str, Any]:
    """``TransformerConfig`` fields for Megatron-Core's flex dispatcher with DeepEP
    (``moe_flex_dispatcher_backend='deepep'``: fused dispatch/combine over NVSHMEM/NVLink).

    Raises:
        ValueError: no CUDA, or the ``deep_ep`` package does not import (Megatron-Core's
            ``fused_a2a`` would fail at the first forward instead), naming the field.
    """
    import torch

    if not torch.cuda.is_available():
        raise ValueError("trainer.moe_token_dispatcher_type='flex' needs CUDA (DeepEP's fused dispatch/combine "
                         "kernels); use 'alltoall' or 'allgather' on this host")
    if importlib.util.find_spec("deep_ep") is None:
        raise ValueError("trainer.moe_token_dispatcher_type='flex' needs the deep_ep package (DeepEP), which is not "
                         "installed here; install DeepEP or use 'alltoall'")
    return {"moe_flex_dispatcher_backend": "deepep"}


def grouped_gemm_available() -> bool:
    """True when the grouped expert MLP can be built: Transformer Engine (Megatron-Core 0.16.1's
    ``TEGroupedMLP``), the ``grouped_gemm`` package (its legacy ``GroupedMLP``), or no CUDA (the
    legacy ``GroupedMLP`` over the CPU grouped GEMM of :mod:`moe_async.compat.grouped_gemm`)."""
    import torch

    from moe_async.megatron.parallel import have_te

    return not torch.cuda.is_available() or have_te() or importlib.util.find_spec("grouped_gemm") is not None


def check_grouped_gemm() -> None:
    """Refuse ``trainer.moe_grouped_gemm=true`` where :func:`grouped_gemm_available` is False
    (ValueError naming the field and the fix)."""
    if not grouped_gemm_available():
        from moe_async.megatron.build import GROUPED_GEMM_UNAVAILABLE

        raise ValueError(GROUPED_GEMM_UNAVAILABLE)


def refuse_unavailable_kernels(trainer_cfg: TrainerConfig) -> None:
    """A local run's check, before Ray or any process starts: ``trainer.moe_grouped_gemm=true``
    or ``trainer.moe_token_dispatcher_type='flex'`` where this host cannot build them (the
    trainer would otherwise refuse inside its actor, after Ray and the engines started).

    Raises:
        ValueError: naming the field (the messages of :func:`check_flex_dispatcher` and the
            model's own grouped-MLP refusal).
    """
    if trainer_cfg.moe_token_dispatcher_type == "flex":
        check_flex_dispatcher()
    if trainer_cfg.moe_grouped_gemm:
        check_grouped_gemm()
