"""glm4_moe through MegatronTrainer on 1 CPU process (case C26): HF logprob parity (fp32,
< 1e-4), the rotary applied to the first half of each head only (a Megatron model rotating the
whole head is off by > 1 nat), the same routed experts on every token with a non-zero fp32
e_score_correction_bias, bit-exact export without the MTP block, one train step, bf16 params
with the bias and the router kept fp32. All checks run in ONE subprocess
(tests/models/_glm4_moe_checks.py)."""

from __future__ import annotations

import os

import pytest
from _launch import cpu_check_json

HERE = os.path.dirname(__file__)


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    pytest.importorskip("megatron.core")
    return cpu_check_json(os.path.join(HERE, "_glm4_moe_checks.py"), str(tmp_path_factory.mktemp("glm")), timeout=300)


def test_logprob_parity_with_hf(res):
    assert res["lens_ok"]
    assert res["ref_logp_min"] < -6.0  # far from uniform (log 128 = -4.85)
    assert res["parity_maxdiff"] < 1e-4


def test_rotary_on_half_the_head(res):
    """head_dim 16, partial_rotary_factor 0.5: 8 rotated dims; rotating all 16 fails the check."""
    assert res["rotary_dims"] == 8 and res["rotate_all_dims"] == 16
    assert res["rotate_all_maxdiff"] > 0.1


def test_same_experts_on_every_token(res):
    same, total = res["routes_same"]
    assert total == 57 and same == total  # 1 MoE layer x 57 tokens
    assert res["route_weight_maxdiff"] < 1e-5  # sigmoid, renormalised, x routed_scaling_factor 2.5
    assert res["bias_changes_routes"]  # the bias is live


def test_export_is_bit_exact_without_mtp(res):
    assert res["mtp_on_disk"] == 32  # eh_proj, enorm, hnorm, shared_head.norm + a 28-tensor MoE layer
    assert res["export_keys_ok"] and res["export_equals_disk"]


def test_train_step(res):
    m = res["step"]
    assert m["loss"] == m["loss"] and m["grad_norm"] > 0 and m["num_tokens"] == 26
    assert res["n_tensors"] == 45
    assert res["unchanged"] == ["model.layers.1.mlp.gate.e_score_correction_bias"]  # a buffer, rate 0


def test_router_and_bias_fp32(res):
    assert res["router_dtype"] == res["bf16_router_dtype"] == "fp32"
    assert res["export_bias_dtype"] == "torch.float32"
    assert res["bf16_bias_dtypes"] == ["torch.float32"] and res["bf16_bias_export_exact"]
