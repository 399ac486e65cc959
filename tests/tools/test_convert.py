"""Case C3: HF -> Megatron torch_dist -> HF conversion (tools/convert_*.py), bit-exact, at
EP1 / EP2 / TP2, for mixtral (untied), qwen3_moe (tied, norm_topk_prob=False), from both
HF expert layouts; loud on every unused source / unset target; the converted Megatron
model's logits equal transformers' within 1e-4 (fp32).

Three launches shared with test_convert_glm4_moe.py and test_convert_uneven_pp.py (the
``convert_results`` fixture of conftest.py; the checks in _convert_checks.py): a 1-process prep
(HF checkpoints, EP1 conversions, error cases), ONE 2-process torchrun for every EP2 / TP2
conversion (both directions), and a 1-process final pass (EP2/TP2 checkpoints back to HF at 1
process, all comparisons).
"""

from __future__ import annotations

import pytest
import torch

NAMES = ["mix", "qwen"]
# back_{src}_{name}: src = where the torch_dist checkpoint was written / how it was read back
# (ep1at2: saved at EP1, read at EP2; v96at2: vocab padded at TP1 to 288 rows, read at TP2)
SOURCES = ["ep1", "ep2", "tp2", "fused_ep2", "ep1at2", "tp2at2"]

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo conversion checks")


@pytest.fixture(scope="module")
def res(convert_results):
    return convert_results["convert"]


@pytest.mark.parametrize("key", [f"{s}_{n}" for s in SOURCES for n in NAMES] + ["v96at2_mix"])
def test_round_trip_bit_exact(res, key):
    r = res[key]
    assert r["same_names"], (r["extra"], r["missing"])
    assert r["unequal"] == [], r["unequal"]
    assert r["has_index"]  # sharded output (300KB shards) with model.safetensors.index.json
    assert r["tokenizer_copied"] is True
    assert r["hf_logits_equal"]  # transformers model from the round-tripped dir: equal logits


@pytest.mark.parametrize("key", ["ep1_llama", "tp2_llama"])
def test_dense_bf16_round_trip(res, key):
    """Dense llama family, bf16 on disk: bit-exact and still bf16 (the model is built in the
    checkpoint's dtype: a copy, never a cast)."""
    r = res[key]
    assert r["same_names"] and r["unequal"] == [] and r["has_index"] and r["hf_logits_equal"]
    assert r["dtypes"] == ["torch.bfloat16"]


@pytest.mark.parametrize("key", ["ep1_ds", "ep2_ds", "ep1at2_ds", "tp2_ds", "tp2at2_ds"])
def test_deepseek_v3_round_trip(res, key):
    """deepseek_v3 (MLA, dense first layer, shared expert, fp32 router bias): bit-exact, the
    bias kept in fp32, equal HF logits; written at EP1 / EP2 / TP2, read at 1 process / EP2 /
    TP2."""
    r = res[key]
    assert r["same_names"] and r["unequal"] == [] and r["hf_logits_equal"], r
    assert min(res["ds_bias_absmax"]) > 0  # non-zero e_score_correction_bias


@pytest.mark.parametrize("name", NAMES + ["llama", "ds"])
def test_sources_are_sharded(res, name):
    assert res["n_hf_files"][name] >= 3


@pytest.mark.parametrize("key", ["meg_logits_ep1_mix", "meg_logits_ep1_qwen", "meg_logits_ep2_mix",
                                 "meg_logits_ep2_qwen", "meg_logits_ep1_ds", "meg_logits_ep2_ds",
                                 "meg_logits_tp2_ds"])
def test_megatron_logits_match_hf(res, key):
    assert res[key]["maxdiff"] < 1e-4


def test_hf_logits_not_trivial(res):
    assert res["meg_logits_ep1_mix"]["hf_logit_std"] > 0.5 and res["meg_logits_ep1_qwen"]["hf_logit_std"] > 0.5


@pytest.mark.parametrize("name", NAMES)
def test_experts_saved_once_at_ep2(res, name):
    assert res[f"experts_once_ep2_{name}"]


@pytest.mark.parametrize("case", ["extra_hf_key", "missing_hf_key", "extra_hf_key_fused", "config_mismatch",
                                  "extra_meg_tensor", "missing_meg_tensor", "unset_hf_target",
                                  "unused_meg_source"])
def test_converter_is_loud(res, case):
    e = res["errors"][case]
    assert e["raised"] is not None, case
    assert e["names_it"], e["msg"]


def test_nothing_written_on_refusal(res):
    assert res["errors"]["extra_hf_key"]["nothing_written"]
