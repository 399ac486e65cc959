"""Mend 16: Megatron-Core's optimizer CPU offload (``HybridDeviceOptimizer``) on a host without CUDA.

Answers ``optimizer/cpu_offloading/hybrid_optimizer.py``: without CUDA nothing would be
offloaded, so the optimizer's own parameters count as the device side and ``pin_memory()`` is
the identity; the offload code path (grad copy, host step, copy back) then runs as on a GPU.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

import functools

import torch
from torch.overrides import TorchFunctionMode


class _ParamsOnDevice(TorchFunctionMode):
    """``is_cuda`` is True for the tensors in ``ids`` (the optimizer's parameters); ``pin_memory()``
    returns its tensor. Only active while the sub-optimizer groups are built."""

    def __init__(self, ids: set[int]) -> None:
        super().__init__()
        self._ids = ids

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is torch.Tensor.is_cuda and args and id(args[0]) in self._ids:
            return True
        if func is torch.Tensor.pin_memory:
            return args[0]
        return func(*args, **kwargs)


def patch_hybrid_device_optimizer() -> bool:
    """Install the mend on ``HybridDeviceOptimizer`` (idempotent; only without CUDA). Returns
    True when it is in place."""
    if torch.cuda.is_available():
        return False
    from megatron.core.optimizer.cpu_offloading import hybrid_optimizer as ho

    cls = ho.HybridDeviceOptimizer
    if getattr(cls, "_moe_async_cpu_mend", False):
        return True
    orig_init, orig_groups = cls.__init__, cls._get_sub_optimizer_param_groups

    @functools.wraps(orig_init)
    def __init__(self, params, *args, **kwargs):
        groups = list(params)
        for g in groups:
            ps = g["params"] if isinstance(g, dict) else [g]
            for p in ([ps] if isinstance(ps, torch.Tensor) else ps):
                if isinstance(p, torch.Tensor) and p.requires_grad and not p.is_leaf:
                    p.retain_grad()
        orig_init(self, groups, *args, **kwargs)

    @functools.wraps(orig_groups)
    def _get_sub_optimizer_param_groups(self, offload_fraction):
        ids = {id(p) for g in self.param_groups for p in g["params"]}
        with _ParamsOnDevice(ids):
            return orig_groups(self, offload_fraction)

    cls.__init__ = __init__
    cls._get_sub_optimizer_param_groups = _get_sub_optimizer_param_groups
    cls._moe_async_cpu_mend = True
    return True
