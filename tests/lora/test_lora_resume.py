"""LoRA checkpoint and resume (``_lora_resume_checks.py``): a LoRA trainer's checkpoint holds
the adapters and their optimizer state only and records its base; a resume restores them bit for
bit and its next step equals the step without stopping; another base, another adapter rank or a
trainer without LoRA are refused, naming them. TP2 (torchrun, 2 processes: the column/row
TP-split factors saved as sharded tensors) in the default run; TP1 and a dense model's TP2
checkpoint (also loaded at TP1) are slow."""

from __future__ import annotations

import json
import os

import pytest
from _launch import cpu_check_json, run_json, torchrun

HERE = os.path.dirname(__file__)
SCRIPT = os.path.join(HERE, "_lora_resume_checks.py")
# the adapter checkpoint's tensors: per adapted linear A and B, stacked over the 2 layers
KEYS = sorted(f"decoder.layers.{m}.lora.{f}" for m in ("mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2",
                                                       "self_attention.linear_proj", "self_attention.linear_qkv")
              for f in "AB")


def _check(res: dict, tmp_path) -> None:
    assert res["adapters_equal"] and res["adam_equal"]  # after the load == at the save, every rank
    assert res["n_adam"] == 120  # (exp_avg, exp_avg_sq, step) x 40 adapter tensors of rank 0
    assert res["step_adapters_equal"] and res["step_adam_equal"]  # the resumed step == the straight one
    assert res["resumed_metrics"] == res["straight_metrics"]
    assert res["extra"] == {"step": 1} and res["version_loaded"] == 1 and res["version_after"] == 2
    assert res["model_keys"] == KEYS and res["non_adapter_keys"] == []  # no base tensor saved again
    assert res["qkv_B_shape"] == [2, 128, 4] and res["proj_A_shape"] == [2, 4, 64]  # whole, not one rank's piece
    rec = res["record"]
    assert rec["base"] == str(tmp_path / "mix") and len(rec["base_digest"]) == 64 and rec["rank"] == 4
    ref = res["refusals"]
    assert f"trained on base {tmp_path / 'mix'} " in ref["base"] and f"base is {tmp_path / 'mix_other'} " in ref["base"]
    assert "trainer.lora.rank=4, this trainer trainer.lora.rank=8" in ref["rank"]
    assert "holds LoRA adapters only" in ref["no_lora"] and "set trainer.lora" in ref["no_lora"]


def test_lora_resume_tp2(tmp_path):
    torchrun(2, SCRIPT, str(tmp_path), "tp2", timeout=500)
    with open(tmp_path / "res_resume_tp2.json") as f:
        _check(json.load(f), tmp_path)


@pytest.mark.slow
def test_lora_resume_tp1(tmp_path):
    _check(cpu_check_json(SCRIPT, str(tmp_path), timeout=300), tmp_path)


@pytest.mark.slow
def test_lora_resume_dense_tp2_and_load_at_tp1(tmp_path):
    """A dense Llama: the gated fc1's B ([gate_r; up_r] per TP rank) is saved as Megatron's swiglu
    weight (global [L, 2I, r] = [2, 256, 4]); the TP2 resume is exact, and the TP2 checkpoint
    loaded at TP1 exports the same PEFT tensors as the TP2 trainer at the save."""
    torchrun(2, SCRIPT, str(tmp_path), "tp2", "llama", timeout=500)
    with open(tmp_path / "res_resume_tp2_llama.json") as f:
        res = json.load(f)
    assert res["adapters_equal"] and res["adam_equal"] and res["step_adapters_equal"] and res["step_adam_equal"]
    assert res["non_adapter_keys"] == [] and res["fc1_B_shape"] == [2, 256, 4]
    out = run_json(SCRIPT, str(tmp_path), "tp1load", "llama", timeout=300)
    assert out["cross_export_equal"] and out["n_tensors"] == 28


@pytest.mark.slow
def test_lora_resume_shared_expert_adapter(tmp_path):
    """``experts: shared``: the one expert adapter per layer, which Megatron's expert MLP leaves
    out of its sharded state dict, is saved and restored too."""
    res = run_json(SCRIPT, str(tmp_path), "tp1", "mixtral_shared", timeout=300)
    assert res["adapters_equal"] and res["adam_equal"] and res["step_adapters_equal"] and res["step_adam_equal"]
    assert "decoder.layers.0.mlp.experts.lora_linear_fc1.A" in res["model_keys"]
    assert "decoder.layers.1.mlp.experts.lora_linear_fc2.B" in res["model_keys"]
