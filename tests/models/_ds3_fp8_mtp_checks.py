"""DeepSeek-V3 HF checkpoint with an MTP layer and FP8 block-scaled weights; one process,
prints one JSON line.

    python _ds3_fp8_mtp_checks.py TMP

A tiny DeepSeek-V3 (fp32, 3 layers) is re-saved the way DeepSeek releases V3: every 2-D
``*_proj.weight`` of the decoder layers as ``float8_e4m3fn`` with a float32
``weight_scale_inv`` per 16x16 block (shapes not multiples of 16 included: partial edge
blocks), ``quantization_config.weight_block_size: [16, 16]``, and ``num_nextn_predict_layers:
1`` with MTP keys ``model.layers.3.*`` (a decoder layer, ``enorm``, ``hnorm``, an FP8
``eh_proj``, ``shared_head.*``, ``embed_tokens``). The reference dequantization is an
explicit loop over blocks (``weight[block].float() * scale``) written here.

Checked: the raw key check refuses the checkpoint (the fault: "unused" MTP and scale keys);
HF -> Megatron (converter) -> HF equals the reference tensors bit for bit; a trainer built
from the FP8 checkpoint exports the same tensors; the MTP keys are skipped with one WARNING
naming them.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
sys.path[:0] = [HERE, ROOT]

import torch  # noqa: E402

BLOCK = 16


def quantize(w: torch.Tensor, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = math.ceil(w.shape[0] / BLOCK), math.ceil(w.shape[1] / BLOCK)
    s = torch.empty(rows, cols)
    q = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(rows):
        for j in range(cols):
            blk = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            s[i, j] = blk.abs().max().clamp_min(1e-4) / 448.0 * (1 + torch.rand((), generator=g))
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (blk / s[i, j]).to(torch.float8_e4m3fn)
    return q, s


def reference_dequant(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    out = torch.empty(q.shape, dtype=torch.float32)
    for i in range(s.shape[0]):
        for j in range(s.shape[1]):
            sl = (slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            out[sl] = q[sl].to(torch.float32) * s[i, j]
    return out


def make_fp8_mtp(src: str, dst: str) -> dict[str, torch.Tensor]:
    """Write the FP8 + MTP checkpoint ``dst`` from the fp32 one ``src``; return the reference
    (dequantized) tensors of the model's own keys."""
    import shutil

    from safetensors.torch import save_file

    from moe_async.megatron.hf_io import iter_hf_tensors

    os.makedirs(dst)
    g = torch.Generator().manual_seed(0)
    orig = dict(iter_hf_tensors(src))
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    L = cfg["num_hidden_layers"]
    out, ref = {}, {}
    for k, t in orig.items():
        if k.startswith("model.layers.") and k.endswith("_proj.weight") and t.dim() == 2:
            q, s = quantize(t, g)
            out[k], out[k[: -len(".weight")] + ".weight_scale_inv"] = q, s
            ref[k] = reference_dequant(q, s)
        else:
            out[k] = ref[k] = t
    mtp = f"model.layers.{L}."
    for k, t in orig.items():
        if k.startswith(f"model.layers.{L - 1}."):
            out[mtp + k[len(f"model.layers.{L - 1}."):]] = t.clone()
    h = cfg["hidden_size"]
    eh, eh_s = quantize(torch.randn(h, 2 * h, generator=g) * 0.05, g)
    out.update({mtp + "enorm.weight": torch.ones(h), mtp + "hnorm.weight": torch.ones(h),
                mtp + "eh_proj.weight": eh, mtp + "eh_proj.weight_scale_inv": eh_s,
                mtp + "shared_head.norm.weight": torch.ones(h),
                mtp + "shared_head.head.weight": orig["lm_head.weight"].clone(),
                mtp + "embed_tokens.weight": orig["model.embed_tokens.weight"].clone()})
    keys = sorted(out)
    half = len(keys) // 2
    index = {}
    for n, part in (("model-00001-of-00002.safetensors", keys[:half]), ("model-00002-of-00002.safetensors", keys[half:])):
        save_file({k: out[k].contiguous() for k in part}, os.path.join(dst, n))
        index.update({k: n for k in part})
    with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": index}, f)
    cfg.update(num_nextn_predict_layers=1,
               quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK]})
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    for fn in os.listdir(src):
        if fn.endswith(".json") and fn not in ("config.json", "model.safetensors.index.json"):
            shutil.copy(os.path.join(src, fn), dst)
    return ref


def compare(named, ref: dict[str, torch.Tensor]) -> dict:
    got = {n: t.detach().cpu() for n, t in named}
    bad = sorted(n for n in ref if n not in got or got[n].dtype != ref[n].dtype or not torch.equal(got[n], ref[n]))
    return {"n": len(ref), "names_equal": set(got) == set(ref), "differ": bad[:10], "extra": sorted(set(got) - set(ref))[:5]}


def main(tmp: str) -> None:
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3

    from moe_async.models import get_family
    from moe_async.megatron.hf_io import check_hf_keys, iter_hf_tensors, read_hf_config, read_hf_index
    from moe_async.megatron.convert import hf_to_megatron_checkpoint, megatron_to_hf_checkpoint

    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, r):
            records.append(r.getMessage())

    logging.getLogger("moe_async.models.deepseek_v3.hf_extras").addHandler(Keep())
    src, fp8 = os.path.join(tmp, "ds"), os.path.join(tmp, "ds_fp8")
    make_tiny_deepseek_v3(src)
    ref = make_fp8_mtp(src, fp8)
    res: dict = {"n_fp8": sum(1 for k in read_hf_index(fp8) if k.endswith("weight_scale_inv")),
                 "n_mtp": sum(1 for k in read_hf_index(fp8) if k.startswith("model.layers.3."))}
    cfg = read_hf_config(fp8)
    fam = get_family("deepseek_v3")
    try:  # what the converter checked before: every HF key must map
        check_hf_keys(fam, fam.arch_args(cfg), read_hf_index(fp8))
        res["raw_check_error"] = None
    except KeyError as e:
        res["raw_check_error"] = str(e)[:300]
    meg, back = os.path.join(tmp, "ds_meg"), os.path.join(tmp, "ds_back")
    hf_to_megatron_checkpoint(fp8, meg, progress=False)
    megatron_to_hf_checkpoint(meg, src, back, progress=False)
    res["convert"] = compare(iter_hf_tensors(back), ref)
    res["fp8_differs_from_fp32"] = not torch.equal(ref["model.layers.0.self_attn.o_proj.weight"],
                                                  dict(iter_hf_tensors(src))["model.layers.0.self_attn.o_proj.weight"])
    from moe_async.trainer.config import TrainerConfig
    from moe_async.trainer.megatron_trainer import MegatronTrainer

    tr = MegatronTrainer(TrainerConfig(micro_batch_size=1, moe_aux_loss_coeff=0.0, lr=1e-3), fp8)
    res["trainer"] = compare(tr.export_hf_weights(), ref)
    tr.close()
    res["log"] = [m for m in records if "MTP" in m]
    print(json.dumps(res))


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
