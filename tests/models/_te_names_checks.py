"""Checks of the TE-spec torch_dist key names (case C18), one process; prints one JSON line.

    python _te_names_checks.py TMP

For each family's tiny model (seed 0, ``orig``): HF -> Megatron with the converter (local
spec on this CPU) -> the checkpoint's tensor keys and shapes. For qwen3_moe and deepseek_v3
also: the same model converted the way this project did before the TE names (the renaming
switched off: ``old``, local-spec names), and a seed-1 model of the same config (``other``).
A trainer built from ``other`` loads the TE-named ``orig`` checkpoint (its HF export must
equal ``orig``'s tensors bit for bit), then the local-named checkpoint of ``other`` (must
equal ``other``'s), then saves its own checkpoint (its model keys). Megatron -> HF of the
local-named checkpoint with the converter (bit-exact against ``other``).
"""

from __future__ import annotations

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

FAMILIES = ("mixtral", "qwen3_moe", "llama", "deepseek_v3", "glm4_moe")
TRAINER_FAMILIES = ("qwen3_moe", "deepseek_v3")


def make(name: str, path: str, seed: int) -> None:
    from _tiny import make_tiny_llama, make_tiny_mixtral, make_tiny_qwen3_moe
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3
    from _tiny_glm4_moe import make_tiny_glm4_moe

    {"mixtral": make_tiny_mixtral, "qwen3_moe": make_tiny_qwen3_moe, "llama": make_tiny_llama,
     "deepseek_v3": make_tiny_deepseek_v3, "glm4_moe": make_tiny_glm4_moe}[name](path, seed=seed)


def tensor_keys(meg: str) -> dict[str, list[int]]:
    from moe_async.megatron.te_spec_names import is_te_extra_state
    from moe_async.megatron.dist_ckpt_files import is_optimizer_key, read_torch_dist_metadata

    from moe_async.megatron.container import resolve

    md = read_torch_dist_metadata(resolve(meg)).state_dict_metadata
    return {k: list(v.size) for k, v in sorted(md.items())
            if hasattr(v, "size") and not is_te_extra_state(k) and not is_optimizer_key(k)}


def container_facts(root: str) -> dict:
    """What Megatron-LM's --load reads: the tracker, the iteration dir, common.pt's items."""
    from moe_async.megatron.container import TRACKER_NAME, read_common

    with open(os.path.join(root, TRACKER_NAME)) as f:
        tracker = f.read()
    it_dir = os.path.join(root, f"iter_{int(tracker.strip()):07d}")
    common = read_common(it_dir)
    args = vars(common.get("args") or {})
    return {"root_files": sorted(os.listdir(root)), "tracker": tracker, "iter_files": sorted(os.listdir(it_dir)),
            "iteration": common.get("iteration"), "checkpoint_version": common.get("checkpoint_version"),
            "args": {k: args.get(k) for k in ("num_layers", "hidden_size", "num_attention_heads",
                                              "max_position_embeddings", "add_position_embedding",
                                              "make_vocab_size_divisible_by", "padded_vocab_size",
                                              "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                              "ckpt_format", "num_experts", "multi_latent_attention")}}


def hf_tensors(d: str) -> dict[str, torch.Tensor]:
    from moe_async.megatron.hf_io import iter_hf_tensors

    return dict(iter_hf_tensors(d))


def bit_exact(named, ref: dict[str, torch.Tensor]) -> dict:
    got = {n: t.detach().cpu() for n, t in named}
    bad = sorted(n for n in ref if n not in got or got[n].dtype != ref[n].dtype or not torch.equal(got[n], ref[n]))
    return {"n": len(ref), "names_equal": set(got) == set(ref), "differ": bad[:10]}


def main(tmp: str) -> None:
    import moe_async.megatron.convert as conv  # where hf_to_megatron_checkpoint looks its helpers up
    from moe_async.megatron.convert import hf_to_megatron_checkpoint, megatron_to_hf_checkpoint

    res: dict = {"keys": {}, "old_keys": {}, "trainer": {}}
    for name in FAMILIES:
        orig = os.path.join(tmp, f"{name}_orig")
        make(name, orig, 0)
        hf_to_megatron_checkpoint(orig, os.path.join(tmp, f"{name}_te"), progress=False)
        res["keys"][name] = tensor_keys(os.path.join(tmp, f"{name}_te"))
        if name in TRAINER_FAMILIES:
            res.setdefault("container", {})[name] = container_facts(os.path.join(tmp, f"{name}_te"))
    for name in TRAINER_FAMILIES:
        other = os.path.join(tmp, f"{name}_other")
        make(name, other, 1)
        # the converter as it was before the TE names and Megatron-LM's container: local-spec
        # names, the torch_dist files flat in the directory, no tracker
        keep = conv.to_te_names, conv.container.iteration_dir, conv.container.write_tracker
        conv.to_te_names = lambda sd: {}
        conv.container.iteration_dir = lambda root, it: root
        conv.container.write_tracker = lambda *a: None
        try:
            hf_to_megatron_checkpoint(other, os.path.join(tmp, f"{name}_old"), progress=False)
        finally:
            conv.to_te_names, conv.container.iteration_dir, conv.container.write_tracker = keep
        res["old_keys"][name] = tensor_keys(os.path.join(tmp, f"{name}_old"))

    # a GPU (TE) checkpoint also holds _extra_state objects of modules the local spec lacks
    # (TEDotProductAttention's FP8 metadata): the qwen3_moe TE checkpoint again, with one
    import io

    from megatron.core.dist_checkpointing.mapping import ShardedObject

    keep_te = conv.to_te_names

    def with_te_extra(sd):
        keep_te(sd)
        sd["te_extra"] = ShardedObject("decoder.layers.self_attention.core_attention._extra_state",
                                       io.BytesIO(b"fp8 meta"), (1,), (0,), replica_id=0)

    conv.to_te_names = with_te_extra
    try:
        hf_to_megatron_checkpoint(os.path.join(tmp, "qwen3_moe_orig"), os.path.join(tmp, "qwen3_moe_te_extra"),
                                  progress=False)
    finally:
        conv.to_te_names = keep_te
    from moe_async.megatron.container import read_common
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    for name in TRAINER_FAMILIES:
        orig, other = os.path.join(tmp, f"{name}_orig"), os.path.join(tmp, f"{name}_other")
        r: dict = {}
        tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3), other)
        r["before"] = bit_exact(tr.export_hf_weights(), hf_tensors(orig))
        tr.load_checkpoint(os.path.join(tmp, f"{name}_te"))
        r["te_into_local"] = bit_exact(tr.export_hf_weights(), hf_tensors(orig))
        tr.load_checkpoint(os.path.join(tmp, f"{name}_old"))
        r["old_into_local"] = bit_exact(tr.export_hf_weights(), hf_tensors(other))
        if name == "qwen3_moe":
            from moe_async.megatron.container import resolve
            from moe_async.megatron.dist_ckpt_files import read_torch_dist_metadata

            md = read_torch_dist_metadata(resolve(os.path.join(tmp, "qwen3_moe_te_extra"))).state_dict_metadata
            r["te_extra_saved"] = any("core_attention._extra_state" in k for k in md)
            tr.load_checkpoint(os.path.join(tmp, "qwen3_moe_te_extra"))
            r["te_extra_into_local"] = bit_exact(tr.export_hf_weights(), hf_tensors(orig))
            tr.load_checkpoint(os.path.join(tmp, f"{name}_old"))
        tr.save_checkpoint(os.path.join(tmp, f"{name}_trainer"))
        r["trainer_keys"] = tensor_keys(os.path.join(tmp, f"{name}_trainer"))
        common = read_common(os.path.join(tmp, f"{name}_trainer"))
        r["trainer_common"] = {"iteration": common.get("iteration"),
                               "num_layers": getattr(common.get("args"), "num_layers", None)}
        tr.close()
        back = os.path.join(tmp, f"{name}_old_hf")
        megatron_to_hf_checkpoint(os.path.join(tmp, f"{name}_old"), other, back, progress=False)
        r["old_to_hf"] = bit_exact(hf_tensors(back).items(), hf_tensors(other))
        res["trainer"][name] = r
    print(json.dumps(res))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
