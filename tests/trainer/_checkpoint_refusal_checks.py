"""Checkpoint refusals and the PP -> PP x VPP resume of MegatronTrainer, in ONE 2-process
torchrun (gloo; parallel state and the compat layer are process-global). Rank 0 writes a JSON
file of results.

    torchrun --nproc_per_node 2 _checkpoint_refusal_checks.py TMP OUT.json

Model: a tiny Mixtral with 4 layers (tied), so that PP2 x VPP2 holds one layer per model chunk.
Checkpoints written here (one optimizer step each, at PP2, DP1):

* ``do_pp2``: Megatron's distributed optimizer ('dp_reshardable');
* ``plain_pp2``: the plain optimizer.

Each refusal is tried on a trainer that has not stepped (its optimizer state is empty, so the
load allocates it first) and records the error, whether the trainer's weights (HF checksums)
and version are unchanged, and whether its optimizer state is still empty; then the same
trainer loads the good checkpoint and its next step must equal the saving run's next step.
"""

from __future__ import annotations

import json
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "models"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _checks import ADAM_EPS, ADV, finish, samples, trainer_cfg  # noqa: E402  (ADV: not summing to ~0)


def cfg(pp: int = 2, vpp: int = 1, dist_opt: bool = False):
    return trainer_cfg(pp=pp, vpp=vpp, dist_opt=dist_opt, vocab_div=64, adam_eps=ADAM_EPS)


def opt_state_empty(tr) -> bool:
    return all(len(o.optimizer.state) == 0 for o in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]))


def step(tr) -> dict:
    m = tr.train_step(samples(), ADV)
    return {k: m[k] for k in ("loss", "grad_norm")}


def save_run(model: str, ck: str, dist_opt: bool) -> dict:
    """PP2: one step, save, a second step (the uninterrupted run's next step)."""
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(cfg(dist_opt=dist_opt), model)
    step(tr)
    tr.save_checkpoint(ck, extra={"step": 1})
    res = {"next": step(tr)}
    tr.close()
    return res


def refusal(tr, ck: str) -> dict:
    """Try to load ``ck``: the error (type, message) and what changed in ``tr``."""
    before, version = tr.hf_checksums(), tr.version
    try:
        tr.load_checkpoint(ck)
        out = {"error": None}
    except (Exception, torch.distributed.checkpoint.api.CheckpointException) as e:  # noqa: BLE001 - asserted on
        # (torch's CheckpointException derives from BaseException: the raw error before the fix)
        out = {"error": str(e), "type": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__]}
    out["weights_unchanged"] = tr.hf_checksums() == before
    out["version_unchanged"] = tr.version == version
    out["opt_state_empty"] = opt_state_empty(tr)
    return out


def truncate(src: str, dst: str, pred) -> list[str]:
    """Copy checkpoint ``src`` to ``dst`` and cut every file for which ``pred(relpath)`` holds
    to half its size; returns the files cut."""
    shutil.copytree(src, dst)
    cut = []
    for root, _, files in os.walk(dst):
        for f in files:
            fp = os.path.join(root, f)
            rel = os.path.relpath(fp, dst)
            if pred(rel):
                with open(fp, "r+b") as fh:
                    fh.truncate(os.path.getsize(fp) // 2)
                cut.append(rel)
    return sorted(cut)


def damage_optimizer_items(src: str, dst: str, how: str) -> dict:
    """Copy ``src`` to ``dst`` and damage only the optimizer items of its ``.distcp`` shards
    (torch_dist's storage metadata gives each item's file, offset and length; the model items
    are left intact, so the model part still reads):

    * ``"truncate"``: cut each file right after its last model item, where optimizer items
      follow it (those are lost);
    * ``"zero"``: overwrite every optimizer item's bytes with zeros (same file sizes).

    Returns the files damaged and the number of optimizer items hit."""
    from torch.distributed.checkpoint import FileSystemReader

    shutil.copytree(src, dst)
    per_file: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for idx, info in FileSystemReader(dst).read_metadata().storage_data.items():
        kind = "opt" if ".optimizer." in f".{idx.fqn}" else "model"
        per_file.setdefault(info.relative_path, {"opt": [], "model": []})[kind].append(
            (info.offset, info.offset + info.length))
    files, hit = [], 0
    for rel, d in sorted(per_file.items()):
        fp = os.path.join(dst, rel)
        if how == "truncate":
            end = max((e for _, e in d["model"]), default=0)
            lost = [o for o, _ in d["opt"] if o >= end]
            if lost:
                with open(fp, "r+b") as fh:
                    fh.truncate(end)
                files.append(rel)
                hit += len(lost)
        else:
            with open(fp, "r+b") as fh:
                for o, e in d["opt"]:
                    fh.seek(o)
                    fh.write(bytes(e - o))
            files.append(rel)
            hit += len(d["opt"])
    return {"files": files, "optimizer_items": hit}


def main(tmp: str, out: str) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = os.path.join(tmp, "l4")
    if rank == 0:
        from _tiny import make_tiny_mixtral

        make_tiny_mixtral(model, tie=True, num_hidden_layers=4)
    dist.barrier()
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    res: dict = {}
    do_ck, plain_ck = os.path.join(tmp, "do_pp2"), os.path.join(tmp, "plain_pp2")
    if rank == 0:  # what an earlier save at 8 ranks would have left, and a file that is not ours
        os.makedirs(os.path.join(do_ck, "moe_async_rng"))
        for f in ("__7_0.distcp", os.path.join("moe_async_rng", "rank_7.pt"), "notes.txt", "moe_async_convert.json"):
            with open(os.path.join(do_ck, f), "w") as fh:
                fh.write("old")
        with open(os.path.join(do_ck, "hf_config.json"), "w") as fh:  # a converter-made deepseek_v3 checkpoint's
            json.dump({"model_type": "deepseek_v3"}, fh)
    dist.barrier()
    res["do_ref"] = save_run(model, do_ck, dist_opt=True)
    res["do_files"] = sorted(os.listdir(do_ck)) + sorted(os.listdir(os.path.join(do_ck, "moe_async_rng")))
    res["plain_ref"] = save_run(model, plain_ck, dist_opt=False)

    # damaged copies of the distributed-optimizer checkpoint (rank 0 makes them)
    bad = {n: os.path.join(tmp, n) for n in ("opt_truncated", "opt_zeroed", "no_state", "version_txt", "state_json",
                                             "rng_rank0", "shard_truncated", "common_truncated", "common_missing",
                                             "metadata_empty")}
    if rank == 0:
        res["opt_truncated_files"] = damage_optimizer_items(do_ck, bad["opt_truncated"], "truncate")
        res["opt_zeroed_files"] = damage_optimizer_items(do_ck, bad["opt_zeroed"], "zero")
        shutil.copytree(do_ck, bad["no_state"])
        os.remove(os.path.join(bad["no_state"], "moe_async_state.json"))
        truncate(do_ck, bad["version_txt"], lambda r: r == "moe_async_version.txt")
        truncate(do_ck, bad["state_json"], lambda r: r == "moe_async_state.json")
        truncate(do_ck, bad["rng_rank0"], lambda r: r == os.path.join("moe_async_rng", "rank_0.pt"))
        truncate(do_ck, bad["shard_truncated"], lambda r: r == "__1_0.distcp")
        truncate(do_ck, bad["common_truncated"], lambda r: r == "common.pt")
        shutil.copytree(do_ck, bad["common_missing"])
        os.remove(os.path.join(bad["common_missing"], "common.pt"))
        shutil.copytree(do_ck, bad["metadata_empty"])
        with open(os.path.join(bad["metadata_empty"], "metadata.json"), "w") as fh:
            fh.write("{}")
    dist.barrier()

    # one PP2 distributed-optimizer trainer that never stepped tries every damaged copy
    tr = MegatronTrainer(cfg(dist_opt=True), model)
    for name, ck in bad.items():
        res[name] = refusal(tr, ck)
    tr.load_checkpoint(do_ck)  # still usable: the good checkpoint resumes the run exactly
    res["after_refusals"] = {"version": tr.version, "next": step(tr)}
    tr.close()

    # PP2 distributed-optimizer state at PP2 x VPP2: refused (bucket-space state, no resharding)
    tr = MegatronTrainer(cfg(vpp=2, dist_opt=True), model)
    res["do_vpp"] = refusal(tr, do_ck)
    tr.close()

    # PP2 plain-optimizer checkpoint at PP2 x VPP2: state keyed by global parameter names, resharded
    tr = MegatronTrainer(cfg(vpp=2), model)
    tr.load_checkpoint(plain_ck)
    res["plain_vpp"] = {"version": tr.version, "next": step(tr)}
    tr.close()
    finish(out, res)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2])
