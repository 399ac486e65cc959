"""Megatron-Core's own strict ``dist_checkpointing.load`` of a TE-spec model (the TE modules
replaced by the stand-ins of _te_standins.py) from this project's checkpoints, one process;
prints one JSON line.

    python _te_strict_load_checks.py prep TMP                          (the HF checkpoints)
    torchrun --nproc_per_node 2 _te_strict_load_checks.py w2 TMP       (multi-rank writers)
    python _te_strict_load_checks.py TMP                               (the rest; the loads)

For deepseek_v3 (MLA, dense first layer, shared expert) and qwen3_moe (GQA, q/k norms,
stacked MoE layers): the converter's checkpoint (tools/convert_hf_to_megatron.py), the same
converted with the ``_extra_state`` writer switched off (this project's output before it), and
a trainer checkpoint (``MegatronTrainer.save_checkpoint``: model + optimizer). The stand-in TE
model loads each with ``StrictHandling.RAISE_ALL`` (converter: exactly the model's keys) or
Megatron-LM's default ``ASSUME_OK_UNEXPECTED`` (trainer: the optimizer keys are the
unexpected ones): success, or the error text. Also deepseek_v3 converted at TP2 and at EP2
and a trainer checkpoint saved at TP2 (2 processes, ``w2``), loaded the same way. After a successful load the model's tensors
are compared with the HF checkpoint's through the family mapping (bit-exact), and the
``_extra_state`` values the stand-ins received are counted by kind."""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path[:0] = [HERE, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tools"), ROOT]

import torch  # noqa: E402

FAMILIES = ("deepseek_v3", "qwen3_moe")


def make(name: str, path: str) -> None:
    from _tiny import make_tiny_qwen3_moe
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    {"deepseek_v3": make_tiny_deepseek_v3, "qwen3_moe": make_tiny_qwen3_moe}[name](path)


def strict_load(hf_dir: str, ckpt_dir: str, strict: str, padded_vocab: int) -> dict:
    """Build the stand-in TE model and load ``ckpt_dir`` (an iteration dir) into it."""
    import _te_standins as st
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling
    from safetensors.torch import load_file

    from moe_async.models import get_family, hf_config_dict
    from moe_async.megatron.parallel import parallel_layout

    cfg = hf_config_dict(hf_dir)
    out: dict = {}
    with parallel_layout(1, 1, 1):
        model = st.te_spec_model(cfg, padded_vocab)
        sd = {"model": model.sharded_state_dict()}
        from megatron.core.dist_checkpointing.mapping import ShardedObject

        out["model_extra_state_keys"] = sum(isinstance(v, ShardedObject) for v in sd["model"].values())
        st.EXTRA_STATE_LOADED.clear()
        try:
            loaded = dist_checkpointing.load(sd, ckpt_dir, strict=StrictHandling(strict))
        except Exception as e:  # noqa: BLE001  (the load's own error is the result)
            out["error"] = f"{type(e).__name__}: {e}"[:1500]
            return out
        model.load_state_dict(loaded["model"], strict=True)
        out["extra_states_set"] = len(st.EXTRA_STATE_LOADED)
        # TE's non-FP8 form (written by add_te_extra_state), or None (Megatron's local linears
        # write get_extra_state() = None; TE's set_extra_state returns on None)
        out["extra_states_kinds"] = {
            "empty_uint8": sum(isinstance(x, torch.Tensor) and x.dtype == torch.uint8 and x.numel() == 0
                               for x in st.EXTRA_STATE_LOADED),
            "none": sum(x is None for x in st.EXTRA_STATE_LOADED)}
        fam = get_family(cfg["model_type"])
        vocab = cfg["vocab_size"]
        named = ((n, (t[:vocab] if "word_embeddings" in n or n == "output_layer.weight" else t).detach())
                 for n, t in model.state_dict().items() if not n.endswith("_extra_state"))
        hf = dict(fam.megatron_to_hf(named, cfg))
        disk = load_file(os.path.join(hf_dir, "model.safetensors"))
        out["hf_equal"] = set(hf) == set(disk) and all(torch.equal(hf[k], disk[k]) for k in disk)
    return out


def padded_vocab(src: str, meg_root: str) -> int:
    from moe_async.megatron.container import resolve
    from moe_async.megatron.sharding import padded_vocab_size
    from moe_async.models import hf_config_dict

    with open(os.path.join(resolve(meg_root), "moe_async_convert.json")) as f:
        div = json.load(f)["vocab_div"]
    return padded_vocab_size(hf_config_dict(src)["vocab_size"], 1, div)


def main_w2(tmp: str) -> None:
    """Under torchrun (2 processes): deepseek_v3 converted at TP2 and at EP2, and a trainer
    checkpoint saved at TP2 (+SP): every rank writes its share of the extra-state objects."""
    import torch.distributed as dist

    import convert_hf_to_megatron as h2m

    from _checks import trainer_cfg
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    dist.init_process_group("gloo")
    src = os.path.join(tmp, "deepseek_v3")
    for flag in ("tp", "ep"):
        h2m.main(["--hf", src, "--out", os.path.join(tmp, f"deepseek_v3_meg_{flag}2"), f"--{flag}", "2",
                  "--no-progress"])
    tr = MegatronTrainer(trainer_cfg(2, vocab_div=128), src)
    tr.save_checkpoint(os.path.join(tmp, "deepseek_v3_trainer_tp2"))
    tr.close()
    dist.barrier()
    dist.destroy_process_group()


def main(tmp: str) -> None:
    """One process: the checkpoints of every family (converter, converter without the writer,
    trainer), then the strict loads of those and of main_w2's when they exist."""
    import convert_hf_to_megatron as h2m

    import moe_async.megatron.convert as mconv
    from moe_async.megatron.container import resolve
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    res: dict = {}
    for name in FAMILIES:
        src = os.path.join(tmp, name)
        if not os.path.isdir(src):
            make(name, src)
        meg = os.path.join(tmp, f"{name}_meg")
        h2m.main(["--hf", src, "--out", meg, "--no-progress"])
        writer = mconv.add_te_extra_state
        mconv.add_te_extra_state = lambda sd: []  # the converter as it was before the writer
        try:
            h2m.main(["--hf", src, "--out", os.path.join(tmp, f"{name}_old"), "--no-progress"])
        finally:
            mconv.add_te_extra_state = writer
        padded = padded_vocab(src, meg)
        res[f"{name}_converter"] = strict_load(src, resolve(meg), "raise_all", padded)
        res[f"{name}_old"] = strict_load(src, resolve(os.path.join(tmp, f"{name}_old")), "raise_all", padded)
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, make_vocab_size_divisible_by=128), src)
        tr.save_checkpoint(os.path.join(tmp, f"{name}_trainer"))
        tr.close()
        res[f"{name}_trainer"] = strict_load(src, os.path.join(tmp, f"{name}_trainer"), "assume_ok_unexpected", padded)
    src = os.path.join(tmp, "deepseek_v3")
    padded = padded_vocab(src, os.path.join(tmp, "deepseek_v3_meg"))
    for case in ("meg_tp2", "meg_ep2"):
        d = os.path.join(tmp, f"deepseek_v3_{case}")
        if os.path.isdir(d):
            res[f"deepseek_v3_converter_{case[4:]}"] = strict_load(src, resolve(d), "raise_all", padded)
    if os.path.isdir(os.path.join(tmp, "deepseek_v3_trainer_tp2")):
        res["deepseek_v3_trainer_tp2"] = strict_load(src, os.path.join(tmp, "deepseek_v3_trainer_tp2"),
                                                     "assume_ok_unexpected", padded)
    print(json.dumps(res))


if __name__ == "__main__":
    torch.set_num_threads(1)
    if sys.argv[1] == "prep":  # the HF checkpoints, before Megatron is imported
        for name in FAMILIES:
            make(name, os.path.join(sys.argv[2], name))
    elif sys.argv[1] == "w2":
        main_w2(sys.argv[2])
    else:
        main(sys.argv[1])
