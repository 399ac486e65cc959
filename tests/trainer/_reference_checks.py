"""One GRPO step of the Megatron trainer against an independent plain-PyTorch GRPO step on the
same Hugging Face model and batch (run in a fresh process; prints a JSON dict on the last line).

Reference (written here from the formulas, not from moe_async.trainer):
    A_i = (r_i - mean_g r) / (std_g r + 1e-6)           population std per group of G samples
    w_t = min(exp(logp_t - rollout_logp_t), C)          token TIS, detached, C = tis_cap
    L   = (1/N) sum_i sum_{t in resp_i} -w_t A_i exp(logp_t - sg(logp_t))    (ratio 1 in value)
    grad L = (1/N) sum -w_t A_i grad logp_t             (clip inactive: one step per batch)
    Adam step 1 (bias-corrected, no weight decay): dtheta = -lr g / (|g| + eps)
"""

from __future__ import annotations

import json
import math
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import torch  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

from moe_async.trainer.advantages import compute_grpo_advantages  # noqa: E402
from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402
from moe_async.types import Sample  # noqa: E402

LR, EPS, CAP = 1e-3, 1e-8, 2.0


def batch(seed: int = 0):
    """2 groups x 4 samples of random tokens (prompt 5-8, response 3-9 tokens) and rewards."""
    g = torch.Generator().manual_seed(seed)
    rewards = [[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 1.0]]
    groups = []
    for gi in range(2):
        prompt = torch.randint(3, 256, (5 + 3 * gi,), generator=g).tolist()
        groups.append([(prompt, torch.randint(3, 256, (3 + (2 * j + gi) % 7,), generator=g).tolist())
                       for j in range(4)])
    return groups, rewards


def hf_token_logp(model, prompt: list[int], resp: list[int]) -> torch.Tensor:
    ids = torch.tensor([prompt + resp])
    lp = model(ids).logits[0].float().log_softmax(-1)
    P = len(prompt)
    return lp[P - 1: P - 1 + len(resp)].gather(-1, torch.tensor(resp).unsqueeze(-1)).squeeze(-1)


def load_dir(path: str) -> dict[str, torch.Tensor]:
    import glob

    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def main(tmp: str) -> None:
    from transformers import MixtralForCausalLM

    path = make_tiny_mixtral(os.path.join(tmp, "m"), seed=5)
    groups, rewards = batch()
    res: dict = {}
    # --- advantages: independent formula
    ref_adv = []
    for r in rewards:
        mu = sum(r) / len(r)
        sd = math.sqrt(sum((x - mu) ** 2 for x in r) / len(r))
        ref_adv += [(x - mu) / (sd + 1e-6) for x in r]
    adv = [a for ga in compute_grpo_advantages(rewards) for a in ga]
    res["adv_max_abs_diff"] = max(abs(a - b) for a, b in zip(adv, ref_adv))

    # --- HF reference: logprobs, rollout logprobs (perturbed so TIS weights differ from 1 and
    # some hit the cap), loss and gradient
    hf = MixtralForCausalLM.from_pretrained(path).float()
    hf.train()  # no dropout in Mixtral (attention_dropout 0); train() only for symmetry
    pairs = [p for g in groups for p in g]
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        hf_lp = [hf_token_logp(hf, p, r) for p, r in pairs]
    rollout = [(lp + 1.2 * (torch.rand(lp.shape, generator=gen) - 0.5) - 0.5).tolist() for lp in hf_lp]
    N = sum(len(r) for _, r in pairs)
    hf.zero_grad()
    loss, ws = 0.0, []
    for (p, r), a, rl in zip(pairs, ref_adv, rollout):
        lp = hf_token_logp(hf, p, r)
        w = torch.clamp(torch.exp(lp.detach() - torch.tensor(rl)), max=CAP)
        ws += w.tolist()
        loss = loss + (-w * a * torch.exp(lp - lp.detach())).sum()
    loss = loss / N
    loss.backward()
    res["ref_loss"] = float(loss)
    res["tis_capped"] = sum(w >= CAP for w in ws)
    res["tis_mean_ref"] = sum(ws) / len(ws)
    # under the on-disk HF names the trainer exports: transformers writes its fused in-memory
    # expert tensors back as per-expert w1/w2/w3 when saving
    with torch.no_grad():
        for prm in hf.parameters():
            prm.copy_(prm.grad if prm.grad is not None else torch.zeros_like(prm))
    hf.save_pretrained(os.path.join(tmp, "grad"))
    ref_grad = load_dir(os.path.join(tmp, "grad"))
    before = load_dir(path)

    # --- the trainer on the same weights and batch
    tr = MegatronTrainer(TrainerConfig(lr=LR, adam_eps=EPS, moe_aux_loss_coeff=0.0, clip_grad=1e9,
                                       micro_batch_size=3, off_policy_correction="tis", tis_cap=CAP), path)
    samples = [Sample(p, r, rl, [0] * len(r)) for (p, r), rl in zip(pairs, rollout)]
    tr_lp = tr.compute_logprobs(samples)
    res["logp_max_abs_diff"] = max(abs(a - b) for x, y in zip(tr_lp, hf_lp) for a, b in zip(x, y.tolist()))
    res["logp_min"] = min(min(x) for x in tr_lp)
    w0 = {n: t.clone() for n, t in tr.export_hf_weights()}
    res["weights_equal_before"] = max(float((w0[n] - before[n]).abs().max()) for n in before)
    m = tr.train_step(samples, adv)
    res["train_pg_loss"] = m["pg_loss"]
    res["train_tis_mean"] = m["tis_mean"]
    res["train_num_tokens"] = m["num_tokens"]
    # the trainer's gradient under HF names: main_grad through the same export mapping
    params = list(tr.model.parameters())
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.detach().clone().to(p.dtype)
    tr.__dict__.pop("_hf_export_plan", None)
    g_tr = {n: t.clone() for n, t in tr.export_hf_weights()}
    for p, d in zip(params, saved):
        p.data = d
    tr.__dict__.pop("_hf_export_plan", None)
    w1 = {n: t.clone() for n, t in tr.export_hf_weights()}
    names = sorted(ref_grad)
    a = torch.cat([g_tr[n].flatten().double() for n in names])
    b = torch.cat([ref_grad[n].flatten().double() for n in names])
    res["grad_cos"] = float(a @ b / (a.norm() * b.norm()))
    res["grad_norm_ratio"] = float(a.norm() / b.norm())
    res["grad_norm_ref"] = float(b.norm())
    res["train_grad_norm"] = m["grad_norm"]
    # the update against Adam's first step on the reference gradient
    d_tr = torch.cat([(w1[n] - w0[n]).flatten().double() for n in names])
    d_ref = torch.cat([(-LR * ref_grad[n] / (ref_grad[n].abs() + EPS)).flatten().double() for n in names])
    res["update_cos"] = float(d_tr @ d_ref / (d_tr.norm() * d_ref.norm()))
    res["update_norm_ratio"] = float(d_tr.norm() / d_ref.norm())
    res["update_max_abs"] = float(d_tr.abs().max())
    # the step helps: under the updated weights the loss-weighted logprob moves with the advantage
    tr_lp1 = tr.compute_logprobs(samples)
    res["adv_weighted_logp_gain"] = sum(ad * (sum(x1) - sum(x0)) for ad, x0, x1 in zip(adv, tr_lp, tr_lp1))
    tr.close()
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
