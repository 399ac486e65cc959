"""A distillation step with the top-k forward KL term: the Megatron trainer against a plain-PyTorch
step on the same Hugging Face model and batch, and the trainer at TP2 (sequence parallel) and CP2
against itself at 1 process. Writes a JSON dict (1 process: TMP/ref.json; torchrun: OUT).

Reference (written here from the formulas, not from moe_async):
    A_t  = -(logp_rollout_t - logp_teacher_t)                      per-token reverse-KL advantage
    w_t  = min(exp(logp_t - rollout_logp_t), C)                    token TIS, detached, C = tis_cap
    KL_t = sum_{j in topk_t} p_T(j) (log p_T(j) - log_softmax(z_t)[j])     teacher top-k, not renormalised
    L    = (1/N) sum_i sum_{t in resp_i} w_t (-A_t exp(logp_t - sg(logp_t)) + c KL_t)
The teacher is another tiny model (its top-k from its fp32 log-softmax); rollout logprobs are the
student's own, perturbed; one sample has no teacher top-k (its KL term is absent).

Modes:
    python _topk_reference_checks.py ref TMP        (1 process; TMP/ref.json, TMP/g1: its gradient)
    torchrun --nproc_per_node 2 _topk_reference_checks.py run TMP OUT tp2 cp2
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, os.path.join(HERE, "..", "trainer"))
sys.path.insert(0, os.path.join(HERE, ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402

CAP, COEF, K = 2.0, 0.5, 6
# (prompt, response) lengths: responses reach every one of CP2's 4 sequence chunks (padded to 64/72)
LENS = [(20, 40), (9, 50), (30, 30), (12, 19), (25, 47), (7, 57)]
NO_TOPK = 3  # this sample's teacher returned no top-k


def pairs(seed: int = 2) -> list[tuple[list[int], list[int]]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for p, r in LENS:
        ids = torch.randint(3, 256, (p + r,), generator=g).tolist()
        out.append((ids[:p], ids[p:]))
    return out


def build_inputs(tmp: str):
    """``(student path, samples, advantages, reference data)``; the checkpoints are made once."""
    from _reference_checks import hf_token_logp
    from _tiny import make_tiny_mixtral
    from transformers import MixtralForCausalLM

    from moe_async.distill.advantages import distill_advantages
    from moe_async.types import Group, Sample

    path, tpath = os.path.join(tmp, "m"), os.path.join(tmp, "t")
    if not os.path.exists(os.path.join(path, "config.json")):
        make_tiny_mixtral(path, seed=5, max_position_embeddings=256)
        make_tiny_mixtral(tpath, seed=9, max_position_embeddings=256)
    teacher = MixtralForCausalLM.from_pretrained(tpath).float().eval()
    hf = MixtralForCausalLM.from_pretrained(path).float().eval()
    gen = torch.Generator().manual_seed(1)
    samples = []
    for i, (p, r) in enumerate(pairs()):
        with torch.no_grad():
            t_all = teacher(torch.tensor([p + r])).logits[0].float().log_softmax(-1)[len(p) - 1: len(p) - 1 + len(r)]
            s_lp = hf_token_logp(hf, p, r)
        t_lp = t_all.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1).tolist()
        v, ix = torch.topk(t_all, K)
        rl = (s_lp + 0.6 * (torch.rand(s_lp.shape, generator=gen) - 0.5)).tolist()
        s = Sample(p, r, rl, [0] * len(r), teacher_logprobs=t_lp)
        if i != NO_TOPK:
            s.teacher_topk_ids, s.teacher_topk_logprobs = ix.numpy().astype(np.int64), v.numpy().astype(np.float32)
        samples.append(s)
    adv = distill_advantages([Group(0, samples)], kl_coef=1.0, reward_coef=0.0)
    return path, samples, adv


def reference(path: str, samples, adv, dtype) -> tuple[float, float, dict]:
    """``(loss, mean KL per top-k token, gradient under HF names)`` of the module formula."""
    from _reference_checks import load_dir
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(path, experts_implementation="eager").to(dtype)
    hf.zero_grad()
    N = sum(len(s.response_ids) for s in samples)
    loss, kl_sum, kl_n = 0.0, 0.0, 0
    for s, a in zip(samples, adv):
        p, r = s.prompt_ids, s.response_ids
        lp_all = hf(torch.tensor([p + r])).logits[0].to(dtype).log_softmax(-1)[len(p) - 1: len(p) - 1 + len(r)]
        lp = lp_all.gather(-1, torch.tensor(r).unsqueeze(-1)).squeeze(-1)
        w = torch.clamp(torch.exp(lp.detach() - torch.tensor(s.rollout_logprobs, dtype=dtype)), max=CAP)
        term = -torch.tensor(a, dtype=dtype) * torch.exp(lp - lp.detach())
        if s.teacher_topk_ids is not None:
            t = torch.from_numpy(s.teacher_topk_logprobs).to(dtype)
            kl = (t.exp() * (t - lp_all.gather(-1, torch.from_numpy(s.teacher_topk_ids)))).sum(-1)
            term = term + COEF * kl
            kl_sum, kl_n = kl_sum + float(kl.detach().sum()), kl_n + len(r)
        loss = loss + (w * term).sum()
    (loss / N).backward()
    with torch.no_grad():  # the gradient under the checkpoint's names: saved as if it were the weights
        for prm in hf.parameters():
            prm.copy_(prm.grad if prm.grad is not None else torch.zeros_like(prm))
    out = os.path.join(os.path.dirname(path), f"grad_{str(dtype).split('.')[-1]}")
    hf.save_pretrained(out)
    return float(loss / N), kl_sum / kl_n, load_dir(out)


def trainer_step(path: str, samples, adv, **layout) -> tuple[dict, dict | None]:
    """One trainer step with the top-k term: ``(metrics, gradient under HF names on rank 0)``."""
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(TrainerConfig(lr=1e-3, moe_aux_loss_coeff=0.0, clip_grad=1e9, micro_batch_size=2,
                                       off_policy_correction="tis", tis_cap=CAP, **layout), path)
    m = tr.train_step(samples, adv, topk_kl_coef=COEF)
    params = [p for mdl in tr.models for p in mdl.parameters()]
    saved = [p.data for p in params]
    for p in params:
        p.data = p.main_grad.detach().clone().to(p.dtype)
    tr.__dict__.pop("_hf_export_plan", None)
    g = {n: t.clone() for n, t in tr.export_hf_weights()}  # collective; rank 0 gets the tensors
    for p, d in zip(params, saved):
        p.data = d
    tr.close()
    keep = ("loss", "pg_loss", "topk_kl_loss", "topk_forward_kl", "topk_tokens", "grad_norm", "num_tokens")
    return {k: float(m[k]) for k in keep}, (g or None)


def compare(a: dict, b: dict) -> dict:
    names = sorted(b)
    x = torch.cat([a[n].flatten().double() for n in names])
    y = torch.cat([b[n].flatten().double() for n in names])
    return {"max_abs_diff": float((x - y).abs().max()), "abs_max": float(y.abs().max()),
            "rel_l2": float((x - y).norm() / y.norm())}


def main_ref(tmp: str) -> None:
    from safetensors.torch import save_file

    torch.set_num_threads(1)
    path, samples, adv = build_inputs(tmp)
    res: dict = {}
    res["ref_loss"], res["ref_kl"], g32 = reference(path, samples, adv, torch.float32)
    res["ref64_loss"], res["ref64_kl"], g64 = reference(path, samples, adv, torch.float64)
    res["ref_topk_tokens"] = sum(len(s.response_ids) for s in samples if s.teacher_topk_ids is not None)
    m, g1 = trainer_step(path, samples, adv)
    assert g1 is not None
    res["train"] = m
    res["grad_vs_ref32"] = compare(g1, g32)
    res["grad_vs_ref64"] = compare(g1, g64)
    res["ref32_vs_ref64"] = compare(g32, g64)
    save_file({k: v.contiguous() for k, v in g1.items()}, os.path.join(tmp, "g1.safetensors"))
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(res, f)


def main_run(tmp: str, out: str, cases: list[str]) -> None:
    import torch.distributed as dist
    from _checks import finish, rank
    from safetensors.torch import load_file

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    path, samples, adv = build_inputs(tmp)  # the checkpoints exist (ref ran first)
    g1 = load_file(os.path.join(tmp, "g1.safetensors"))
    res: dict = {}
    layouts = {"tp2": dict(tensor_model_parallel_size=2), "cp2": dict(context_parallel_size=2)}
    for case in cases:
        m, g = trainer_step(path, samples, adv, **layouts[case])
        res[case] = {"train": m, "grad_vs_tp1": compare(g, g1) if rank() == 0 and g else None}
        dist.barrier()
    finish(out, res)


if __name__ == "__main__":
    if sys.argv[1] == "ref":
        main_ref(sys.argv[2])
    else:
        main_run(sys.argv[2], sys.argv[3], sys.argv[4:])
