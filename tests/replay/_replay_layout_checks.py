"""Router replay (R3) at multi-process layouts (gloo, CPU). Writes a JSON file of results.

Modes:
    python _replay_layout_checks.py ref TMP
        creates the tiny Mixtral checkpoints TMP/a (the trainer, seed 0) and TMP/b (the
        "engine", seed 1: another router, so its routes disagree with the trainer's own
        choice), the 8 samples with engine routes (TMP/samples_a.pkl), a tiny DeepSeek-V3
        TMP/ds (4 layers, the first dense) with the same tokens and random routes
        (TMP/samples_ds.pkl), and runs the 1-process references: Mixtral R3 at micro-batch
        sizes 1, 2, 4 and ``off`` at 2, DeepSeek R3 and ``off`` at 2 (2 steps each) -> TMP/ref.json.
    torchrun --nproc_per_node 2 _replay_layout_checks.py run TMP OUT.json LAYOUT [LAYOUT ...]
        for each LAYOUT ``tp{t}pp{p}ep{e}[vpp{v}][-MODEL[-MODE]]`` (MODEL a | ds, MODE R3 | off; vpp: v
        virtual pipeline stages, model chunks per PP rank): the trainer, 2 steps on the same samples, the
        routers' actual top-k sets captured on every rank (forward hooks on Megatron's
        ``TopKRouter``: its routing map) and gathered to rank 0, which maps every router row
        back to (sample, token) INDEPENDENTLY of the replay hook (DP slice, micro-batch,
        ``[S, B]`` order, sequence-parallel chunk of the TP rank, global MoE-layer index of
        the router) and compares it with the supplied routes; then Megatron's parallel state
        is destroyed and the next layout runs in the same process.

Data: 8 samples (lengths 9..13, sample 4 with loss_weight 0), micro batch 2, fixed
advantages, lr 1e-3, fp32, aux-loss coefficient 0 (the aux loss sees padding rows, whose
number depends on the layout's padding), so loss and grad norm must equal 1 process.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from _checks import gather, main, rank, trainer_cfg  # noqa: E402

# model -> (experts, top-k, MoE layers): "a" tiny Mixtral (2 MoE layers), "ds" tiny
# DeepSeek-V3 with 4 layers, the first dense (MoE layers = decoder layers 2..4, group-limited
# sigmoid routing with expert bias), routes drawn at random (distinct experts per row)
DIMS = {"a": (4, 2, 2), "ds": (8, 4, 3)}
ADV = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]
LENS = [(5, 7), (3, 6), (8, 4), (4, 9), (6, 5), (7, 6), (2, 8), (5, 5)]
MBS = 2
STEPS = 2
KEYS = ("loss", "pg_loss", "grad_norm", "num_tokens", "entropy", "routing_agreement",
        "routing_agreement_l0", "routing_agreement_l1", "routing_agreement_l2", "mismatch_logp_absdiff_mean",
        "mismatch_logp_absdiff_max", "mismatch_kl_k3", "mismatch_num_tokens", "step_time_s")


def make_samples(tmp: str) -> None:
    """Checkpoints a/b and the samples, routes from b's HF gates (``tokens - 1`` rows);
    checkpoint ds and its samples (same tokens, random routes)."""
    from _tiny import make_tiny_mixtral
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3
    from transformers import MixtralForCausalLM

    from moe_async.replay.routes import compact_routes
    from moe_async.types import Sample

    make_tiny_mixtral(os.path.join(tmp, "a"), seed=0)
    make_tiny_deepseek_v3(os.path.join(tmp, "ds"), num_hidden_layers=4)
    E, K, _ = DIMS["a"]
    other = MixtralForCausalLM.from_pretrained(make_tiny_mixtral(os.path.join(tmp, "b"), seed=1)).eval()
    g = torch.Generator().manual_seed(0)
    out = []
    for i, (p, r) in enumerate(LENS):
        ids = torch.randint(3, 256, (p + r,), generator=g).tolist()
        rl = (-torch.rand(r, generator=g) * 6).tolist()
        got = []
        hooks = [lay.mlp.gate.register_forward_hook(lambda m, a, o: got.append(o[2].clone()))
                 for lay in other.model.layers]
        with torch.no_grad():
            other(torch.tensor([ids[:-1]]))
        for h in hooks:
            h.remove()
        routes = torch.stack([x.reshape(len(ids) - 1, K) for x in got], dim=1).numpy()  # [T-1, L, K]
        out.append(Sample(prompt_ids=ids[:p], response_ids=ids[p:], rollout_logprobs=rl, weight_versions=[0] * r,
                          routed_experts=compact_routes(routes, E), loss_weight=0.0 if i == 4 else 1.0))
    with open(os.path.join(tmp, "samples_a.pkl"), "wb") as f:
        pickle.dump(out, f)
    E, K, L = DIMS["ds"]
    ds = []
    for s in out:
        n = len(s.prompt_ids) + len(s.response_ids)
        r = torch.rand(n - 1, L, E, generator=g).argsort(-1)[..., :K].numpy()
        ds.append(dataclasses.replace(s, routed_experts=compact_routes(r, E)))
    with open(os.path.join(tmp, "samples_ds.pkl"), "wb") as f:
        pickle.dump(ds, f)


def load_samples(tmp: str, model: str):
    with open(os.path.join(tmp, f"samples_{model}.pkl"), "rb") as f:
        return pickle.load(f)


def capture(tr) -> tuple[dict, list]:
    """Forward hooks on every local ``TopKRouter``: ``{global moe index: [routing_map [N, E]
    bool per forward]}``. The index is the router's global layer number (dense layers: none
    here), read from Megatron, not from the replay hook."""
    from megatron.core.transformer.moe.router import TopKRouter

    n, f = tr.tf_config.num_layers, tr.tf_config.moe_layer_freq
    pattern = [1 if i % f == 0 else 0 for i in range(n)] if isinstance(f, int) else list(f)
    seen: dict[int, list] = {}
    hooks = []
    for m in (x for chunk in tr.models for x in chunk.modules()):  # every model chunk (VPP)
        if isinstance(m, TopKRouter):
            j = sum(pattern[: m.layer_number - 1])  # MoE layers before this one (dense skipped)
            seen[j] = []
            hooks.append(m.register_forward_hook(lambda mod, i, o, j=j: seen[j].append(o[1].detach().cpu().numpy())))
    return seen, hooks


def my_layout(tr) -> dict:
    from megatron.core import parallel_state as ps

    return dict(dp=ps.get_data_parallel_world_size(), dp_rank=ps.get_data_parallel_rank(),
                tp=ps.get_tensor_model_parallel_world_size(), tp_rank=ps.get_tensor_model_parallel_rank(),
                sp=bool(tr.tf_config.sequence_parallel))


def check_routes(entries: list[dict], ss, mbs: int, model: str) -> dict:
    """Every rank's captured routing maps of ONE train step -> (sample, token) rows; compare
    with the supplied routes on real tokens (rows ``< n - 1``). Returns agree / checked /
    expected counts and the number of real rows checked more or less than once."""
    E, K, L = DIMS[model]
    seen_count = {}
    agree = checked = 0
    for e in entries:
        per = -(-len(ss) // e["dp"])
        local = ss[e["dp_rank"] * per : (e["dp_rank"] + 1) * per]
        for j, calls in e["maps"].items():
            j = int(j)
            for k, rmap in enumerate(calls):
                chunk = list(range(e["dp_rank"] * per + k * mbs, e["dp_rank"] * per + min((k + 1) * mbs, len(local))))
                B = len(chunk)
                N = rmap.shape[0]
                S_loc = N // B
                assert S_loc * B == N, (N, B)
                off = e["tp_rank"] * S_loc if e["sp"] else 0
                used = rmap.reshape(S_loc, B, E)
                for b, gi in enumerate(chunk):
                    s = ss[gi]
                    n = len(s.prompt_ids) + len(s.response_ids)
                    for i in range(S_loc):
                        t = off + i
                        if t >= n - 1:
                            continue
                        if e["tp_rank"] and not e["sp"]:
                            continue  # TP without SP: every TP rank routes all rows; count rank 0
                        want = np.zeros(E, dtype=bool)
                        want[s.routed_experts[t, j].astype(np.int64)] = True
                        agree += int((used[i, b] == want).all() and used[i, b].sum() == K)
                        checked += 1
                        seen_count[(gi, t, j)] = seen_count.get((gi, t, j), 0) + 1
    expected = L * sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in ss)
    return dict(agree=agree, checked=checked, expected=expected,
                not_once=sum(1 for v in seen_count.values() if v != 1) + (expected - len(seen_count)))


def maps_sha1(entries: list[dict]) -> dict | None:
    """``{global MoE layer: sha1 of its routing maps [N, E] over the step's micro-batches}``,
    padding rows included (their routes come from the hook's padding rotation), for layouts
    whose router rows are those of 1 process (DP1, TP1); None otherwise."""
    import hashlib

    if any(e["dp"] > 1 or e["tp"] > 1 for e in entries):
        return None
    return {str(j): hashlib.sha1(b"".join(np.ascontiguousarray(m).tobytes() for m in calls)).hexdigest()
            for e in entries for j, calls in e["maps"].items()}


def run_trainer(tmp: str, ss, mode: str, tp=1, pp=1, ep=1, mbs=MBS, model="a", vpp=None) -> dict:
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    t0 = time.perf_counter()
    tr = MegatronTrainer(trainer_cfg(tp, pp, ep, vpp=vpp, mbs=mbs, vocab_div=None, router_replay=mode),
                         os.path.join(tmp, model))
    res: dict = {"build_s": time.perf_counter() - t0, "steps": [], "routes": []}
    seen, hooks = capture(tr)
    for _ in range(STEPS):
        for v in seen.values():
            v.clear()
        m = tr.train_step(ss, ADV)
        res["steps"].append({k: m.get(k) for k in KEYS})
        mine = dict(my_layout(tr), maps={j: list(v) for j, v in seen.items()})
        box = gather(mine)
        if rank() == 0:
            res["routes"].append(check_routes(box, ss, mbs, model))
            res.setdefault("maps_sha1", []).append(maps_sha1(box))
    for h in hooks:
        h.remove()
    res["clean"] = all(r.target_topk_idx is None and not r.replay_backward_list and r.router_replay_action is None
                       for r in tr.router_replay.routers)
    lp = tr.compute_logprobs(ss[:3])  # R3 in a forward-only pass (engine routes replayed)
    res["logp_first"] = [x[:3] for x in lp]
    tr.close()
    res["total_s"] = time.perf_counter() - t0
    return res


def main_ref(tmp: str) -> None:
    make_samples(tmp)
    ss = load_samples(tmp, "a")
    res = {f"R3_mbs{m}": run_trainer(tmp, ss, "R3", mbs=m) for m in (1, 2, 4)}
    res["off_mbs2"] = run_trainer(tmp, ss, "off")
    ds = load_samples(tmp, "ds")
    res["ds_R3_mbs2"] = run_trainer(tmp, ds, "R3", model="ds")
    res["ds_off_mbs2"] = run_trainer(tmp, ds, "off", model="ds")
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(res, f)


def run_layout(tmp: str, lay: str) -> dict:
    par, model, mode = (lay.split("-") + ["a", "R3"][lay.count("-"):])[:3]
    par, _, vpp = par.partition("vpp")
    tp = int(par.split("tp")[1].split("pp")[0])
    pp = int(par.split("pp")[1].split("ep")[0])
    ep = int(par.split("ep")[1])
    return run_trainer(tmp, load_samples(tmp, model), mode, tp, pp, ep, model=model, vpp=int(vpp) if vpp else None)


if __name__ == "__main__":
    main(main_ref, run_layout)
