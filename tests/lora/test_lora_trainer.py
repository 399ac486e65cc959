"""LoRA in the Megatron trainer against the reference on the other side: the base model's own
logprobs (at init, B = 0) and Hugging Face ``peft`` loading the exported adapter onto the HF
model (after one optimizer step). TP1 in the default run (a multi-rank LoRA trainer there:
``test_lora_resume.py``'s TP2 resume); PP2, TP2, EP2 and CP2 (torchrun, 2 processes) are slow."""

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
