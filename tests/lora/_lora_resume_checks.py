"""LoRA checkpoint and resume in ONE process per layout; rank 0 prints a JSON dict on the last
line and writes it to TMP/res_resume_<layout>.json.

    python _lora_resume_checks.py TMP                  1 process (TP1; also the refusals)
    torchrun --nproc_per_node 2 _lora_resume_checks.py TMP tp2   TP2 (TP-split adapter factors)
    ... TMP tp2 llama        a dense Llama (the gated fc1's B sharded as Megatron's swiglu weight)
    ... TMP tp1 mixtral_shared    one routed-expert adapter per layer (``experts: shared``)
    python _lora_resume_checks.py TMP tp1load llama    load the TP2 checkpoint at TP1: the export
                                                       equals the TP2 trainer's at the save

A LoRA trainer (tiny Mixtral, q/k/v/o + per-expert adapters, rank 4) steps once, saves, and steps
again ("straight"); a second trainer loads the checkpoint and steps again ("resumed"). Compared
bit for bit per rank: the adapter tensors and the Adam state after the load vs at the save, the
adapters and Adam state after the step from the resume vs the straight one; the version. The
checkpoint's tensor keys (adapters and their optimizer state only) and the global shapes of the
TP-split factors; the refusals of another base, another rank, a trainer without LoRA.
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(__file__)
sys.path.insert(0, os.path.join(HERE, "..", "models"))
sys.path.insert(0, os.path.join(HERE, ".."))

import torch  # noqa: E402
from _checks import samples  # noqa: E402
from _tiny import make_tiny_llama, make_tiny_mixtral  # noqa: E402

LENS = [(5, 7), (3, 6), (8, 4), (4, 9)]
ADV = [1.0, -0.5, 0.7, -1.2]


def _adapters(tr) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for m in tr.models for n, p in m.named_parameters() if p.requires_grad}


def _adam(tr) -> dict[str, torch.Tensor]:
    names = {id(p): n for m in tr.models for n, p in m.named_parameters()}
    out = {}
    for o in getattr(tr.optimizer, "chained_optimizers", [tr.optimizer]):
        for g in o.optimizer.param_groups:
            for p in g["params"]:
                for k, v in o.optimizer.state.get(p, {}).items():
                    out[f"{names[id(p)]}/{k}"] = torch.as_tensor(v).detach().clone()
    return out


def _equal(a: dict, b: dict) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main(tmp: str, layout: str, model: str = "mixtral") -> None:
    import torch.distributed as dist

    from moe_async.lora.config import LoraConfig
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    sizes = {"tp1": {}, "tp1load": {}, "tp2": dict(tensor_model_parallel_size=2)}[layout]
    rank = int(os.environ.get("RANK", "0"))
    torch.set_num_threads(1)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("gloo")
    path = os.path.join(tmp, "mix" if model.startswith("mixtral") else model)
    if rank == 0 and not os.path.exists(os.path.join(path, "config.json")):
        (make_tiny_mixtral if model.startswith("mixtral") else make_tiny_llama)(path, tie=False)
    if dist.is_initialized():
        dist.barrier()
    lcfg = LoraConfig(rank=4, alpha=8.0, experts="shared" if model == "mixtral_shared" else "per_expert")
    cfg = TrainerConfig(micro_batch_size=2, moe_aux_loss_coeff=0.0, lr=1e-2, clip_grad=1e9, lora=lcfg, **sizes)
    b1, b2 = samples(0, LENS), samples(1, LENS)
    suffix = "" if model == "mixtral" else f"_{model}"
    res: dict = {}
    if layout == "tp1load":  # the TP2 checkpoint at TP1: the adapters resharded, not only round-tripped
        tr = MegatronTrainer(cfg, path)
        tr.load_checkpoint(os.path.join(tmp, f"ckpt_tp2{suffix}"))
        got, want = tr.export_lora(), torch.load(os.path.join(tmp, f"export_tp2{suffix}.pt"))
        res["cross_export_equal"] = _equal(got, want)
        res["n_tensors"] = len(want)
        tr.close()
        print(json.dumps(res))
        return
    ckpt = os.path.join(tmp, f"ckpt_{layout}{suffix}")

    tr = MegatronTrainer(cfg, path)
    tr.train_step(b1, ADV)
    tr.save_checkpoint(ckpt, {"step": 1})
    exported = tr.export_lora()  # the PEFT tensors at the save (whole: every rank's pieces)
    if rank == 0:
        torch.save(exported, os.path.join(tmp, f"export_{layout}{suffix}.pt"))
    saved_ad, saved_adam = _adapters(tr), _adam(tr)
    res["straight_metrics"] = tr.train_step(b2, ADV)["loss"]
    straight_ad, straight_adam = _adapters(tr), _adam(tr)
    tr.close()

    tr = MegatronTrainer(cfg, path)
    extra = tr.load_checkpoint(ckpt)
    res["extra"], res["version_loaded"] = extra, tr.version
    res["adapters_equal"] = _equal(_adapters(tr), saved_ad)
    res["adam_equal"] = _equal(_adam(tr), saved_adam)
    res["n_adam"] = len(saved_adam)
    res["resumed_metrics"] = tr.train_step(b2, ADV)["loss"]
    res["version_after"] = tr.version
    res["step_adapters_equal"] = _equal(_adapters(tr), straight_ad)
    res["step_adam_equal"] = _equal(_adam(tr), straight_adam)
    ok = [res["adapters_equal"], res["adam_equal"], res["step_adapters_equal"], res["step_adam_equal"]]
    if dist.is_initialized():  # every rank's own pieces
        every: list = [None] * dist.get_world_size()
        dist.all_gather_object(every, ok)
        ok = [all(x[i] for x in every) for i in range(len(ok))]
        res["adapters_equal"], res["adam_equal"], res["step_adapters_equal"], res["step_adam_equal"] = ok
    tr.close()

    if rank == 0:
        from moe_async.megatron.dist_ckpt_files import is_optimizer_key, read_torch_dist_metadata

        md = read_torch_dist_metadata(ckpt).state_dict_metadata
        tensors = {k: tuple(v.size) for k, v in md.items() if hasattr(v, "size")}
        res["model_keys"] = sorted(k for k in tensors if not is_optimizer_key(k))
        res["non_adapter_keys"] = [k for k in tensors if ".lora." not in k]
        res["qkv_B_shape"] = tensors.get("decoder.layers.self_attention.linear_qkv.lora.B")  # [L, out, r]
        res["proj_A_shape"] = tensors.get("decoder.layers.self_attention.linear_proj.lora.A")  # [L, r, in]
        res["fc1_B_shape"] = tensors.get("decoder.layers.mlp.linear_fc1.lora.B")  # dense: [L, 2I, r]
        with open(os.path.join(ckpt, "moe_async_state.json")) as f:
            res["record"] = json.load(f)["lora"]
    if model == "mixtral":
        res["refusals"] = _refusals(tmp, path, ckpt, cfg)
    if rank == 0:
        with open(os.path.join(tmp, f"res_resume_{layout}{suffix}.json"), "w") as f:
            json.dump(res, f)
        print(json.dumps(res))


def _refusals(tmp: str, path: str, ckpt: str, cfg) -> dict[str, str]:
    """The error texts of loading the checkpoint into a trainer on another base, with another
    rank, and without LoRA (each must leave nothing half-loaded: the trainer is closed)."""
    from safetensors.torch import load_file, save_file

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    import torch.distributed as dist

    other = os.path.join(tmp, "mix_other")
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.exists(other):
        import shutil

        shutil.copytree(path, other)
        f = os.path.join(other, "model.safetensors")
        sd = load_file(f)
        k = sorted(sd)[0]
        sd[k] = sd[k] + 1.0  # the same architecture, another weight
        save_file(sd, f, metadata={"format": "pt"})
    if dist.is_initialized():
        dist.barrier()
    out = {}
    for name, c, p in (("base", cfg, other), ("rank", cfg.model_copy(update={"lora": cfg.lora.model_copy(update={"rank": 8})}), path),
                       ("no_lora", cfg.model_copy(update={"lora": None}), path)):
        tr = MegatronTrainer(c, p)
        try:
            tr.load_checkpoint(ckpt)
            out[name] = ""
        except ValueError as e:
            out[name] = f"{type(e).__name__}: {e}"
        finally:
            tr.close()
    return out


if __name__ == "__main__":
    main(sys.argv[1], *(sys.argv[2:] or ["tp1"]))
