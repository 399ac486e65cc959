"""Mend 13: Megatron's distributed optimizer with torch's Adam keeps ``step`` per parameter.

Answers ``megatron/core/optimizer/distrib_optimizer.py`` (Megatron-Core 0.16.1): with torch's
``AdamW`` (no Apex/TE) the per-parameter ``step`` is lost or stale on a checkpoint load; this
mend restores it from the param groups, so the resumed Adam steps equal the uninterrupted ones.

Design notes: ``docs/design/compat.md``."""

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
