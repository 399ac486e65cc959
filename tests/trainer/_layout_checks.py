"""Layout checks for MegatronTrainer, run as ONE process per world size (parallel state and the
compat layer are process-global). Writes a JSON file of results (rank 0).

Checkpoints: tie0/tie1 = tiny Mixtral untied/tied; qwen3 = tiny Qwen3-MoE with
norm_topk_prob=True (untied), qwen3n = norm_topk_prob=False (tied); l4 = tiny Mixtral with 4
layers, tied (virtual pipeline: PP2 x VPP2 puts one layer in each model chunk; its runs use
Adam eps 1e-5 and the advantages of tests/models/_family_layouts.py, see L4_ADV); ds3 = tiny
DeepSeek-V3 (MLA, first layer dense), llama = tiny dense llama (tied): with tie0 and qwen3 the
context-parallel (``cp``) layouts, which run on :func:`long_samples` (references ``<ckpt>L``).

Modes:
    python _layout_checks.py ref TMP
        creates the tiny HF checkpoints under TMP (before Megatron is imported), runs the
        1-process reference of every checkpoint (2 steps), HF logprob parity of the qwen3_moe
        checkpoints, the C10 aux-loss checks at micro
        batch sizes 1, 2, 4, the long-sample references of the CP layouts and R3 on them
        (``r3_ref``), and writes TMP/ref.json.
    torchrun --nproc_per_node W _layout_checks.py run TMP OUT.json LAYOUT [LAYOUT ...] [c4]
        for each LAYOUT (``tp{t}pp{p}[vp{v}]ep{e}[cp{c}][do]-{checkpoint}``) builds a trainer, checks the HF export
        against the checkpoint bit-exactly, runs 2 steps (aux coeff 0), then the C10 checks,
        destroys Megatron's parallel state and goes on with the next layout in the same
        process. ``c4``: EP2 x DP2 torch_dist save, reload at EP1 and EP4 (W = 4).
        ``vppck``: (W = 2) load the 1-process l4 checkpoint at PP2 x VPP2, one step, save;
        ``vppck_load``: (W = 4) load that PP2 x VPP2 checkpoint at EP4.
        ``dock``: (W = 2) DP2 distributed-optimizer save / load / next step, refusals;
        ``dock_load``: (W = 4) load that checkpoint at DP4.
        ``cpck``: (W = 2) CP2 one step, save, next step; ``r3cp``: (W = 2) R3 at CP2.
        ``...th-{checkpoint}``: packed THD micro-batches (long samples, aux 0; references
        ``<ckpt>T``, themselves compared with the padded ``<ckpt>M``; R3 with THD: ``r3_thd``).
    python _layout_checks.py cpck_load TMP
        1 process: loads the CP2 checkpoint, next step -> TMP/cpck_load.json.

Data: 8 samples (lengths 9..13, one with loss_weight 0), advantages fixed, micro batch 2;
at DP > 1 the trainer gives each DP rank its slice. lr 1e-3, fp32, vocab padded to a
multiple of 96 x TP (so both padding directions are exercised: 288 rows at TP1, 384 at TP2).
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
# the l4 checkpoint (4 layers) and the long samples: advantages not summing to ~0 and Adam eps
# 1e-5, whose reasons tests/_checks.py gives (a near-zero loss makes its relative difference
# measure cancellation; Adam's sign-like first step with eps 1e-8 amplifies the rounding of
# ~1e-9 gradients into the second step)
from _checks import ADAM_EPS as L4_ADAM_EPS  # noqa: E402
from _checks import ADV as L4_ADV  # noqa: E402
from _checks import gather, hf_response_logprobs, main, rank, same_on_all_ranks, samples, trainer_cfg  # noqa: E402

ADV = [1.0, -0.5, 0.7, -1.2, 3.0, 0.4, -0.9, 1.5]
MBS = 2
VOCAB_DIV = 96


# context parallelism (``cp`` layouts): every family (tie0 = mixtral, qwen3 = qwen3_moe, ds3 =
# deepseek_v3 with MLA + YaRN, llama = dense llama) on LONG_SAMPLES, whose responses reach every
# one of the 2 x CP sequence chunks (the 8 samples above all end within the first 16 of the 64
# padded positions, i.e. in CP rank 0's first chunk); their 1-process references are "<ckpt>L"
CP_CKPTS = ("tie0", "qwen3", "ds3", "llama")
LONG_AUX = 0.01  # aux-loss coefficient of the long-sample runs


def adv_for(tie: str, long: bool = False) -> list[float]:
    return L4_ADV if tie == "l4" or long else ADV


def long_samples(seed: int = 1):
    """8 samples of 31..72 tokens (one with loss_weight 0): micro-batches padded to 64 and 72
    positions, responses spanning all 4 chunks of CP2 (and all 8 of CP4)."""
    return samples(seed, [(20, 40), (9, 50), (30, 30), (12, 19), (25, 47), (7, 57), (40, 22), (15, 33)], zero_at=3)


# dynamic micro-batch size ("mt" layouts, trainer.max_tokens_per_micro_batch) on the long samples,
# aux coefficient 0 (Megatron's aux loss is per micro-batch, so it changes with the cut); their
# 1-process reference "<ckpt>M" cuts by count (micro_batch_size 2). At EP2 x DP4... see test_layouts.
MT_BUDGET = 128


def cfg(tp=1, pp=1, ep=1, aux=0.0, mbs=MBS, dist_opt=False, vpp=1, tie="", cp=1, long=False, replay="off",
        max_tokens=None, packing="padded", **fields):
    extra = {"adam_eps": L4_ADAM_EPS} if tie == "l4" or long else {}
    extra.update(fields)
    return trainer_cfg(tp, pp, ep, cp=cp, vpp=vpp, dist_opt=dist_opt, mbs=mbs, aux=aux, vocab_div=VOCAB_DIV,
                       router_replay=replay, max_tokens_per_micro_batch=max_tokens, sequence_packing=packing, **extra)


def parse(layout: str):
    """``tp{t}pp{p}[vp{v}]ep{e}[cp{c}][do][mt][th]-{checkpoint}`` -> ``(tp, pp, ep, checkpoint,
    dist_opt, vpp, cp, mt, th)``; ``vp``: virtual pipeline stages per PP rank; ``cp``: context
    parallel size (runs on :func:`long_samples`); ``do``: Megatron's distributed optimizer; ``mt``:
    micro-batches cut by the token budget :data:`MT_BUDGET` (long samples, aux 0); ``th``: packed
    THD micro-batches (``trainer.sequence_packing='thd'``; long samples, aux 0)."""
    import re

    lay, tie = layout.split("-")
    m = re.fullmatch(r"tp(\d+)pp(\d+)(?:vp(\d+))?ep(\d+)(?:cp(\d+))?(do)?(mt)?(th)?", lay)
    if m is None:
        raise ValueError(f"bad layout {layout!r}")
    return (int(m[1]), int(m[2]), int(m[4]), tie, m[6] is not None, int(m[3] or 1), int(m[5] or 1),
            m[7] is not None, m[8] is not None)


def ref_key(layout: str) -> str:
    """The 1-process reference of a layout: its checkpoint, + "L" for CP layouts (long samples),
    + "M" for token-budget layouts (long samples, aux 0), + "T" for THD layouts (1-process THD)."""
    p = parse(layout)
    return layout.split("-")[1] + ("T" if p[8] else "M" if p[7] else "L" if p[6] > 1 else "")


def export_equals_disk(tr, path: str) -> bool | None:
    from safetensors.torch import load_file

    exported = dict(tr.export_hf_weights())  # collective: every rank iterates
    if rank() != 0:
        return None
    disk = load_file(os.path.join(path, "model.safetensors"))
    return set(exported) == set(disk) and all(torch.equal(exported[k], disk[k]) for k in disk)


def run_layout(tmp: str, tp: int, pp: int, ep: int, tie: str, dist_opt: bool = False, vpp: int = 1,
               cp: int = 1, mt: bool = False, th: bool = False, long: bool | None = None,
               aux: float | None = None) -> dict:
    """Export check, 2 steps, checksums, logprobs; then C10 (skipped with the distributed
    optimizer: the aux-loss path does not depend on the optimizer). ``long`` (default: CP > 1,
    token budget or THD): :func:`long_samples`, all logprobs kept, the 2 steps with aux
    coefficient :data:`LONG_AUX` (0 with a token budget or THD: Megatron's aux loss is per
    micro-batch and deepseek_v3's routers count padding, which THD and the padded path place
    differently; so the aux loss and its gradient are compared at CP) and no C10 runs. ``th``:
    packed THD micro-batches."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    long = (cp > 1 or mt or th) if long is None else long
    aux = (0.0 if mt or th else LONG_AUX if long else 0.0) if aux is None else aux
    path = os.path.join(tmp, tie)
    ss = long_samples() if long else samples()
    res: dict = {}
    t0 = time.perf_counter()
    tr = MegatronTrainer(cfg(tp, pp, ep, dist_opt=dist_opt, vpp=vpp, tie=tie, cp=cp, long=long,
                             aux=aux, max_tokens=MT_BUDGET if mt else None, packing="thd" if th else "padded"),
                         path)
    res["build_s"] = time.perf_counter() - t0
    if th:  # packed row length T per micro-batch (PP > 1: each its own, Megatron's variable_seq_lengths)
        res["thd_rows"] = [mb.thd.tokens.shape[1] for mb in tr.batcher.pack(long_samples(), None)]
    if vpp > 1:  # global layer numbers of each chunk, per rank (Megatron's interleaved assignment)
        res["chunk_layers"] = gather([[lay.layer_number for lay in m.decoder.layers] for m in tr.models])
    res["export_equals_disk"] = export_equals_disk(tr, path)
    steps = []
    if long:  # before any step: every token's logprob at the loaded weights
        res["logp_all"] = tr.compute_logprobs(ss)
        res["logp_same_on_ranks"] = same_on_all_ranks(res["logp_all"])
    for _ in range(2):
        m = tr.train_step(ss, adv_for(tie, long))
        steps.append({k: m[k] for k in ("loss", "pg_loss", "grad_norm", "num_tokens", "entropy", "step_time_s",
                                        "moe_aux_loss", "num_microbatches")})
    res["steps"] = steps
    res["checksums_agree_on_ranks"] = same_on_all_ranks(tr.hf_checksums())
    lp = tr.compute_logprobs(ss[:3])
    res["logp_first"] = [x[:3] for x in lp]
    tr.close()
    if not dist_opt and not long:
        res["c10"] = c10(path, tp, pp, ep, vpp=vpp, tie=tie)
    res["total_s"] = time.perf_counter() - t0
    return res


def c10(path: str, tp: int, pp: int, ep: int, mbs: int = MBS, vpp: int = 1, tie: str = "") -> dict:
    """Aux coefficient 0.01: reported loss - pg_loss == 0.01 x aux; with zero advantages the
    policy gradient vanishes, so the gradient is coeff x d(aux): coefficient 0.02 must give
    exactly twice the grad norm of 0.01 (the aux loss reaches the gradient, linearly, with
    the configured coefficient), coefficient 0 gives 0."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    ss = samples()
    out = {}
    for coeff in (0.01, 0.02):
        tr = MegatronTrainer(cfg(tp, pp, ep, aux=coeff, mbs=mbs, vpp=vpp, tie=tie), path)
        z = tr.train_step(ss, [0.0] * len(ss))
        m = tr.train_step(ss, adv_for(tie))
        out[str(coeff)] = {"zero_adv": {k: z[k] for k in ("loss", "pg_loss", "moe_aux_loss", "grad_norm")},
                           "adv": {k: m[k] for k in ("loss", "pg_loss", "moe_aux_loss", "grad_norm")}}
        tr.close()
    return out


def c4(tmp: str) -> dict:
    """EP2 x DP2 on 4 ranks: one step, torch_dist save; experts 0-3 of every layer saved
    exactly once (chunk metadata tiles each expert tensor once); reload at EP1 (DP4) and EP4:
    the HF checksums equal the saving run's."""
    import torch.distributed as dist

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    path = os.path.join(tmp, "tie0")
    ck = os.path.join(tmp, "c4_ckpt")
    ss = samples()
    tr = MegatronTrainer(cfg(1, 1, 2), path)
    before = tr.hf_checksums()
    tr.train_step(ss, ADV)
    ref = tr.hf_checksums()
    tr.save_checkpoint(ck)
    tr.close()
    dist.barrier()
    res: dict = {"trained_tensors_changed": sum(before[k] != ref[k] for k in ref), "n": len(ref)}
    if rank() == 0:
        from torch.distributed.checkpoint import FileSystemReader

        md = FileSystemReader(ck).read_metadata().state_dict_metadata
        experts = {}
        for key, m in md.items():
            if not (key.startswith("decoder.layers.mlp.experts.") and key.endswith(".weight")):
                continue
            cover = torch.zeros(tuple(m.size), dtype=torch.int32)
            for c in m.chunks:
                cover[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] += 1
            # axis 0 = layer, axis 1 = expert (Megatron's prepended axes)
            per_expert = [int(cover[:, e].min()) for e in range(cover.shape[1])] + \
                         [int(cover[:, e].max()) for e in range(cover.shape[1])]
            experts[key] = {"shape": list(m.size), "min_max": per_expert}
        res["saved_experts"] = experts
    for ep in (1, 4):
        tr = MegatronTrainer(cfg(1, 1, ep), path)
        tr.load_checkpoint(ck)
        got = tr.hf_checksums()
        res[f"reload_ep{ep}_equal"] = got == ref
        res[f"reload_ep{ep}_n"] = len(got)
        tr.close()
    return res


def vpp_ckpt_ref(tmp: str) -> dict:
    """1 process, l4: one step, torch_dist save (``l4_ckpt1``), then a second step; returns the
    checksums at the save and the second step's loss/grad norm (the reference for
    :func:`vpp_ckpt`)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(tie="l4"), os.path.join(tmp, "l4"))
    tr.train_step(samples(), L4_ADV)
    tr.save_checkpoint(os.path.join(tmp, "l4_ckpt1"))
    saved = tr.hf_checksums()
    m = tr.train_step(samples(), L4_ADV)
    tr.close()
    return {"saved": saved, "next": {k: m[k] for k in ("loss", "grad_norm")}}


def vpp_ckpt(tmp: str) -> dict:
    """PP2 x VPP2 (2 ranks, 2 chunks each): load the 1-process checkpoint (model + Adam state);
    its checksums, then one step (must equal the 1-process second step); then save it
    (``l4_ckpt_vpp``: per-chunk ``model0``/``model1`` state dicts) and record the checksums."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(pp=2, vpp=2, tie="l4"), os.path.join(tmp, "l4"))
    tr.load_checkpoint(os.path.join(tmp, "l4_ckpt1"))
    res = {"loaded": tr.hf_checksums(), "version": tr.version}
    m = tr.train_step(samples(), L4_ADV)
    res["next"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.save_checkpoint(os.path.join(tmp, "l4_ckpt_vpp"))
    res["saved"] = tr.hf_checksums()
    tr.close()
    return res


def vpp_ckpt_load(tmp: str) -> dict:
    """EP4 (4 ranks, one chunk each): load the PP2 x VPP2 checkpoint; its checksums."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(ep=4, tie="l4"), os.path.join(tmp, "l4"))
    tr.load_checkpoint(os.path.join(tmp, "l4_ckpt_vpp"))
    res = {"loaded": tr.hf_checksums(), "version": tr.version}
    tr.close()
    return res


def uneven_pp(tmp: str) -> dict:
    """PP2 with uneven stages (trainer.num_layers_in_last_pipeline_stage=1: layers 0-2 on the
    first stage, 3 on the last) on the 4-layer l4: the layer numbers per rank; from the HF
    weights, the export and 2 steps (equal to the 1-process "l4" reference); then the 1-process
    checkpoint ``l4_ckpt1`` loaded (checksums) and one step (equal to the 1-process second step),
    saved as ``l4_ckpt_unpp`` (loaded at 1 process by :func:`uneven_pp_load`)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    path = os.path.join(tmp, "l4")
    res: dict = {}
    tr = MegatronTrainer(cfg(pp=2, tie="l4", num_layers_in_last_pipeline_stage=1), path)
    res["stage_layers"] = gather([lay.layer_number for lay in tr.model.decoder.layers])
    res["export_equals_disk"] = export_equals_disk(tr, path)
    res["steps"] = [{k: m[k] for k in ("loss", "grad_norm", "num_tokens", "entropy")}
                    for m in (tr.train_step(samples(), L4_ADV) for _ in range(2))]
    tr.close()
    tr = MegatronTrainer(cfg(pp=2, tie="l4", num_layers_in_first_pipeline_stage=3), path)
    tr.load_checkpoint(os.path.join(tmp, "l4_ckpt1"))
    res["loaded"] = tr.hf_checksums()
    m = tr.train_step(samples(), L4_ADV)
    res["next"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.save_checkpoint(os.path.join(tmp, "l4_ckpt_unpp"))
    res["saved"] = tr.hf_checksums()
    tr.close()
    return res


def uneven_pp_load(tmp: str) -> dict:
    """1 process: the uneven PP2 checkpoint ``l4_ckpt_unpp`` loaded; its checksums."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(tie="l4"), os.path.join(tmp, "l4"))
    tr.load_checkpoint(os.path.join(tmp, "l4_ckpt_unpp"))
    res = {"loaded": tr.hf_checksums(), "version": tr.version}
    tr.close()
    return res


def _opt_state(tr) -> list:
    """This rank's optimizer state tensors (Adam exp_avg, exp_avg_sq, step, per shard param), in
    parameter-group order, as copies."""
    out = []
    for o in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                st = o.optimizer.state[p]
                out += [st[k].detach().clone() for k in sorted(st)] + [p.detach().clone()]
    return out


def dist_opt_ckpt(tmp: str) -> dict:
    """(W = 2) DP2 with the distributed optimizer (tie1): one step, save (``do_ckpt``), then a
    second step (the uninterrupted run). A fresh DP2 trainer loads it: its optimizer state
    (exp_avg, exp_avg_sq, step, main params of this rank's shard) must equal the saved one
    exactly, and its next step the uninterrupted second step. A trainer without the
    distributed optimizer and one at EP2 refuse the checkpoint (ValueError)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    path, ck = os.path.join(tmp, "tie1"), os.path.join(tmp, "do_ckpt")
    ss = samples()
    tr = MegatronTrainer(cfg(dist_opt=True), path)
    tr.train_step(ss, ADV)
    tr.save_checkpoint(ck)
    saved = _opt_state(tr)
    m = tr.train_step(ss, ADV)
    res: dict = {"next": {k: m[k] for k in ("loss", "grad_norm")}}
    tr.close()
    tr = MegatronTrainer(cfg(dist_opt=True), path)
    tr.load_checkpoint(ck)
    got = _opt_state(tr)
    same = len(got) == len(saved) > 0 and all(torch.equal(a, b) for a, b in zip(got, saved))
    box = gather((same, len(saved)))
    res["state_equal"] = all(b[0] for b in box)
    res["n_state"] = [b[1] for b in box]
    res["version"] = tr.version
    m = tr.train_step(ss, ADV)
    res["resumed"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.close()
    for name, c in (("plain_opt", cfg()), ("ep2", cfg(ep=2, dist_opt=True))):
        tr = MegatronTrainer(c, path)
        try:
            tr.load_checkpoint(ck)
            res[f"refused_{name}"] = None
        except ValueError as e:
            res[f"refused_{name}"] = str(e)
        tr.close()
    return res


def dist_opt_ckpt_load(tmp: str) -> dict:
    """(W = 4) DP4 with the distributed optimizer loads the DP2 ``do_ckpt``: its next step."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(dist_opt=True), os.path.join(tmp, "tie1"))
    tr.load_checkpoint(os.path.join(tmp, "do_ckpt"))
    res: dict = {"version": tr.version}
    m = tr.train_step(samples(), ADV)
    res["resumed"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.close()
    return res


def hf_parity(path: str) -> dict:
    """Max |logprob difference| between the 1-process trainer and transformers (fp32) on the
    8 samples, and the smallest HF logprob (the model must be far from uniform)."""
    from transformers import AutoModelForCausalLM

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    ss = samples()
    tr = MegatronTrainer(cfg(), path)
    mine = tr.compute_logprobs(ss)
    tr.close()
    ref = hf_response_logprobs(AutoModelForCausalLM.from_pretrained(path).eval(), ss)
    return {"maxdiff": max(abs(a - b) for x, y in zip(mine, ref) for a, b in zip(x, y)),
            "lens_ok": [len(x) for x in mine] == [len(s.response_ids) for s in ss],
            "ref_min": min(min(x) for x in ref)}


def load_paths(tmp: str) -> dict:
    """The full-read fallback of the HF loader: a checkpoint in transformers' in-memory
    layout (fused experts) loads and exports the on-disk tensors; a stray key is named."""
    import shutil

    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    src = os.path.join(tmp, "tie0")
    out = {}
    fused = os.path.join(tmp, "fused")
    os.makedirs(fused, exist_ok=True)
    shutil.copy(os.path.join(src, "config.json"), fused)
    sd = {k: v.detach().contiguous() for k, v in AutoModelForCausalLM.from_pretrained(src).state_dict().items()}
    out["fused_layout_differs"] = set(sd) != set(load_file(os.path.join(src, "model.safetensors")))
    save_file(sd, os.path.join(fused, "model.safetensors"))
    tr = MegatronTrainer(cfg(), fused)
    out["fused_export_equals_disk"] = export_equals_disk(tr, src)
    tr.close()
    stray = os.path.join(tmp, "stray")
    shutil.copytree(src, stray)
    st = load_file(os.path.join(stray, "model.safetensors"))
    st["model.layers.0.stray.weight"] = torch.zeros(2)
    save_file(st, os.path.join(stray, "model.safetensors"))
    try:
        MegatronTrainer(cfg(), stray)
        out["stray_error"] = None
    except KeyError as e:
        out["stray_error"] = str(e)
    return out


# ---------------------------------------------------------------- context parallelism extras
R3_DIMS = (4, 2, 2)  # tie0: experts, top-k, MoE layers


def r3_samples():
    """:func:`long_samples` with random engine routes for tie0 (distinct experts per row)."""
    import dataclasses

    from moe_async.replay.routes import compact_routes

    E, K, L = R3_DIMS
    g = torch.Generator().manual_seed(2)
    out = []
    for s in long_samples():
        n = len(s.prompt_ids) + len(s.response_ids)
        r = torch.rand(n - 1, L, E, generator=g).argsort(-1)[..., :K].numpy()
        out.append(dataclasses.replace(s, routed_experts=compact_routes(r, E)))
    return out


def r3_run(tmp: str, cp: int = 1, th: bool = False) -> dict:
    """Router replay R3 (tie0, :func:`r3_samples`), 2 steps. Forward hooks on Megatron's
    ``TopKRouter`` capture each router's routing map; every row is mapped back to (sample,
    global position) INDEPENDENTLY of the trainer (micro-batch of 2, ``[S/CP, B]`` row order,
    this CP rank's positions chunk r and 2*CP-1-r) and compared with the engine route, on
    real rows (``t < n - 1``). Per step, summed over ranks: ``agree`` (rows whose top-k set is
    the engine's), ``checked``, ``expected`` (= MoE layers x sum(n - 1)); and the step metrics.
    ``th``: packed THD micro-batches: a router row ``o`` of the packed ``[T, 1]`` order is
    sample ``b`` of the micro-batch with ``sum(n[:b]) <= o < sum(n[:b+1])``, position ``o - sum(n[:b])``."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.router import TopKRouter

    from moe_async.trainer.megatron_trainer import MegatronTrainer
    from moe_async.layout import cp_positions

    E, K, L = R3_DIMS
    ss = r3_samples()
    tr = MegatronTrainer(cfg(tie="tie0", cp=cp, long=True, replay="R3", packing="thd" if th else "padded"),
                         os.path.join(tmp, "tie0"))
    seen: dict[int, list] = {}
    hooks = []
    for m in tr.model.modules():
        if isinstance(m, TopKRouter):
            j = m.layer_number - 1  # every layer is MoE in tie0
            seen[j] = []
            hooks.append(m.register_forward_hook(lambda mod, i, o, j=j: seen[j].append(o[1].detach().clone())))
    cpr = ps.get_context_parallel_rank()
    res: dict = {"steps": [], "routes": []}
    for _ in range(2):
        for v in seen.values():
            v.clear()
        m = tr.train_step(ss, L4_ADV)
        res["steps"].append({k: m.get(k) for k in ("loss", "grad_norm", "num_tokens", "routing_agreement")})
        agree = checked = 0
        for j, calls in seen.items():
            for k, rmap in enumerate(calls):  # one call per micro-batch
                chunk = ss[k * MBS:(k + 1) * MBS]
                B = len(chunk)
                if th:  # one packed row [T, 1]: sample b at offsets start .. start + n_b - 1
                    start = 0
                    for b, s in enumerate(chunk):
                        n = len(s.prompt_ids) + len(s.response_ids)
                        for t in range(n - 1):
                            want = torch.zeros(E, dtype=torch.bool)
                            want[torch.as_tensor(s.routed_experts[t, j].astype("int64"))] = True
                            agree += int(bool((rmap[start + t] == want).all()))
                            checked += 1
                        start += n
                    continue
                S_loc = rmap.shape[0] // B
                pos = cp_positions(S_loc * cp, cp, cpr) if cp > 1 else torch.arange(S_loc)
                used = rmap.reshape(S_loc, B, E)
                for b, s in enumerate(chunk):
                    n = len(s.prompt_ids) + len(s.response_ids)
                    for i in range(S_loc):
                        t = int(pos[i])
                        if t >= n - 1:
                            continue
                        want = torch.zeros(E, dtype=torch.bool)
                        want[torch.as_tensor(s.routed_experts[t, j].astype("int64"))] = True
                        agree += int(bool((used[i, b] == want).all()))
                        checked += 1
        tot = torch.tensor([agree, checked], dtype=torch.long)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(tot)
        res["routes"].append({"agree": int(tot[0]), "checked": int(tot[1]),
                              "expected": L * sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in ss)})
    for h in hooks:
        h.remove()
    tr.close()
    return res


def cp_ckpt(tmp: str) -> dict:
    """(W = 2) CP2 (tie0, long samples): one step, torch_dist save (``cp_ckpt``), its checksums,
    then the next step (the uninterrupted run; loaded at 1 process by :func:`cp_ckpt_load`)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(tie="tie0", cp=2, long=True), os.path.join(tmp, "tie0"))
    tr.train_step(long_samples(), L4_ADV)
    tr.save_checkpoint(os.path.join(tmp, "cp_ckpt"))
    res = {"saved": tr.hf_checksums(), "version": tr.version}
    m = tr.train_step(long_samples(), L4_ADV)
    res["next"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.close()
    return res


def cp_ckpt_load(tmp: str) -> dict:
    """1 process: load the CP2 checkpoint (model + Adam state), its checksums, the next step."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(tie="tie0", long=True), os.path.join(tmp, "tie0"))
    tr.load_checkpoint(os.path.join(tmp, "cp_ckpt"))
    res = {"loaded": tr.hf_checksums(), "version": tr.version}
    m = tr.train_step(long_samples(), L4_ADV)
    res["next"] = {k: m[k] for k in ("loss", "grad_norm")}
    tr.close()
    return res


def main_ref(tmp: str) -> None:
    from _tiny import make_tiny_llama, make_tiny_mixtral, make_tiny_qwen3_moe  # before Megatron is imported
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    for tie in (0, 1):
        make_tiny_mixtral(os.path.join(tmp, f"tie{tie}"), tie=bool(tie))
    make_tiny_qwen3_moe(os.path.join(tmp, "qwen3"), tie=False, norm_topk_prob=True)
    make_tiny_qwen3_moe(os.path.join(tmp, "qwen3n"), tie=True, norm_topk_prob=False)
    make_tiny_mixtral(os.path.join(tmp, "l4"), tie=True, num_hidden_layers=4)
    make_tiny_deepseek_v3(os.path.join(tmp, "ds3"), num_hidden_layers=2)  # first dense, then MoE
    make_tiny_llama(os.path.join(tmp, "llama"), tie=True)
    res = {}
    for tie in ("tie0", "tie1", "qwen3", "qwen3n", "l4"):
        res[tie] = run_layout(tmp, 1, 1, 1, tie)
    for tie in CP_CKPTS:  # references of the context-parallel layouts
        res[f"{tie}L"] = run_layout(tmp, 1, 1, 1, tie, long=True)
    for tie in CP_CKPTS:  # "tie0M": reference of the "mt" layouts; all: the padded side of THD parity
        res[f"{tie}M"] = run_layout(tmp, 1, 1, 1, tie, long=True, aux=0.0)
    for tie in CP_CKPTS:  # packed THD at 1 process: equal to "<ckpt>M"; the reference of the "th" layouts
        res[f"{tie}T"] = run_layout(tmp, 1, 1, 1, tie, th=True)
    res["r3_ref"] = r3_run(tmp)
    res["r3_thd"] = r3_run(tmp, th=True)
    res["vpp_ckpt_ref"] = vpp_ckpt_ref(tmp)
    for name in ("qwen3", "qwen3n"):
        res[f"parity_{name}"] = hf_parity(os.path.join(tmp, name))
    res["load_paths"] = load_paths(tmp)
    res["c10_mbs"] = {str(mbs): c10(os.path.join(tmp, "tie0"), 1, 1, 1, mbs=mbs) for mbs in (1, 4)}
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(res, f)


def run_case(tmp: str, lay: str) -> dict:
    named = {"c4": c4, "vppck": vpp_ckpt, "vppck_load": vpp_ckpt_load, "dock": dist_opt_ckpt,
             "dock_load": dist_opt_ckpt_load, "cpck": cp_ckpt, "r3cp": lambda t: r3_run(t, cp=2),
             "unpp": uneven_pp}
    return named[lay](tmp) if lay in named else run_layout(tmp, *parse(lay))


def main_cpck_load(tmp: str) -> None:
    """1 process, after the 2-process launch: TMP/cpck_load.json."""
    with open(os.path.join(tmp, "cpck_load.json"), "w") as f:
        json.dump({"cpck_load": cp_ckpt_load(tmp), "unpp_load": uneven_pp_load(tmp)}, f)


if __name__ == "__main__":
    main(main_ref, run_case, cpck_load=main_cpck_load)
