"""The grouped expert MLP as this host builds it (``trainer.moe_grouped_gemm=true`` without CUDA:
Megatron-Core's legacy ``GroupedMLP`` over the compat grouped GEMM, nothing stood in) against
the sequential expert MLP, one process, results as JSON on stdout.

    python _grouped_mlp_cpu_checks.py TMP
    torchrun --nproc_per_node 2 _grouped_mlp_cpu_checks.py TMP ep2   (after the fp32 run)
        a grouped trainer at EP2 loads ``seq_ckpt`` and saves ``grp_ep2_ckpt``; a sequential
        trainer at EP2 loads ``grp_ckpt`` (TMP/ep2.json)

A tiny Mixtral (4 experts, 2 layers) ``src``, ``other`` from another seed (trainers built from
it equal ``src`` only through a load):

* a sequential and a grouped trainer both load ``src`` (HF), fp32 and bf16: logprobs, one GRPO
  step's loss and every parameter's gradient under 1-process names, the weights after the step;
  the grouped one with selective recompute of ``moe_act``: gradients, saved-activation peaks;
* the sequential trainer's checkpoint ``seq_ckpt`` loads into a grouped trainer built from
  ``other`` (export checksums; Megatron-Core's strict ``dist_checkpointing.load`` of the grouped
  model's own sharded state dict), which steps and saves ``grp_ckpt``; a sequential trainer from
  ``other`` loads ``grp_ckpt`` (checksums, and the next step equals the grouped one's);
* a grouped trainer's distributed-optimizer checkpoint offered to a sequential one: the refusal.
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


def _cfg(**kw):
    from moe_async.trainer.config import TrainerConfig

    return TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9, **kw)


def full_grads(tr) -> dict[str, torch.Tensor]:
    """Every parameter's gradient (DDP's ``main_grad`` after a step) as full 1-process tensors
    under the sequential layout's names: each shard of :func:`local_pieces` read from the
    gradient at the shard's own strides and offset (the pieces are views of the parameters)."""
    from moe_async.compat import cpu_device_scope
    from moe_async.megatron.sharding import local_pieces

    params = dict(tr.model.named_parameters())
    out: dict[str, torch.Tensor] = {}
    with cpu_device_scope():
        pieces = local_pieces(tr.model)
    for pc in pieces:
        p = params[pc.param]
        g = p.main_grad
        assert g.shape == p.shape and g.stride() == p.stride(), pc.param
        view = g.as_strided(pc.data.shape, pc.data.stride(), g.storage_offset() + pc.data.storage_offset()
                            - p.storage_offset())
        full = out.setdefault(pc.name, torch.full(pc.full_shape, float("nan"), dtype=torch.float64))
        full[pc.index()] = view.double()
    return out


def maxdiff(a, b) -> float:
    return max(abs(x - y) for u, v in zip(a, b) for x, y in zip(u, v))


def experts_module(tr) -> str:
    e = tr.model.decoder.layers[0].mlp.experts
    return type(e).__module__ + "." + type(e).__name__


def parity(src: str, dtype: str, ss) -> dict:
    """Sequential and grouped trainers on the same HF weights ``src`` in ``dtype``: module
    classes, exports, and the differences of logprobs, gradients and post-step weights."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    runs = {}
    for name, kw in (("seq", {}), ("grp", {"moe_grouped_gemm": True})):
        tr = MegatronTrainer(_cfg(params_dtype=dtype, **kw), src)
        r = runs[name] = {"module": experts_module(tr), "export": tr.hf_checksums(), "logprobs": tr.compute_logprobs(ss)}
        r["params"] = sorted(n for n, _ in tr.model.named_parameters() if ".experts." in n)
        m = tr.train_step(ss, ADV)
        r["step"] = {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}
        r["grads"] = full_grads(tr)
        r["after"] = {k: v.double() for k, v in tr.hf_exporter().hf_tensors()}
        r["after_sums"] = tr.hf_checksums()
        tr.close()
    s, g = runs["seq"], runs["grp"]
    assert set(s["grads"]) == set(g["grads"]), sorted(set(s["grads"]) ^ set(g["grads"]))[:4]
    return {"modules": [s["module"], g["module"]], "grp_params": g["params"], "exports": [s["export"], g["export"]],
            "logprob_maxdiff": maxdiff(s["logprobs"], g["logprobs"]), "steps": [s["step"], g["step"]],
            "grad_names": len(s["grads"]), "grad_nan": sum(int(torch.isnan(t).any()) for t in g["grads"].values()),
            "grad_maxdiff": max(float((s["grads"][k] - g["grads"][k]).abs().max()) for k in s["grads"]),
            "grad_expert_names": sum(".experts." in k for k in s["grads"]),
            "grad_absmax": max(float(t.abs().max()) for t in s["grads"].values()),
            "after_step_maxdiff": max(float((s["after"][k] - g["after"][k]).abs().max()) for k in s["after"]),
            "after_step_changed": s["after_sums"] != s["export"]}


def moe_act_recompute(src: str, ss) -> dict:
    """Selective recompute of the grouped expert MLP's activation (``recompute_modules:
    [moe_act]``, Megatron's ``CheckpointWithoutOutput``) against none: gradient difference and
    the peak bytes of saved activations of each."""
    from moe_async.trainer.activation_meter import SavedActivationMeter
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    out: dict = {}
    ref = None
    for name, kw in (("none", {}), ("moe_act", dict(recompute_granularity="selective", recompute_modules=["moe_act"]))):
        tr = MegatronTrainer(_cfg(moe_grouped_gemm=True, **kw), src)
        with SavedActivationMeter(tr.model.parameters()) as meter:
            loss = tr.train_step(ss, ADV)["loss"]
        g = full_grads(tr)
        ref = ref or g
        out[name] = {"loss": loss, "peak_bytes": meter.peak_bytes, "modules": list(tr.tf_config.recompute_modules or []),
                     "grad_maxdiff": max(float((g[k] - ref[k]).abs().max()) for k in g)}
        tr.close()
    return out


def main(tmp: str) -> dict:
    from _grouped_experts_checks import strict_load
    from _tiny import make_tiny_mixtral
    from _trainer_checks import samples

    from moe_async.compat import applied_mends
    from moe_async.megatron.container import resolve
    from moe_async.megatron.hf_io import iter_hf_tensors
    from moe_async.models import tensor_checksum
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    src, other = os.path.join(tmp, "src"), os.path.join(tmp, "other")
    make_tiny_mixtral(src, tie=False, seed=0)
    make_tiny_mixtral(other, tie=False, seed=1)
    ss = samples()
    res: dict = {n: {k: tensor_checksum(t) for k, t in iter_hf_tensors(d)} for n, d in (("src", src), ("other", other))}
    res["parity"] = {dtype: parity(src, dtype, ss) for dtype in ("fp32", "bf16")}
    res["mends"] = applied_mends()
    res["recompute"] = moe_act_recompute(src, ss)

    # --- checkpoints, both ways (weights and the plain optimizer's state) -------------------
    seq = MegatronTrainer(_cfg(), src)
    res["seq_logprobs"] = seq.compute_logprobs(ss)
    seq.save_checkpoint(os.path.join(tmp, "seq_ckpt"))
    seq.close()
    grp = MegatronTrainer(_cfg(moe_grouped_gemm=True), other)
    res["grp_export_before_load"] = grp.hf_checksums()
    grp.load_checkpoint(os.path.join(tmp, "seq_ckpt"))
    res["grp_export"] = grp.hf_checksums()
    res["ckpt_logprob_maxdiff"] = maxdiff(grp.compute_logprobs(ss), res["seq_logprobs"])
    res["strict"] = strict_load(grp.model, os.path.join(tmp, "seq_ckpt"))
    res["grp_step1"] = grp.train_step(ss, ADV)["loss"]
    res["grp_after_step1"] = grp.hf_checksums()
    grp.save_checkpoint(os.path.join(tmp, "grp_ckpt"))
    args = torch.load(os.path.join(resolve(os.path.join(tmp, "grp_ckpt")), "common.pt"), weights_only=False)["args"]
    res["grp_args_moe_grouped_gemm"] = args.moe_grouped_gemm
    m = grp.train_step(ss, ADV)
    res["grp_step2"] = {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}
    res["grp_after_step2"] = grp.hf_checksums()
    grp.close()
    seq2 = MegatronTrainer(_cfg(), other)
    seq2.load_checkpoint(os.path.join(tmp, "grp_ckpt"))
    res["seq2_loaded"] = seq2.hf_checksums()
    m = seq2.train_step(ss, ADV)
    res["seq2_step2"] = {k: m[k] for k in ("loss", "grad_norm", "num_tokens")}
    res["seq2_after_step2"] = seq2.hf_checksums()
    seq2.close()

    # --- the distributed optimizer's state does not cross layouts: refused, trainer unchanged ---
    grp = MegatronTrainer(_cfg(moe_grouped_gemm=True, use_distributed_optimizer=True), src)
    grp.train_step(ss, ADV)
    grp.save_checkpoint(os.path.join(tmp, "grp_do_ckpt"))
    grp.close()
    seq3 = MegatronTrainer(_cfg(use_distributed_optimizer=True), other)
    try:
        seq3.load_checkpoint(os.path.join(tmp, "grp_do_ckpt"))
        res["do_refusal"] = None
    except ValueError as e:
        res["do_refusal"] = [type(e).__name__, str(e)]
    res["do_after_refusal"] = seq3.hf_checksums()
    seq3.close()
    return res


def ep2(tmp: str) -> dict:
    """EP2 (2 local experts per rank: local index != global index): a grouped trainer loads the
    1-process sequential checkpoint (export, logprobs) and saves ``grp_ep2_ckpt``; a sequential
    trainer at EP2 loads the 1-process grouped checkpoint ``grp_ckpt`` (export)."""
    import torch.distributed as dist

    from _trainer_checks import samples

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    dist.init_process_group("gloo")
    res: dict = {}
    tr = MegatronTrainer(_cfg(moe_grouped_gemm=True, expert_model_parallel_size=2), os.path.join(tmp, "other"))
    tr.load_checkpoint(os.path.join(tmp, "seq_ckpt"))
    res.update(ep2_local_experts=tr.model.decoder.layers[0].mlp.experts.num_local_experts,
               ep2_module=experts_module(tr), ep2_export=tr.hf_checksums(), ep2_logprobs=tr.compute_logprobs(samples()))
    tr.save_checkpoint(os.path.join(tmp, "grp_ep2_ckpt"))
    tr.close()
    tr = MegatronTrainer(_cfg(expert_model_parallel_size=2), os.path.join(tmp, "other"))
    tr.load_checkpoint(os.path.join(tmp, "grp_ckpt"))
    res["ep2_seq_from_grp_export"] = tr.hf_checksums()
    tr.close()
    return res


def from_ep2(tmp: str) -> dict:
    """One process, sequential: loads the EP2 grouped checkpoint ``grp_ep2_ckpt`` (export)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(_cfg(), os.path.join(tmp, "other"))
    tr.load_checkpoint(os.path.join(tmp, "grp_ep2_ckpt"))
    out = {"seq_from_grp_ep2_export": tr.hf_checksums()}
    tr.close()
    return out


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[2:] == ["ep2"]:
        out = ep2(sys.argv[1])
        if int(os.environ["RANK"]) == 0:
            with open(os.path.join(sys.argv[1], "ep2.json"), "w") as f:
                json.dump(out, f)
    elif sys.argv[2:] == ["from_ep2"]:
        print(json.dumps(from_ep2(sys.argv[1])))
    else:
        print(json.dumps(main(sys.argv[1])))
