"""Router replay in MegatronTrainer on 1 CPU process, in ONE fresh process (Megatron parallel
state is process-global). Prints a JSON dict of results on the last line.

The "engine" routes come from a DIFFERENT random Mixtral (another router), so they disagree
with the trainer's own choice: without replay the check below would fail."""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _tiny import make_tiny_mixtral  # noqa: E402

from moe_async.replay.routes import compact_routes  # noqa: E402
from moe_async.trainer.config import TrainerConfig  # noqa: E402
from moe_async.trainer.megatron_trainer import MegatronTrainer  # noqa: E402
from moe_async.types import Sample  # noqa: E402

E, K = 4, 2


def hf_routes(model, ids: list[int]) -> np.ndarray:
    got = []
    hooks = [l.mlp.gate.register_forward_hook(lambda m, i, o: got.append(o[2].clone())) for l in model.model.layers]
    with torch.no_grad():
        model(torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(got, dim=1)[0].numpy() if got[0].dim() == 3 else torch.stack(got, dim=1).numpy()


def samples(other) -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate([(5, 7), (3, 6), (8, 4), (4, 9), (6, 5)]):
        ids = torch.randint(3, 256, (p + r,), generator=g).tolist()
        rl = (-torch.rand(r, generator=g) * 6).tolist()
        routes = compact_routes(hf_routes(other, ids[:-1]), E)  # engine: tokens - 1 rows
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=rl,
                          weight_versions=[0] * r, routed_experts=routes,
                          loss_weight=0.0 if i == 4 else 1.0))
    return out


def run(mode: str, path: str, ss: list[Sample], mbs: int = 2) -> dict:
    from megatron.core.transformer.moe.router import TopKRouter

    tr = MegatronTrainer(TrainerConfig(micro_batch_size=mbs, moe_aux_loss_coeff=0.01, lr=1e-3,
                                       router_replay=mode), path)
    routers = [m for m in tr.model.modules() if isinstance(m, TopKRouter)]
    seen: list[list[tuple]] = [[] for _ in routers]
    hooks = [r.register_forward_hook(lambda m, i, o, j=j: seen[j].append((i[0].detach(), o[0].detach(), o[1].detach())))
             for j, r in enumerate(routers)]
    w0 = [r.weight.detach().clone() for r in routers]
    m = tr.train_step(ss, [1.0, -0.5, 0.7, -1.2, 3.0])
    for h in hooks:
        h.remove()
    res = {"metrics": m, "n_routers": len(routers)}
    # compare the routers' actual top-k sets with the supplied routes, micro-batch by micro-batch
    agree = total = 0
    pad_ok = True
    gate_err = 0.0
    per_expert = torch.zeros(len(routers), E, dtype=torch.long)
    fwd = seen[0][-len(range(0, len(ss), mbs)):]  # train-step forwards (R2 records first)
    nmb = len(fwd)
    for j, r in enumerate(routers):
        calls = seen[j][-nmb:]
        for k, (hid, probs, rmap) in enumerate(calls):
            chunk = ss[k * mbs : (k + 1) * mbs]
            S, B = hid.shape[0], hid.shape[1]
            used = rmap.reshape(S, B, E).transpose(0, 1)  # [B, S, E] bool
            pr = probs.reshape(S, B, E).transpose(0, 1)
            logits = (hid.reshape(-1, hid.shape[-1]) @ w0[j].T).reshape(S, B, E).transpose(0, 1)
            for b, s in enumerate(chunk):
                n = len(s.prompt_ids) + len(s.response_ids)
                ref = torch.zeros(n - 1, E, dtype=torch.bool)
                ref.scatter_(1, torch.from_numpy(s.routed_experts[:, j].astype(np.int64)), True)
                agree += int((used[b, : n - 1] == ref).all(-1).sum())
                total += n - 1
                pads = used[b, n - 1 :]
                pad_ok &= bool((pads.sum(-1) == K).all())
                per_expert[j] += pads.sum(0)
                # gate weights = softmax over the chosen experts of the trainer's own logits
                sel = used[b, : n - 1]
                lg = logits[b, : n - 1].masked_fill(~sel, float("-inf"))
                gate_err = max(gate_err, float((torch.softmax(lg, -1).masked_fill(~sel, 0) - pr[b, : n - 1]).abs().max()))
    res.update(agree=agree, total=total, pad_ok=pad_ok, pad_counts=per_expert.tolist(), gate_err=gate_err,
               router_moved=min(float((r.weight.detach() - w).abs().max()) for r, w in zip(routers, w0)),
               replay_instances_clean=all(r.router_replay.target_topk_idx is None and not r.router_replay.replay_backward_list
                                          and r.router_replay.router_replay_action is None for r in routers))
    return res


def main(tmp: str) -> None:
    from transformers import MixtralForCausalLM

    path = make_tiny_mixtral(os.path.join(tmp, "a"), seed=0)
    other = MixtralForCausalLM.from_pretrained(make_tiny_mixtral(os.path.join(tmp, "b"), seed=1)).eval()
    ss = samples(other)
    res = {m: run(m, path, ss) for m in ("off", "R3", "R2")}
    # R3 with no routes on a loss-bearing sample: clear error
    bad = [Sample(prompt_ids=s.prompt_ids, response_ids=s.response_ids, rollout_logprobs=s.rollout_logprobs,
                  weight_versions=s.weight_versions) for s in ss]
    tr = MegatronTrainer(TrainerConfig(micro_batch_size=2, lr=1e-3, router_replay="R3"), path)
    try:
        tr.train_step(bad, [1.0] * 5)
        res["missing_err"] = ""
    except ValueError as e:
        res["missing_err"] = str(e)
    print(json.dumps(res))


if __name__ == "__main__":
    main(sys.argv[1])
