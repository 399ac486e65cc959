"""The grouped expert MLP (``trainer.moe_grouped_gemm=true``: Megatron-Core's ``TEGroupedMLP``
from ``TESpecProvider``, the product build path) against the sequential expert MLP, one process,
results as JSON on stdout.

    python _grouped_experts_checks.py TMP
    torchrun --nproc_per_node 2 _grouped_experts_checks.py TMP ep2   (after the 1-process run)
        a grouped trainer at EP2 loads ``seq_ckpt``: export checksums, logprobs (TMP/ep2.json)

Only Transformer Engine is stood in: Megatron-Core's own TE grouped linear classes compiled over
a plain-torch ``GroupedLinear`` (tests/models/_te_grouped_standin.py), and the CUDA + TE probe
``moe_kernels.grouped_gemm_available``. A tiny Mixtral (4 experts, 2 layers) ``src``; trainers
built from ``other`` (another seed) so that only the loads make them equal ``src``:

* sequential trainer from ``src``: logprobs, HF export checksums, checkpoint ``seq_ckpt``;
* grouped trainer loads ``seq_ckpt`` (the trainer's load; then Megatron-Core's
  ``dist_checkpointing.load`` of its own sharded state dict, strict: ``RETURN_ALL`` sets
  reported): export checksums, logprobs; one GRPO step, checkpoint ``grp_ckpt``, next step;
* a sequential trainer loads ``grp_ckpt`` (model + optimizer): export checksums, the next step.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path.insert(0, os.path.join(ROOT, "tests", "models"))
sys.path.insert(0, os.path.join(ROOT, "tests"))
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import torch  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0]


def main(tmp: str) -> dict:
    from _tiny import make_tiny_mixtral

    src, other = os.path.join(tmp, "src"), os.path.join(tmp, "other")
    make_tiny_mixtral(src, tie=False, seed=0)
    make_tiny_mixtral(other, tie=False, seed=1)
    import _te_grouped_standin
    from _trainer_checks import samples

    import moe_async.trainer.moe_kernels as mk
    from moe_async.models import tensor_checksum
    from moe_async.megatron.hf_io import iter_hf_tensors
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    _te_grouped_standin.install()
    mk.grouped_gemm_available = lambda: True  # the CUDA + TE probe; TE's GroupedLinear is stood in

    def cfg(**kw):
        return TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, **kw)

    def experts(tr) -> list[str]:
        e = tr.model.decoder.layers[0].mlp.experts
        return [type(e).__module__ + "." + type(e).__name__,
                *(f"{n}: {type(m).__mro__[1].__module__}.{type(m).__mro__[1].__name__}"
                  for n, m in e.named_children())]

    def step(tr) -> dict:
        m = tr.train_step(ss, ADV)
        return {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}

    def maxdiff(a, b) -> float:
        return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))

    ss = samples()
    res: dict = {n: {k: tensor_checksum(t) for k, t in iter_hf_tensors(d)} for n, d in (("src", src), ("other", other))}
    seq = MegatronTrainer(cfg(), src)
    res["seq_modules"] = experts(seq)
    lp_seq = res["seq_logprobs"] = seq.compute_logprobs(ss)
    res["seq_export"] = seq.hf_checksums()
    seq.save_checkpoint(os.path.join(tmp, "seq_ckpt"))
    seq.close()

    grp = MegatronTrainer(cfg(moe_grouped_gemm=True), other)
    res["grp_modules"] = experts(grp)
    res["grp_export_before_load"] = grp.hf_checksums()
    grp.load_checkpoint(os.path.join(tmp, "seq_ckpt"))
    res["grp_export"] = grp.hf_checksums()
    res["logprob_maxdiff"] = maxdiff(grp.compute_logprobs(ss), lp_seq)
    res["strict"] = strict_load(grp.model, os.path.join(tmp, "seq_ckpt"))
    res["grp_step1"] = step(grp)
    res["grp_after_step1"] = grp.hf_checksums()
    grp.save_checkpoint(os.path.join(tmp, "grp_ckpt"))
    from moe_async.megatron.container import resolve

    args = torch.load(os.path.join(resolve(os.path.join(tmp, "grp_ckpt")), "common.pt"), weights_only=False)["args"]
    res["grp_args_moe_grouped_gemm"] = args.moe_grouped_gemm  # Megatron-LM's args in common.pt
    res["grp_step2"] = step(grp)
    res["grp_after_step2"] = grp.hf_checksums()
    grp.close()

    seq2 = MegatronTrainer(cfg(), other)
    seq2.load_checkpoint(os.path.join(tmp, "grp_ckpt"))
    res["seq2_loaded"] = seq2.hf_checksums()
    res["seq2_step2"] = step(seq2)
    res["seq2_after_step2"] = seq2.hf_checksums()
    seq2.close()
    return res


def ep2(tmp: str) -> dict:
    """The grouped layout at EP2 (2 local experts per rank) loads the 1-process sequential
    checkpoint: its export and logprobs, to compare with the 1-process run's."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    import _te_grouped_standin
    from _trainer_checks import samples

    import moe_async.trainer.moe_kernels as mk
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    _te_grouped_standin.install()
    mk.grouped_gemm_available = lambda: True
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, moe_grouped_gemm=True,
                                       expert_model_parallel_size=2), os.path.join(tmp, "other"))
    tr.load_checkpoint(os.path.join(tmp, "seq_ckpt"))
    res = {"ep2_local_experts": tr.model.decoder.layers[0].mlp.experts.num_local_experts,
           "ep2_export": tr.hf_checksums(), "ep2_logprobs": tr.compute_logprobs(samples())}
    tr.close()
    return res


def strict_load(model, path: str) -> dict:
    """Megatron-Core's ``dist_checkpointing.load`` of ``model``'s own sharded state dict (TE key
    names, as the trainer saves) from the trainer checkpoint ``path``, ``StrictHandling.RETURN_ALL``:
    model keys absent from the checkpoint, checkpoint model keys the model did not ask for (the
    optimizer's left out), and whether every loaded tensor equals the model's."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    from moe_async.compat import cpu_device_scope
    from moe_async.megatron.container import resolve
    from moe_async.megatron.dist_ckpt_files import is_optimizer_key
    from moe_async.megatron.te_spec_names import add_te_extra_state, to_te_names

    with cpu_device_scope():
        sd = model.sharded_state_dict()
        to_te_names(sd)
        add_te_extra_state(sd)
        loaded, in_ckpt_only, absent = dist_checkpointing.load({"model": sd}, resolve(path),
                                                               strict=StrictHandling.RETURN_ALL)
    state = model.state_dict()
    got = loaded["model"]
    tensors = [k for k, v in got.items() if isinstance(v, torch.Tensor) and v.numel() and k in state]
    same = [k for k in tensors if got[k].shape == state[k].shape and torch.equal(got[k], state[k])]
    return {"absent": sorted(absent), "ckpt_only": sorted(k for k in in_ckpt_only if not is_optimizer_key(k)),
            "equal": len(same), "unequal": sorted(set(tensors) - set(same)),
            "expert_keys": sorted(k for k in got if "experts" in k and "_extra_state" not in k)}


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[2:] == ["ep2"]:
        out = ep2(sys.argv[1])
        if int(os.environ["RANK"]) == 0:
            with open(os.path.join(sys.argv[1], "ep2.json"), "w") as f:
                json.dump(out, f)
    else:
        print(json.dumps(main(sys.argv[1])))
