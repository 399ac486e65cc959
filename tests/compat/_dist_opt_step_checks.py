"""Mend 13 (moe_async/compat/dist_opt_step.py) in a fresh process: a 1-process trainer with
Megatron's distributed optimizer (torch's AdamW: no Apex/TE) takes one step, then Megatron-Core's
original ``DistributedOptimizer`` methods (kept as ``__wrapped__``) and the mended ones are run on
its real optimizer. Prints a JSON dict on the last line.

    python _dist_opt_step_checks.py TMP
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import torch  # noqa: E402


def main(tmp: str) -> None:
    from _tiny import make_tiny_mixtral

    model = make_tiny_mixtral(os.path.join(tmp, "tiny"), tie=True)
    from megatron.core.optimizer import distrib_optimizer as dom

    from moe_async import compat
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.types import Sample

    r: dict = {"have_apex_or_te": dom.HAVE_APEX_OR_TE}
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, lr=1e-3, make_vocab_size_divisible_by=64,
                                       use_distributed_optimizer=True), model)
    r["applied"] = "dist_opt_torch_adam_step" in compat.applied_mends()
    D = dom.DistributedOptimizer
    r["mend_in_place"] = all(getattr(f, "_moe_async_mend", False) and hasattr(f, "__wrapped__")
                             for f in (D._set_main_param_and_optimizer_states, D.load_state_dict))
    samples = [Sample(prompt_ids=[5, 6, 7], response_ids=[8, 9, 10, 11], rollout_logprobs=[-1.0] * 4,
                      weight_versions=[0] * 4) for _ in range(2)]
    tr.train_step(samples, [1.0, -1.0])
    tr.train_step(samples, [1.0, -1.0])
    opt = tr.optimizer.chained_optimizers[0]  # dense parameters

    def steps():  # (torch's load_state_dict replaces optimizer.state: read it afresh)
        ts = [s["step"] for s in opt.optimizer.state.values()]
        return {"values": sorted({float(t) for t in ts}), "n": len(ts), "distinct": len({id(t) for t in ts})}

    r["steps_trained"] = steps()
    # (b) load_state_dict: Megatron's own gives every parameter the same step tensor
    D.load_state_dict.__wrapped__(opt, opt.state_dict())
    r["steps_after_original_load"] = steps()
    any_state = next(iter(opt.optimizer.state.values()))
    before = float(any_state["step"])
    any_state["step"] += 1  # what torch's Adam does for ONE parameter
    r["shared_step_advanced"] = steps()["values"]
    any_state["step"] -= 1
    r["step_restored"] = float(any_state["step"]) == before
    opt.load_state_dict(opt.state_dict())  # mended
    r["steps_after_mended_load"] = steps()
    next(iter(opt.optimizer.state.values()))["step"] += 1
    r["one_step_advanced"] = steps()["values"]

    # (a) _set_main_param_and_optimizer_states with the tensors of a 'fully_reshardable' load
    model_param = next(iter(opt.model_param_group_index_map))
    cur = opt._get_main_param_and_optimizer_states(model_param)
    new = {k: (cur[k].detach() * 0.5 + 0.25).clone() for k in ("param", "exp_avg", "exp_avg_sq")}
    torch.set_grad_enabled(False)  # fp32 main params are views of the weights (as in the trainer's load)
    try:
        D._set_main_param_and_optimizer_states.__wrapped__(opt, model_param, dict(new))
        r["original_set_error"] = None
    except KeyError as e:
        r["original_set_error"] = f"KeyError: {e}"
    step_before = float(cur["step"])
    opt._set_main_param_and_optimizer_states(model_param, dict(new))
    cur = opt._get_main_param_and_optimizer_states(model_param)
    r["mended_set_copied"] = all(torch.equal(cur[k], new[k]) for k in new)
    r["mended_set_step_kept"] = float(cur["step"]) == step_before
    # ('dp_reshardable' hands back a stale per-parameter step: the param group's is kept)
    opt._set_main_param_and_optimizer_states(model_param, {**new, "step": torch.tensor(99.0)})
    r["stale_step_ignored"] = float(opt._get_main_param_and_optimizer_states(model_param)["step"]) == step_before
    tr.close()
    print(json.dumps(r))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
