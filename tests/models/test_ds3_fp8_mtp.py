"""A DeepSeek-V3 HF checkpoint as DeepSeek releases it: an MTP layer (``model.layers.{L}.*``,
``num_nextn_predict_layers: 1``) and FP8 block-scaled weights (``weight`` float8_e4m3fn +
``weight_scale_inv``). Unit checks of :mod:`moe_async.models.deepseek_v3.hf_extras`, then one
process (``_ds3_fp8_mtp_checks.py``): converter and trainer read it, the MTP keys skipped
through one logged list, the FP8 weights equal to a reference dequantization bit for bit."""

from __future__ import annotations

import os

import pytest
import torch
from _launch import run_json

from moe_async.models.deepseek_v3.hf_extras import dequantize_block_fp8, hf_extras

HERE = os.path.dirname(__file__)
CFG = {"model_type": "deepseek_v3", "num_hidden_layers": 2, "num_nextn_predict_layers": 1, "dtype": "float32",
       "quantization_config": {"quant_method": "fp8", "weight_block_size": [4, 8]}}


def test_dequantize_matches_blockwise_reference():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(10, 19, generator=g) * 3).to(torch.float8_e4m3fn)  # partial edge blocks both ways
    s = torch.rand(3, 3, generator=g) + 0.01
    ref = torch.empty(10, 19)
    for i in range(3):
        for j in range(3):
            ref[i * 4:(i + 1) * 4, j * 8:(j + 1) * 8] = w[i * 4:(i + 1) * 4, j * 8:(j + 1) * 8].float() * s[i, j]
    assert torch.equal(dequantize_block_fp8(w, s, (4, 8), torch.float32), ref)
    assert torch.equal(dequantize_block_fp8(w, s, (4, 8), torch.bfloat16), ref.to(torch.bfloat16))
    with pytest.raises(ValueError, match=r"HF tensor x\.weight: its weight_scale_inv has shape \(2, 3\), which .* 4x8 blocks"):
        dequantize_block_fp8(w, s[:2], (4, 8), torch.float32, "x.weight")


def test_mtp_keys_skipped_and_scales_paired(caplog):
    keys = ["model.layers.0.self_attn.o_proj.weight", "model.layers.0.self_attn.o_proj.weight_scale_inv",
            "model.layers.1.mlp.gate.weight", "model.layers.2.eh_proj.weight", "model.layers.2.eh_proj.weight_scale_inv",
            "model.layers.2.enorm.weight", "model.embed_tokens.weight"]
    with caplog.at_level("WARNING"):
        ex = hf_extras(CFG, keys)
    assert ex.skipped == ["model.layers.2.eh_proj.weight", "model.layers.2.eh_proj.weight_scale_inv",
                          "model.layers.2.enorm.weight"]
    assert ex.scales == {"model.layers.0.self_attn.o_proj.weight": "model.layers.0.self_attn.o_proj.weight_scale_inv"}
    assert ex.block == (4, 8) and ex.dtype == torch.float32
    idx = {k: "f" for k in keys}
    assert sorted(ex.weights(idx)) == ["model.embed_tokens.weight", "model.layers.0.self_attn.o_proj.weight",
                                       "model.layers.1.mlp.gate.weight"]
    assert "model.layers.0.self_attn.o_proj.weight" not in ex.plain(idx)
    assert [r.getMessage() for r in caplog.records if "MTP" in r.getMessage()] == [
        "DeepSeek-V3 HF checkpoint: skipping 3 MTP tensors (layers 2..2, num_nextn_predict_layers=1; the trainer "
        "builds no MTP block), e.g. model.layers.2.eh_proj.weight, model.layers.2.eh_proj.weight_scale_inv, "
        "model.layers.2.enorm.weight"]
    assert hf_extras({**CFG, "model_type": "mixtral"}, keys).scales == {}  # other families: nothing


def test_unpaired_scale_or_fp8_weight_is_named():
    with pytest.raises(ValueError, match=r"HF tensor model\.layers\.0\.a\.weight_scale_inv has no model\.layers\.0\.a\.weight"):
        hf_extras(CFG, ["model.layers.0.a.weight_scale_inv"])
    with pytest.raises(ValueError, match=r"HF tensor model\.layers\.0\.a\.weight is F8_E4M3 without a model\.layers\.0\.a\.weight_scale_inv"):
        hf_extras(CFG, ["model.layers.0.a.weight"], dtypes={"model.layers.0.a.weight": "F8_E4M3"})


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    return run_json(os.path.join(HERE, "_ds3_fp8_mtp_checks.py"), str(tmp_path_factory.mktemp("ds3fp8")), timeout=900)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")
def test_fault_raw_key_check_refuses_mtp_and_scales(res):
    assert res["n_fp8"] > 10 and res["n_mtp"] > 10
    assert res["raw_check_error"] is not None and "weight_scale_inv" in res["raw_check_error"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")
@pytest.mark.parametrize("path", ["convert", "trainer"])
def test_fp8_weights_dequantized_exactly_mtp_skipped(res, path):
    r = res[path]
    assert r["names_equal"] and r["differ"] == [] and r["extra"] == [], r
    assert res["fp8_differs_from_fp32"]  # the reference is the dequantized FP8, not the fp32 source
    assert len(res["log"]) >= 1 and "skipping" in res["log"][0] and "model.layers.3." in res["log"][0]
