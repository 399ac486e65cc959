"""One distillation step of the Megatron trainer against a plain-PyTorch step on the same
Hugging Face model and batch (run in a fresh process; prints a JSON dict on the last line).

Reference (written here from the formulas, not from moe_async):
    A_t = -(logp_rollout_t - logp_teacher_t)            per-token reverse-KL advantage
    w_t = min(exp(logp_t - rollout_logp_t), C)          token TIS, detached, C = tis_cap
    L   = (1/N) sum_i sum_{t in resp_i} -w_t A_t exp(logp_t - sg(logp_t))
The teacher is another tiny model; rollout logprobs are the student's own, perturbed.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "trainer"))

import torch  # noqa: E402
from _reference_checks import batch, hf_token_logp, load_dir  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

from moe_async.distill.advantages import distill_advantages  # noqa: E402
from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402
from moe_async.types import Group, Sample  # noqa: E402

CAP = 2.0


def main(tmp: str) -> None:
    from transformers import MixtralForCausalLM

    path = make_tiny_mixtral(os.path.join(tmp, "m"), seed=5)
    teacher = MixtralForCausalLM.from_pretrained(make_tiny_mixtral(os.path.join(tmp, "t"), seed=9)).float().eval()
    groups, _ = batch()
    pairs = [p for g in groups for p in g]
    hf = MixtralForCausalLM.from_pretrained(path).float()
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf_lp = [hf_token_logp(hf, p, r) for p, r in pairs]
        t_lp = [hf_token_logp(teacher, p, r).tolist() for p, r in pairs]
    rollout = [(lp + 0.6 * (torch.rand(lp.shape, generator=gen) - 0.5)).tolist() for lp in hf_lp]
    ref_adv = [[-(s - t) for s, t in zip(rl, tl)] for rl, tl in zip(rollout, t_lp)]
    res: dict = {}
    samples = [Sample(p, r, rl, [0] * len(r), teacher_logprobs=tl) for (p, r), rl, tl in zip(pairs, rollout, t_lp)]
    grouped = [Group(0, samples[:4]), Group(1, samples[4:])]
    adv = distill_advantages(grouped, kl_coef=1.0, reward_coef=0.0)
    res["adv_max_abs_diff"] = max(abs(a - b) for x, y in zip(adv, ref_adv) for a, b in zip(x, y))
    res["adv_abs_max"] = max(abs(a) for x in adv for a in x)
    N = sum(len(r) for _, r in pairs)
    hf.zero_grad()
    loss = 0.0
    for (p, r), a, rl in zip(pairs, ref_adv, rollout):
        lp = hf_token_logp(hf, p, r)
        w = torch.clamp(torch.exp(lp.detach() - torch.tensor(rl)), max=CAP)
        loss = loss + (-w * torch.tensor(a) * torch.exp(lp - lp.detach())).sum()
    loss = loss / N
    loss.backward()
    res["ref_loss"] = float(loss)
    with torch.no_grad():
        for prm in hf.parameters():
            prm.copy_(prm.grad if prm.grad is not None else torch.zeros_like(prm))
    hf.save_pretrained(os.path.join(tmp, "grad"))
    ref_grad = load_dir(os.path.join(tmp, "grad"))

    # the same reference in float64 (weights upcast; rollout/teacher logprobs and advantages as
    # above): the exact gradient, to which each fp32 implementation's own rounding is compared
    hf64 = MixtralForCausalLM.from_pretrained(path, experts_implementation="eager").double()
    hf64.zero_grad()
    loss64 = 0.0
    for (p, r), a, rl in zip(pairs, ref_adv, rollout):
        lp = hf64(torch.tensor([p + r])).logits[0].log_softmax(-1)[len(p) - 1: len(p) - 1 + len(r)]
        lp = lp.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        w = torch.clamp(torch.exp(lp.detach() - torch.tensor(rl, dtype=torch.float64)), max=CAP)
        loss64 = loss64 + (-w * torch.tensor(a, dtype=torch.float64) * torch.exp(lp - lp.detach())).sum()
    (loss64 / N).backward()
    res["ref64_loss"] = float(loss64 / N)
    with torch.no_grad():
        for prm in hf64.parameters():
            prm.copy_(prm.grad if prm.grad is not None else torch.zeros_like(prm))
    hf64.save_pretrained(os.path.join(tmp, "grad64"))  # checkpoint names, as the fp32 reference's
    g64 = load_dir(os.path.join(tmp, "grad64"))

    tr = MegatronTrainer(TrainerConfig(lr=1e-3, moe_aux_loss_coeff=0.0, clip_grad=1e9, micro_batch_size=3,
                                       off_policy_correction="tis", tis_cap=CAP), path)
    m = tr.train_step(samples, adv)
    res["train_pg_loss"] = m["pg_loss"]
    params = list(tr.model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.detach().clone().to(p.dtype)
    tr.__dict__.pop("_hf_export_plan", None)
    g_tr = {n: t.clone() for n, t in tr.export_hf_weights()}
    for p, d in zip(params, saved):
        p.data = d
    names = sorted(ref_grad)
    a = torch.cat([g_tr[n].flatten().double() for n in names])
    b = torch.cat([ref_grad[n].flatten().double() for n in names])
    res["grad_max_abs_diff"] = float((a - b).abs().max())
    res["grad_abs_max"] = float(b.abs().max())
    res["grad_rel_l2"] = float((a - b).norm() / b.norm())
    res["grad_cos"] = float(a @ b / (a.norm() * b.norm()))
    res["grad_norm_ratio"] = float(a.norm() / b.norm())
    c = torch.cat([g64[n].flatten().double() for n in names])
    res["grad64_max_abs_diff"] = float((a - c).abs().max())  # the trainer (fp32) against the exact gradient
    res["grad64_rel_l2"] = float((a - c).norm() / c.norm())
    res["hf32_vs_64_max_abs_diff"] = float((b - c).abs().max())  # the fp32 reference's own rounding
    tr.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
