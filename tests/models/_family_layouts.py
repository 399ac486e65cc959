"""Model families at parallel layouts (CPU/gloo), run as ONE process per world size (Megatron's
parallel state and the compat layer are process-global; the process group is owned here, and
each trainer builds and destroys its own parallel state inside it).

Checkpoints (tiny, random, fp32, written by ``ref`` before Megatron is imported):
    ds3    deepseek_v3: 4 layers (first dense), MLA with q_lora, 8 routed experts top-4 in 4
           groups (2 chosen), 1 shared expert, non-zero fp32 e_score_correction_bias
    qwen3  qwen3_moe: 2 layers, GQA + qk-norm, 4 experts top-2, norm_topk_prob=True, untied
    llama  dense llama: 2 layers, GQA, tied embeddings (as SmolLM2)
    glm    glm4_moe: the tiny C26 checkpoint (partial rotary 0.5, first layer dense, 4 routed +
           1 shared expert top-2, q/k/v bias, q/k norm, fp32 router bias, MTP block on disk)
           with vocab 256 (the samples' ids)

Modes:
    python _family_layouts.py ref TMP
        writes the checkpoints under TMP, runs transformers' forward (HF logprobs) and the
        1-process trainer of every checkpoint -> TMP/ref.json
    torchrun --nproc_per_node W _family_layouts.py run TMP OUT.json CASE [CASE ...]
        CASE = ``{ckpt}-tp{t}pp{p}ep{e}`` or ``{ckpt}-tp{t}pp{p}ep{e}vpp{v}`` (v virtual pipeline
        stages: ds3's 4 layers as chunks [dense 0][MoE 2] on rank 0, [MoE 1][MoE 3] on rank 1); for each: logprobs, HF export == checkpoint, two
        optimizer steps -> OUT.json (rank 0). ckpt ``ds3cpl``: the ds3 checkpoint with the q/kv
        down projections built as Megatron's local spec builds them (ColumnParallelLinear),
        i.e. without that part of moe_async.compat.mla_local_attention.local_mla_submodules

Per run: the 8 samples below (lengths 9..13, one with loss_weight 0), fixed advantages, micro
batch 2, lr 1e-3, Adam eps 1e-5, aux coeff 0, vocab padded to a multiple of 96 x TP. At DP > 1 the trainer
gives each DP rank its slice of the batch.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import torch  # noqa: E402
from _checks import ADAM_EPS, ADV, hf_response_logprobs, main, samples, trainer_cfg  # noqa: E402

CKPTS = ("ds3", "qwen3", "llama", "glm")


def cfg(tp=1, pp=1, ep=1, vpp=None):
    return trainer_cfg(tp, pp, ep, vpp=vpp, adam_eps=ADAM_EPS)


def parse(case: str) -> tuple[str, int, int, int, int | None]:
    """``"ds3-tp2pp1ep2"`` -> ``("ds3", 2, 1, 2, None)``; ``"ds3-tp1pp2ep1vpp2"`` -> ``("ds3", 1, 2, 1, 2)``
    (virtual pipeline stages)."""
    ckpt, lay = case.split("-")
    lay, _, vpp = lay.partition("vpp")
    tp, rest = lay[2:].split("pp")
    pp, ep = rest.split("ep")
    return ckpt, int(tp), int(pp), int(ep), int(vpp) if vpp else None


def upstream_mla_down_proj(on: bool) -> None:
    """Build deepseek_v3's q/kv down projections as ColumnParallelLinear (Megatron 0.16.1's
    local spec) while ``on``; restore the family's spec otherwise."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    from moe_async.models.deepseek_v3 import DeepseekV3Family

    orig = getattr(DeepseekV3Family, "_orig_layer_spec", None) or DeepseekV3Family.layer_spec
    DeepseekV3Family._orig_layer_spec = orig
    if not on:
        DeepseekV3Family.layer_spec = orig
        return

    def layer_spec(self, hf_config, *, use_te=False, vp_stage=None):
        block = orig(self, hf_config, use_te=use_te, vp_stage=vp_stage)
        for spec in block.layer_specs:
            sub = spec.submodules.self_attention.submodules
            sub.linear_q_down_proj = sub.linear_kv_down_proj = ColumnParallelLinear
        return block

    DeepseekV3Family.layer_spec = layer_spec


def run(path: str, tp: int, pp: int, ep: int, vpp: int | None = None) -> dict:
    from safetensors.torch import load_file

    from moe_async.trainer.megatron_trainer import MegatronTrainer

    t0 = time.perf_counter()
    ss = samples()
    tr = MegatronTrainer(cfg(tp, pp, ep, vpp), path)
    res: dict = {"logp": tr.compute_logprobs(ss)}
    exported = dict(tr.export_hf_weights())  # collective; rank 0 gets the tensors
    if exported:
        from moe_async.models import get_family, hf_config_dict

        disk = load_file(os.path.join(path, "model.safetensors"))
        fam = get_family(hf_config_dict(path)["model_type"])
        mtp = set(fam.mtp_hf_keys(fam.arch_args(path))) if hasattr(fam, "mtp_hf_keys") else set()
        disk = {k: v for k, v in disk.items() if k not in mtp}  # glm4_moe: no MTP layer is exported
        res["export_equals_disk"] = set(exported) == set(disk) and all(torch.equal(exported[k], disk[k]) for k in disk)
    res["steps"] = [{k: m[k] for k in ("loss", "grad_norm", "entropy", "num_tokens")}
                    for m in (tr.train_step(ss, ADV), tr.train_step(ss, ADV))]
    tr.close()
    res["seconds"] = time.perf_counter() - t0
    return res


def hf_logprobs(path: str) -> list[list[float]]:
    from transformers import AutoModelForCausalLM

    return hf_response_logprobs(AutoModelForCausalLM.from_pretrained(path).eval(), samples())


def main_ref(tmp: str) -> None:
    from _tiny import make_tiny_llama, make_tiny_qwen3_moe  # before Megatron is imported
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3
    from _tiny_glm4_moe import make_tiny_glm4_moe

    make_tiny_deepseek_v3(os.path.join(tmp, "ds3"), num_hidden_layers=4)
    make_tiny_qwen3_moe(os.path.join(tmp, "qwen3"), tie=False, norm_topk_prob=True)
    make_tiny_llama(os.path.join(tmp, "llama"), tie=True)
    make_tiny_glm4_moe(os.path.join(tmp, "glm"), vocab_size=256)
    out = {}
    for ck in CKPTS:
        path = os.path.join(tmp, ck)
        out[f"{ck}-hf"] = {"logp": hf_logprobs(path)}
        out[f"{ck}-tp1pp1ep1"] = run(path, 1, 1, 1)
    with open(os.path.join(tmp, "ref.json"), "w") as f:
        json.dump(out, f)


def run_case(tmp: str, case: str) -> dict:
    ck, tp, pp, ep, vpp = parse(case)
    upstream_mla_down_proj(ck == "ds3cpl")
    res = run(os.path.join(tmp, "ds3" if ck == "ds3cpl" else ck), tp, pp, ep, vpp)
    upstream_mla_down_proj(False)
    return res


if __name__ == "__main__":
    main(main_ref, run_case, barrier=True, wall=False)
