"""Mend 13: Megatron's distributed optimizer with torch's Adam keeps ``step`` per parameter.

Answers ``megatron/core/optimizer/distrib_optimizer.py`` (Megatron-Core 0.16.1). Without Apex
or Transformer Engine (always the case without CUDA) Megatron-Core's optimizer is torch's
``AdamW``, whose state holds a 0-dim ``step`` tensor per parameter (FusedAdam keeps it per
param group). ``DistributedOptimizer`` stores the step once, in the param groups of its
common state, and restores it in ``load_state_dict``; two places then go wrong:

(a) ``_set_main_param_and_optimizer_states`` copies every per-parameter state key from the
    tensors read from a checkpoint. The ``fully_reshardable`` format (Megatron-LM's
    ``--dist-ckpt-optim-fully-reshardable``) and ``fully_sharded_model_space`` do not store
    ``step`` there: loading raises ``KeyError: 'step'``. The ``dp_reshardable`` format hands
    back the step this optimizer had *before* the load (a ``LocalNonpersistentObject``), which
    overwrote the checkpoint's (a fresh trainer resumed at step 1 whatever step was saved).
(b) ``load_state_dict`` gives every parameter the *same* step tensor (``s["step"] = step``);
    torch's Adam increments it in place once per parameter, so from the first step after a
    load the bias correction ``1 - beta**step`` used ``step + k`` for the k-th parameter
    (measured: the second step after a DP2 resume differed from the uninterrupted run's, loss
    -0.4256 vs -0.4656).

Mend: the per-parameter step is never copied from the read tensors (it is the checkpoint's
param-group step, already set by ``load_state_dict``), and after ``load_state_dict`` each
parameter gets its own copy of it. Applied only when Megatron-Core uses torch's Adam
(``distrib_optimizer.HAVE_APEX_OR_TE`` false) and, as every mend, only without CUDA.
Test: tests/compat/test_dist_opt_step.py.
"""

from __future__ import annotations

import functools

import torch


def _own_step_copies(opt: torch.optim.Optimizer) -> None:
    """Give every parameter of ``opt`` its own ``step`` tensor (same value)."""
    for s in opt.state.values():
        step = s.get("step")
        if isinstance(step, torch.Tensor):
            s["step"] = step.detach().clone()


def patch_dist_opt_torch_adam_step() -> bool:
    """Install mend 13 on ``DistributedOptimizer`` (idempotent). Returns True when it is in
    place, False (changing nothing) when Megatron-Core uses Apex's / TE's FusedAdam, whose step
    lives in the param groups. The originals stay reachable as ``__wrapped__``."""
    from megatron.core.optimizer import distrib_optimizer as dom

    if dom.HAVE_APEX_OR_TE:
        return False
    cls = dom.DistributedOptimizer
    if getattr(cls._set_main_param_and_optimizer_states, "_moe_async_mend", False):
        return True
    orig_set = cls._set_main_param_and_optimizer_states
    orig_load = cls.load_state_dict

    @functools.wraps(orig_set)
    def _set_main_param_and_optimizer_states(self, model_param, tensors):
        if not self.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            step = self.optimizer.state[main_param].get("step")
            if step is not None:  # keep the step load_state_dict set (the checkpoint's)
                tensors = {**{k: v for k, v in tensors.items() if k != "step"}, "step": step}
        return orig_set(self, model_param, tensors)

    @functools.wraps(orig_load)
    def load_state_dict(self, state_dict):
        out = orig_load(self, state_dict)
        if not self.ddp_config.use_megatron_fsdp:
            _own_step_copies(self.optimizer)
        return out

    setattr(_set_main_param_and_optimizer_states, "_moe_async_mend", True)
    setattr(load_state_dict, "_moe_async_mend", True)
    cls._set_main_param_and_optimizer_states = _set_main_param_and_optimizer_states
    cls.load_state_dict = load_state_dict
    return True
