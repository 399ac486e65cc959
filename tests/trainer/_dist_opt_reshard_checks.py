"""Distributed-optimizer checkpoints resumed at another layout, in ONE 2-process torchrun (gloo;
parallel state and the compat layer are process-global). Rank 0 writes a JSON file of results.

    torchrun --nproc_per_node 2 _dist_opt_reshard_checks.py TMP OUT.json

Model: the tiny Mixtral of tests/models/_tiny.py (2 layers, 4 experts top-2, tied), fp32.

1. Reference (uninterrupted) run at DP2 with Megatron's distributed optimizer: two steps, then
   the checkpoint is saved twice, ``full`` ('fully_reshardable',
   ``trainer.dist_ckpt_optim_fully_reshardable``) and ``dp`` ('dp_reshardable', the default),
   then two more steps (``ref``: their loss and grad norm).
2. ``full`` is loaded by a fresh trainer at each of DP2 (the saving layout), TP2, EP2 and PP2:
   the per-parameter Adam ``step`` after loading (value, and whether parameters share one
   tensor), then the state is saved again at once (``resaved_<layout>``, 'fully_reshardable':
   Megatron gathers it over DP and stores it per parameter), then two steps. The TP2 trainer
   first tries ``dp`` (refused: 'dp_reshardable' state at another TP) and must be unchanged.
3. ``dp`` is loaded at DP2 by a trainer with ``dist_ckpt_optim_fully_reshardable`` on (loading
   reads the saved format whatever the option says), saved again as ``resaved_dp``, two steps.
4. Every rank reads every checkpoint's optimizer tensors whole (Megatron's ``load_plain_tensors``,
   which assembles the TP/EP shards) and compares each resaved checkpoint's ``exp_avg``,
   ``exp_avg_sq`` and fp32 ``param`` per parameter with ``full``'s (max abs difference), and
   the step recorded in their param groups.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
# advantages not summing to ~0 and Adam eps 1e-5 (tests/_checks.py gives the reasons: a
# near-zero loss makes its relative difference measure cancellation; eps 1e-8 amplifies rounding)
from _checks import ADAM_EPS, ADV, finish, gather, samples, trainer_cfg  # noqa: E402

LAYOUTS = {"dp2": dict(), "tp2": dict(tp=2), "ep2": dict(ep=2), "pp2": dict(pp=2)}


def cfg(tp: int = 1, ep: int = 1, pp: int = 1, full: bool = True):
    return trainer_cfg(tp, pp, ep, dist_opt=True, vocab_div=64, adam_eps=ADAM_EPS,
                       dist_ckpt_optim_fully_reshardable=full)


def step(tr) -> dict:
    m = tr.train_step(samples(), ADV)
    return {k: m[k] for k in ("loss", "grad_norm")}


def adam_steps(tr) -> dict:
    """This rank's per-parameter Adam ``step`` values and whether parameters share a tensor."""
    opts = getattr(tr.optimizer, "chained_optimizers", [tr.optimizer])
    steps = [s["step"] for o in opts for s in o.optimizer.state.values()]
    return {"values": sorted({float(t) for t in steps}), "n": len(steps),
            "distinct_tensors": len({id(t) for t in steps})}


def resume(model: str, ck: str, resaved: str, try_first: str | None = None, **lay) -> dict:
    """Fresh trainer at ``lay``: [refused load of ``try_first``], load ``ck``, Adam steps,
    save again to ``resaved``, two steps."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(**lay), model)
    res: dict = {}
    if try_first is not None:
        before = tr.hf_checksums()
        try:
            tr.load_checkpoint(try_first)
            res["refused"] = None
        except Exception as e:  # noqa: BLE001 - asserted on
            res["refused"] = {"type": type(e).__name__, "error": str(e)}
        res["refused"]["unchanged"] = tr.hf_checksums() == before and tr.version == 0
    tr.load_checkpoint(ck)
    res["version"] = tr.version
    res["adam_steps"] = gather(adam_steps(tr))
    tr.save_checkpoint(resaved)
    res["next"] = [step(tr), step(tr)]
    tr.close()
    return res


def opt_tensors(path: str) -> tuple[dict[str, torch.Tensor], list]:
    """A checkpoint's optimizer tensors, whole (``optimizer.state.<kind>.<param key>``), and the
    steps in its common state's param groups."""
    from megatron.core import dist_checkpointing

    plain = dist_checkpointing.load_plain_tensors(path)
    common = dist_checkpointing.load_common_state_dict(path)
    steps = [g.get("step") for o in common["optimizer"].values() for g in o["optimizer"]["param_groups"]]
    return {k: v for k, v in plain.items() if k.startswith("optimizer.state.")}, steps


def compare(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict:
    """Per-kind max abs difference over every parameter, the key sets' equality and counts."""
    out: dict = {"same_keys": set(a) == set(b), "n_keys": len(a), "max_abs": {}}
    for k in sorted(set(a) & set(b)):
        kind = k.split(".")[2]
        d = (a[k].double() - b[k].double()).abs().max().item() if a[k].shape == b[k].shape else float("inf")
        out["max_abs"][kind] = max(out["max_abs"].get(kind, 0.0), d)
    out["kinds"] = sorted({k.split(".")[2] for k in a})
    return out


def main(tmp: str, out: str) -> None:
    import time

    import torch.distributed as dist

    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = os.path.join(tmp, "tiny")
    if rank == 0:
        from _tiny import make_tiny_mixtral

        make_tiny_mixtral(model, tie=True)
    dist.barrier()
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    ck = {n: os.path.join(tmp, n) for n in ("full", "dp")}
    res: dict = {}
    tr = MegatronTrainer(cfg(), model)
    res["first"] = [step(tr), step(tr)]
    tr.save_checkpoint(ck["full"])
    tr.cfg.dist_ckpt_optim_fully_reshardable = False
    tr.save_checkpoint(ck["dp"])
    res["ref"] = [step(tr), step(tr)]
    tr.close()

    for name, lay in LAYOUTS.items():
        res[name] = resume(model, ck["full"], os.path.join(tmp, f"resaved_{name}"),
                           try_first=ck["dp"] if name == "tp2" else None, **lay)
    res["dp_format"] = resume(model, ck["dp"], os.path.join(tmp, "resaved_dp"))

    # load_plain_tensors is collective under torch.distributed: every rank reads, rank 0 compares
    ref, res["saved_steps"] = opt_tensors(ck["full"])
    for name in [*LAYOUTS, "dp"]:
        got, steps = opt_tensors(os.path.join(tmp, f"resaved_{name}"))
        res[f"state_{name}"] = {**compare(got, ref), "steps": steps}
    res["seconds"] = time.perf_counter() - t0  # written by rank 0
    finish(out, res)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
