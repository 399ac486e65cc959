"""C28 on a real MegatronTrainer: NaN under a zero mask trains; a NaN loss or gradient fails the
step before the optimizer, naming the sample, on every rank; NaN weights are never exported.

``_finite_checks.py one TMP OUT_DIR`` (1 process) or under torchrun (2 ranks) with
``dp2,pp2 TMP OUT_DIR`` (DP2 then PP2 in one launch, Megatron's parallel state destroyed
between them; either alone also works); rank 0 writes each mode's JSON dict of results to
``OUT_DIR/<mode>.json``."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "models"))

import torch  # noqa: E402
from _checks import ADV, gather, rank, samples  # noqa: E402
from _checks import trainer_cfg as _cfg  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

NAN = float("nan")


def _try_step(tr, ss):
    from moe_async.trainer.finite import NonFiniteError

    try:
        return {"ok": True, "m": tr.train_step(ss, ADV)}
    except NonFiniteError as e:
        return {"ok": False, "error": str(e)}


def _grad_hook_nan(tr):
    """A NaN gradient with a finite loss: the final norm's output gets ``+ 0 * sqrt(0)``
    (value 0, gradient 0 * inf = NaN), so every gradient upstream of it is NaN."""
    def hook(_mod, _inp, out):
        return out + 0.0 * torch.sqrt(out - out.detach())

    mod = dict(tr.model.named_modules())
    name = next((n for n in mod if n.endswith("decoder.final_layernorm")), None)
    return (name, mod[name].register_forward_hook(hook)) if name else (None, None)


def one_process(tmp: str, out: str, mode: str = "one") -> None:
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    multi = mode != "one"
    path = make_tiny_mixtral(os.path.join(tmp, "tiny"), tie=True) if rank() == 0 else os.path.join(tmp, "tiny")
    if multi:
        torch.distributed.barrier()
    res: dict = {}

    def trainer_cfg():  # noqa: F811 - the layout of this mode
        return _cfg(pp=2 if mode == "pp2" else 1)

    ref = MegatronTrainer(trainer_cfg(), path)
    clean = samples()
    res["ref_step"] = ref.train_step(clean, ADV)
    ref_sums = ref.hf_checksums()
    del ref

    tr = MegatronTrainer(trainer_cfg(), path)
    # 1. a NaN rollout logprob in the zero-weight sample (index 4) under the default tis
    ss = samples()
    assert ss[4].loss_weight == 0.0
    ss[4].rollout_logprobs[1] = NAN
    before = tr.hf_checksums()
    res["zero_weight_nan"] = _try_step(tr, ss)
    res["zero_weight_nan_changed"] = tr.hf_checksums() != before
    res["zero_weight_nan_equals_ref"] = tr.hf_checksums() == ref_sums
    del tr

    tr = MegatronTrainer(trainer_cfg(), path)
    before = tr.hf_checksums()
    # 2. a NaN rollout logprob in a loss-bearing sample (6: rank 1's slice at DP2)
    ss = samples()
    ss[6].rollout_logprobs[2] = NAN
    ss[6].metadata.update(group_id=3, sample_index=2)
    res["nan_loss"] = gather(_try_step(tr, ss))
    res["nan_loss_version"] = gather(tr.version)
    res["nan_loss_unchanged"] = tr.hf_checksums() == before
    # 3. a NaN gradient with a finite loss (made on rank 0 only at DP2, on the last stage at
    #    PP2: every rank must still fail)
    hook = None
    if rank() == 0 or mode == "pp2":
        res["grad_param"], hook = _grad_hook_nan(tr)
    res["nan_grad"] = gather(_try_step(tr, samples()))
    if hook is not None:
        hook.remove()
    res["nan_grad_version"] = gather(tr.version)
    res["nan_grad_unchanged"] = tr.hf_checksums() == before
    # 4. then a clean step: exactly the fresh trainer's first step (grads were zeroed, no
    #    optimizer state was touched)
    res["after_step"] = tr.train_step(clean, ADV)
    res["after_version"] = tr.version
    res["after_equals_ref"] = tr.hf_checksums() == ref_sums
    # 5. NaN weights are refused before anything is exported (rank 1's copy at DP2, the last
    #    stage's at PP2)
    target = "decoder.final_layernorm.weight"
    if rank() == (1 if multi else 0):
        with torch.no_grad():
            dict(tr.model.named_parameters())[next(n for n, _ in tr.model.named_parameters()
                                                   if n.endswith(target))][3] = float("inf")
    got: list = []
    res["raised_at_call"] = True  # refused when export_hf_weights() is called (before a send pauses engines)
    try:
        it = tr.export_hf_weights()
        res["raised_at_call"] = False
        for name, _ in it:
            got.append(name)
        res["export"] = {"ok": True}
    except Exception as e:  # noqa: BLE001 - the test asserts the kind
        res["export"] = {"ok": False, "kind": type(e).__name__, "error": str(e)}
    res["export"] = gather(res["export"])
    res["exported_before_error"] = gather(len(got))
    res["raised_at_call"] = gather(res["raised_at_call"])
    if rank() == 0:
        with open(out, "w") as f:
            json.dump(res, f)
    if multi:
        torch.distributed.barrier()


if __name__ == "__main__":
    torch.set_num_threads(1)
    modes, tmp, out_dir = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
    if modes == ["one"]:
        one_process(os.path.join(tmp, "one"), os.path.join(out_dir, "one.json"))
    else:
        from megatron.core import parallel_state as ps

        assert set(modes) <= {"dp2", "pp2"}, modes
        torch.distributed.init_process_group("gloo")
        for mode in modes:  # each mode's first trainer initialised the parallel state at its layout
            one_process(os.path.join(tmp, mode), os.path.join(out_dir, f"{mode}.json"), mode)
            ps.destroy_model_parallel()
        torch.distributed.destroy_process_group()
