"""Logprobs and routed experts of the sigmoid-router MoE checks (deepseek_v3, glm4_moe), from
an HF model and from a MegatronTrainer, through forward hooks on the routers.

Imported as ``_routes`` by the check scripts of this directory (their own directory is on
``sys.path``)."""

from __future__ import annotations

import torch


def hf_logprobs_and_routes(m, ss):
    """HF logprobs of the response tokens of each sample in ``ss`` and, per sample, per MoE
    layer ``k``, ``(expert indices, weights)`` of every token (the HF gate's outputs 2 and 1)."""
    routes: list = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda mod, i, o, k=k: routes.append((k, o[2], o[1])))
             for k, layer in enumerate(m.model.layers) if hasattr(layer.mlp, "gate")]
    lps, rts = [], []
    with torch.no_grad():
        for s in ss:
            routes.clear()
            ids = s.prompt_ids + s.response_ids
            lp = m(torch.tensor([ids])).logits[0].float().log_softmax(-1)
            P = len(s.prompt_ids)
            lps.append([lp[P - 1 + j, ids[P + j]].item() for j in range(len(s.response_ids))])
            rts.append({k: (idx.clone(), w.clone()) for k, idx, w in routes})
    for h in hooks:
        h.remove()
    return lps, rts


def megatron_logprobs_and_routes(tr, ss, moe_layers: int):
    """``tr.compute_logprobs(ss)`` (``micro_batch_size=1``: one forward per sample, in order)
    and, per sample, per MoE layer ``k``, the router's ``(probs, routing map)``; ``moe_layers``:
    the model's MoE layer count."""
    routes: list = []
    hooks = [layer.mlp.router.register_forward_hook(
        lambda mod, i, o, k=k: routes.append((k, o[0].detach().clone(), o[1].clone())))
        for k, layer in enumerate(tr.model.decoder.layers) if hasattr(layer.mlp, "router")]
    mine = tr.compute_logprobs(ss)
    for h in hooks:
        h.remove()
    n = moe_layers
    return mine, [{k: (p, r) for k, p, r in routes[i * n: (i + 1) * n]} for i in range(len(ss))]
