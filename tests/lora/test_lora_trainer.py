"""LoRA in the Megatron trainer against the reference on the other side: the base model's own
logprobs (at init, B = 0) and Hugging Face ``peft`` loading the exported adapter onto the HF
model (after one optimizer step). TP1 in the default run (a multi-rank LoRA trainer there:
``test_lora_resume.py``'s TP2 resume); PP2, TP2, EP2 and CP2 (torchrun, 2 processes) are slow.
The plan's adapter counts against a tiny DeepSeek-V3's trainer and export (MLA: o_proj only)."""

from __future__ import annotations

import json
import os

import pytest
from _launch import cpu_check_json, torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_lora_checks.py")


def _check(res: dict) -> None:
    assert res["init_maxdiff"] == 0.0  # B = 0: the adapted model is the base model exactly
    assert res["adapter_numel"] == res["optimizer_numel"] > 0  # optimizer over adapter parameters only
    assert res["base_changed"] == 0  # frozen base: no HF tensor moved
    assert res["grad_norm"] > 0 and res["step_moved"] > 1e-2
    assert res["peft_keys_match"]  # every exported tensor is one peft placed
    assert res["peft_numel"] == 19968  # the plan's count of the sync's PEFT tensors (tests/plan/test_plan_lora.py)
    assert res["export_into_out"] and res["export_aliases_params"] == 0  # export_lora(out=...): one copy, no alias
    # written over the step-0 export (replace), readable like any other run file (not 0600)
    assert res["file_modes_ok"] and not res["tmp_left"]
    assert res["b_nonzero"] == res["n_b"] == 12  # q/k/v/o + 2 fused expert params, x 2 layers
    assert res["peft_maxdiff"] < 1e-5  # the trainer's logprobs == HF + peft on the export
    # merged export: peft's merge_and_unload() tensors (fp32 rounding: einsum vs per-expert matmul),
    # per layer q, k, v, o and the fused experts' gate_up_proj, down_proj changed (transformers 5 names)
    assert res["merged_files"] and res["merged_keys_match"]
    assert res["merged_vs_peft_maxdiff"] < 1e-6
    assert res["merged_changed"] == 2 * (4 + 2)
    assert res["merged_logits_maxdiff"] < 1e-4 and res["merged_lp_maxdiff"] < 2e-5  # TP1: 1.1e-5, 7.6e-6


def test_lora_tp1_matches_base_then_peft(tmp_path):
    res = cpu_check_json(SCRIPT, str(tmp_path), timeout=240)
    assert res["n_adapted"] == 2 * (2 + 4 * 2)  # per layer: qkv, proj, 4 experts x (fc1, fc2)
    _check(res)
    assert abs(res["grad_norm"] - TP1_GRAD_NORM) <= 1e-6 * TP1_GRAD_NORM


# grad norm of the TP1 case's step (the layouts' steps must give it; its own test recomputes it)
TP1_GRAD_NORM = 1.331686473089617


def _layout(tmp_path, layout: str) -> dict:
    torchrun(2, SCRIPT, str(tmp_path), layout, timeout=400)
    with open(tmp_path / f"res_{layout}.json") as f:
        res = json.load(f)
    _check(res)
    # the same step as 1 process: the adapters start equal (A drawn whole, then sliced)
    assert abs(res["grad_norm"] - TP1_GRAD_NORM) <= 1e-5 * TP1_GRAD_NORM
    return res


@pytest.mark.slow
def test_lora_pp2_matches_peft(tmp_path):
    """At PP2 each stage adapts its own layer; the export and the adapter sync gather both
    stages' adapters into one PEFT adapter (all 12 B tensors, peft's logprobs)."""
    res = _layout(tmp_path, "pp2")
    assert res["n_adapted"] == 2 + 4 * 2  # rank 0 (stage 0): its one layer's adapters


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2", "ep2", "cp2"])
def test_lora_layouts_match_peft(tmp_path, layout):
    """At TP2 (sequence parallel), EP2 and CP2 (each rank half of every sequence) the same checks; at TP2 rank 0 holds the adapters the
    plan counts (qkv B and o A halved: tests/plan/test_plan_lora.py)."""
    res = _layout(tmp_path, layout)
    if layout == "tp2":
        assert res["adapter_numel"] == 18_944 - 2 * (256 + 128)


def test_deepseek_v3_plan_counts_equal_the_trainers_and_export(tmp_path):
    """MLA attention: add_lora adapts its o projection (``linear_proj``, 4 heads x v_head_dim 24
    = 96 inputs, hidden 64), and the plan counts it. Tiny DeepSeek-V3, rank 4, all seven
    targets: per layer o A 4x96 + B 64x4 = 640; layer 0's dense MLP (96) 1,920 exported; each
    MoE layer's shared expert (32) 1,152 and 8 experts x 896 = 7,168. Exported: 3 x 640 + 1,920
    + 2 x (1,152 + 7,168) = 20,480 (the plan without MLA's o: 18,560); on the TP1 trainer
    (fused A once): 19,712."""
    from moe_async.layout import ParallelLayout
    from moe_async.lora.config import LoraConfig
    from moe_async.plan.arch import model_shape
    from moe_async.plan.lora import lora_counts

    res = cpu_check_json(os.path.join(HERE, "_lora_ds3_counts.py"), str(tmp_path), timeout=240)
    shape = model_shape(res["hf_config"], "tiny deepseek_v3")
    plan = lora_counts(shape, list(shape.layers), LoraConfig(rank=res["rank"], alpha=8.0), ParallelLayout(world_size=1))
    assert res["peft_numel"] == plan.peft == 20_480
    assert res["adapter_numel"] == plan.dense + plan.expert == 19_712
    o = {k: v for k, v in res["peft_shapes"].items() if ".self_attn.o_proj." in k}
    assert o == {f"base_model.model.model.layers.{i}.self_attn.o_proj.lora_{f}.weight": s
                 for i in range(3) for f, s in (("A", [4, 96]), ("B", [64, 4]))}
    assert not [k for k in res["peft_shapes"] if ".self_attn." in k and ".o_proj." not in k]  # MLA: o only
