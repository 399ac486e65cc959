"""Runs the MegatronTrainer checks in ONE fresh process (Megatron parallel state and the CPU
compat layer are process-global) and prints a JSON dict of results on the last line."""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import _checks  # noqa: E402
import torch  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402
from moe_async.types import Sample  # noqa: E402


FIVE = [(5, 7), (3, 6), (8, 4), (4, 9), (6, 5)]  # (prompt, response) lengths of samples()


def samples(seed: int = 0) -> list[Sample]:
    return _checks.samples(seed, FIVE)


def hf_logprobs(path: str, ss: list[Sample]) -> list[list[float]]:
    from transformers import MixtralForCausalLM

    return _checks.hf_response_logprobs(MixtralForCausalLM.from_pretrained(path).eval(), ss)


def main(tmp: str) -> None:
    from megatron.core.tensor_parallel import layers

    # compat mend 12 still needed: without Apex, Megatron refuses gradient_accumulation_fusion
    res: dict = {"apex_wgrad_fusion_before": bool(layers._grad_accum_fusion_available)}
    ss = samples()
    adv = [1.0, -0.5, 0.7, -1.2, 3.0]
    for tie in (True, False):
        path = make_tiny_mixtral(os.path.join(tmp, f"tie{int(tie)}"), tie=tie)
        t0 = time.perf_counter()
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3), path)
        res[f"build_s_{tie}"] = time.perf_counter() - t0
        res["grad_accum_fusion"] = bool(tr.tf_config.gradient_accumulation_fusion)
        mine, ref = tr.compute_logprobs(ss), hf_logprobs(path, ss)
        res[f"parity_maxdiff_{tie}"] = max(abs(a - b) for x, y in zip(mine, ref) for a, b in zip(x, y))
        res[f"parity_lens_ok_{tie}"] = [len(x) for x in mine] == [len(s.response_ids) for s in ss]
        res[f"ref_logp_min_{tie}"] = min(min(x) for x in ref)
        exported = dict(tr.export_hf_weights())
        from safetensors.torch import load_file

        disk = load_file(os.path.join(path, "model.safetensors"))
        res[f"export_equals_disk_{tie}"] = set(exported) == set(disk) and all(
            torch.equal(exported[k], disk[k]) for k in disk
        )
        before = tr.hf_checksums()
        m = tr.train_step(ss, adv)
        after = tr.hf_checksums()
        res[f"step_{tie}"] = m
        res[f"changed_{tie}"] = sum(before[k] != after[k] for k in before)
        res[f"n_tensors_{tie}"] = len(before)
        res[f"version_{tie}"] = tr.version
        # after a step the export must follow the new weights (checked vs. HF reload of export)
        res[f"logp_moved_{tie}"] = max(
            abs(a - b) for x, y in zip(tr.compute_logprobs(ss[:1]), mine[:1]) for a, b in zip(x, y)
        )
        if not tie:
            tr.close()

    # micro-batch invariance: the same global batch split into 1, 2, 4 micro-batches (aux
    # coeff 0: Megatron's load-balancing loss is defined per micro-batch, over its tokens, so
    # it is not split-invariant by design); clip_grad huge so the step leaves main_grad as is
    path = os.path.join(tmp, "tie1")
    inv, grads = {}, {}
    for mbs in (1, 2, 4):
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=mbs, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9),
                             path)
        inv[mbs] = tr.train_step(ss, adv)
        grads[mbs] = torch.cat([p.main_grad.detach().flatten().double() for p in tr.model.parameters()])
    res["mb_invariance"] = {
        f"{k}_{mbs}": (inv[1][k], inv[mbs][k]) for mbs in (2, 4) for k in ("loss", "grad_norm", "num_tokens", "kl_k3")
    }
    res["mb_grad_rel"] = {str(mbs): float((grads[mbs] - grads[1]).norm() / grads[1].norm()) for mbs in (2, 4)}
    res["mb_grad_n"] = int(grads[1].numel())
    # the accumulation-order floor: one-sample micro-batches, the samples in reverse order
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9), path)
    tr.train_step(ss[::-1], adv[::-1])
    g = torch.cat([p.main_grad.detach().flatten().double() for p in tr.model.parameters()])
    res["mb_grad_rel_order"] = float((g - grads[1]).norm() / grads[1].norm())
    # the same with packed THD micro-batches (one row of 1, 2 or 4 sequences back to back)
    inv_t, grads_t = {}, {}
    for mbs in (1, 2, 4):
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=mbs, moe_aux_loss_coeff=0.0, lr=1e-3, clip_grad=1e9,
                                           sequence_packing="thd"), path)
        inv_t[mbs] = tr.train_step(ss, adv)
        grads_t[mbs] = torch.cat([p.main_grad.detach().flatten().double() for p in tr.model.parameters()])
    res["thd_mb_invariance"] = {
        f"{k}_{mbs}": (inv_t[1][k], inv_t[mbs][k]) for mbs in (2, 4) for k in ("loss", "grad_norm", "num_tokens", "kl_k3")
    }
    res["thd_mb_grad_rel"] = {str(mbs): float((grads_t[mbs] - grads_t[1]).norm() / grads_t[1].norm()) for mbs in (2, 4)}
    res["thd_vs_padded_grad_rel"] = {str(mbs): float((grads_t[mbs] - grads[mbs]).norm() / grads[mbs].norm())
                                     for mbs in (1, 2, 4)}

    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.01, lr=1e-3), path)
    res["aux_step"] = tr.train_step(ss, adv)
    # zero advantages + zero-weight samples only via aux: pg_loss == 0 exactly
    res["zero_adv_step"] = tr.train_step(ss, [0.0] * len(ss))
    # torch_dist checkpoint: a reloaded trainer's next step equals the saving trainer's next step
    ck = os.path.join(tmp, "ckpt")
    tr.save_checkpoint(ck)
    nxt = tr.train_step(ss, adv)
    tr2 = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.01, lr=1e-3), path)
    tr2.load_checkpoint(ck)
    res["ckpt"] = {"version": tr2.version, "loss": (nxt["loss"], tr2.train_step(ss, adv)["loss"])}
    # a corrupt checkpoint (every shard file truncated): a named error, weights untouched
    import shutil

    bad = os.path.join(tmp, "ckpt_truncated")
    shutil.copytree(ck, bad)
    for f in os.listdir(bad):
        if f.endswith(".distcp"):
            fp = os.path.join(bad, f)
            with open(fp, "r+b") as fh:
                fh.truncate(os.path.getsize(fp) // 2)
    before = tr2.hf_checksums()
    try:
        tr2.load_checkpoint(bad)
        res["corrupt_ckpt"] = {"error": None}
    except RuntimeError as e:
        res["corrupt_ckpt"] = {"error": str(e)[:400], "unchanged": tr2.hf_checksums() == before,
                               "n": len(before)}
    # off-policy corrections (issue 7): decoupled PPO recomputes the proximal policy; with one
    # step per batch it equals the current weights, so loss and grads equal plain TIS
    dec = {}
    for corr in ("tis", "decoupled_ppo", "icepop"):
        trc = MegatronTrainer(TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-3,
                                            off_policy_correction=corr), path)
        dec[corr] = trc.train_step(ss, adv)
    res["corrections"] = dec
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
