"""Runs the trainer memory-feature checks in ONE fresh process (Megatron parallel state and the
CPU compat layer are process-global) and prints a JSON dict of results on the last line:
activation recompute (full uniform / block, selective) against no recompute, and Megatron-Core's
optimizer CPU offload (HybridDeviceOptimizer, offload fraction 1 and 0.5) against the on-device
distributed optimizer."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import _checks  # noqa: E402
import torch  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

from moe_async.trainer.activation_meter import SavedActivationMeter  # noqa: E402
from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402

LENS = [(20, 40), (16, 44), (24, 36), (30, 30)]
ADV = [1.0, -0.5, 0.7, -1.2]
RECOMPUTE = {
    "none": {},
    "full_uniform": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    "full_block": dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=2),
    "selective": dict(recompute_granularity="selective"),  # Megatron's default: core_attn
    "selective_moe": dict(recompute_granularity="selective", recompute_modules=["core_attn", "moe"]),
}


def _grads(tr) -> torch.Tensor:
    return torch.cat([p.main_grad.detach().flatten().double() for p in tr.model.parameters()])


def recompute(path: str, ss) -> dict:
    out, ref = {}, None
    for name, kw in RECOMPUTE.items():
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=4, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9,
                                           **kw), path)
        with SavedActivationMeter(tr.model.parameters()) as meter:
            m = tr.train_step(ss, ADV)
        g = _grads(tr)
        if ref is None:
            ref = g
        out[name] = {"loss": m["loss"], "grad_norm": m["grad_norm"], "peak_bytes": meter.peak_bytes,
                     "grad_rel": float((g - ref).norm() / ref.norm()), "n": int(g.numel()),
                     "tf": [tr.tf_config.recompute_granularity, tr.tf_config.recompute_method,
                            tr.tf_config.recompute_num_layers, list(tr.tf_config.recompute_modules or [])]}
        tr.close()
    return out


def dispatch(path: str, ss) -> dict:
    """Token dispatcher and expert capacity: every parameter's gradient relative to the default
    (alltoall, no capacity)."""
    out, ref = {}, None
    for name, kw in {"alltoall": {}, "allgather": dict(moe_token_dispatcher_type="allgather"),
                     "capacity_no_drop": dict(moe_expert_capacity_factor=2.0),
                     "capacity_padded": dict(moe_expert_capacity_factor=2.0, moe_pad_expert_input_to_capacity=True),
                     "capacity_drop": dict(moe_expert_capacity_factor=0.5),
                     "capacity_drop_position": dict(moe_expert_capacity_factor=0.5,
                                                    moe_token_drop_policy="position")}.items():
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=4, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9,
                                           **kw), path)
        m = tr.train_step(ss, ADV)
        g = _grads(tr)
        if ref is None:
            ref = g
        out[name] = {"loss": m["loss"], "grad_rel": float((g - ref).norm() / ref.norm()),
                     "tf": [tr.tf_config.moe_token_dispatcher_type, tr.tf_config.moe_expert_capacity_factor,
                            tr.tf_config.moe_token_drop_policy]}
        tr.close()
    return out


def offload(path: str, ss) -> dict:
    out, ref = {}, None
    for name, kw in {"device": {}, "offload": dict(optimizer_cpu_offload=True),
                     "offload_half": dict(optimizer_cpu_offload=True, optimizer_offload_fraction=0.5)}.items():
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3,
                                           use_distributed_optimizer=True, **kw), path)
        steps = [tr.train_step(ss, ADV) for _ in range(3)]
        w = torch.cat([p.detach().flatten().double() for p in tr.model.parameters()])
        inner = [o.optimizer for o in tr.optimizer.chained_optimizers]
        hybrid = [o for o in inner if type(o).__name__ == "HybridDeviceOptimizer"]
        if ref is None:
            ref = (steps, w)
        out[name] = {
            "loss": [s["loss"] for s in steps], "grad_norm": [s["grad_norm"] for s in steps],
            "w_max_abs": float((w - ref[1]).abs().max()), "w_rel": float((w - ref[1]).norm() / ref[1].norm()),
            "hybrid": len(hybrid),
            "host_copies": sum(len(o.gpu_params_map_cpu_copy) for o in hybrid),
            "host_numel": sum(t.numel() for o in hybrid for t in o.gpu_params_map_cpu_copy.values()),
            "shard_numel": sum(p.numel() for o in hybrid for g in o.param_groups for p in g["params"]),
            "cpu_optimizers": sum(len(o.cpu_optimizers) for o in hybrid),
        }
        tr.close()
    return out


def main(tmp: str) -> None:
    path = make_tiny_mixtral(os.path.join(tmp, "tie1"), tie=True)
    ss = _checks.samples(0, LENS, zero_at=None)
    print(json.dumps({"recompute": recompute(path, ss), "offload": offload(path, ss), "dispatch": dispatch(path, ss)}))


if __name__ == "__main__":
    main(sys.argv[1])
