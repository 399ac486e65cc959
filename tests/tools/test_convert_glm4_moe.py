"""Case C26 conversion: the tiny GLM-4.5 checkpoint (partial rotary, dense first layer, shared
expert, fp32 router bias, q/k/v bias, q/k norm, an MTP block on disk) HF -> Megatron torch_dist
-> HF at 1 process, EP2 and TP2 (and saved at EP1 / read at EP2, saved and read at TP2):
bit-exact, the MTP block left out (transformers builds none either), the converted Megatron
model's logits equal transformers' within 1e-4 (fp32). The checks (_convert_glm4_moe_checks.py)
run in the three launches shared with test_convert.py (conftest.py's ``convert_results``)."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo conversion checks")


@pytest.fixture(scope="module")
def res(convert_results):
    return convert_results["glm4_moe"]


@pytest.mark.parametrize("src", ["ep1", "ep2", "tp2", "ep1at2", "tp2at2"])
def test_round_trip_bit_exact(res, src):
    assert res["n_mtp_on_disk"] == 32
    r = res[f"back_{src}"]
    assert r["names_are_orig_minus_mtp"] and r["unequal"] == [] and r["n"] == 45
    assert r["bias_dtype"] == "torch.float32" and r["tokenizer_copied"]
    assert r["hf_logits_equal"]


@pytest.mark.parametrize("src", ["ep1", "ep2", "tp2"])
def test_megatron_logits_equal_transformers(res, src):
    assert res["meg_logits_ep1"]["hf_logit_std"] > 0.5
    assert res[f"meg_logits_{src}"]["maxdiff"] < 1e-4
