"""deepseek_v3 through MegatronTrainer on 1 CPU process: HF logprob parity (fp32, < 1e-4), the
same routed experts on every token with a non-zero e_score_correction_bias, bit-exact export,
one train step. All checks run in ONE subprocess (tests/models/_deepseek_v3_checks.py)."""

from __future__ import annotations

import os

import pytest
from _launch import cpu_check_json

HERE = os.path.dirname(__file__)
VARIANTS = ["qlora", "noqlora"]  # q_lora_rank=32 untied head / q_lora_rank=None tied


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    pytest.importorskip("megatron.core")
    return cpu_check_json(os.path.join(HERE, "_deepseek_v3_checks.py"), str(tmp_path_factory.mktemp("ds3")), timeout=300)


@pytest.mark.parametrize("v", VARIANTS)
def test_logprob_parity_with_hf(res, v):
    assert res[f"lens_ok_{v}"]
    assert res[f"ref_logp_min_{v}"] < -7.0  # far from uniform (log 256 = -5.55)
    assert res[f"parity_maxdiff_{v}"] < 1e-4


@pytest.mark.parametrize("v", VARIANTS)
def test_same_experts_on_every_token(res, v):
    same, total = res[f"routes_same_{v}"]
    assert total == 2 * 57 and same == total  # 2 MoE layers x 57 tokens
    assert res[f"route_weight_maxdiff_{v}"] < 1e-5  # sigmoid, renormalised, x routed_scaling_factor
    assert res[f"bias_nonzero_{v}"] and res[f"bias_changes_routes_{v}"]  # the bias is live


@pytest.mark.parametrize("v", VARIANTS)
def test_export_is_bit_exact_with_checkpoint(res, v):
    assert res[f"export_equals_disk_{v}"]


@pytest.mark.parametrize("v", VARIANTS)
def test_train_step(res, v):
    m = res[f"step_{v}"]
    assert m["loss"] == m["loss"] and m["grad_norm"] > 0 and m["num_tokens"] == 26
    # every weight moves; the expert bias is a buffer (update rate 0 by default)
    assert res[f"unchanged_{v}"] == [
        "model.layers.1.mlp.gate.e_score_correction_bias",
        "model.layers.2.mlp.gate.e_score_correction_bias",
    ]


def test_moe_aux_loss_included(res):
    aux, base = res["aux_step"], res["step_noqlora"]
    assert aux["moe_aux_loss"] > 0
    assert aux["loss"] - aux["pg_loss"] == pytest.approx(0.01 * aux["moe_aux_loss"], rel=1e-9)
    assert aux["pg_loss"] == pytest.approx(base["loss"], rel=1e-5)  # same weights and data (mbs 2 vs 1)
    assert aux["grad_norm"] != base["grad_norm"]


def test_bf16_keeps_expert_bias_fp32(res):
    assert res["bf16_bias_dtypes"] == ["torch.float32"]
    assert res["bf16_bias_export_exact"]


def test_aux_loss_free_expert_bias_update(res):
    """trainer.moe_router_bias_update_rate > 0 (DeepSeek-V3's aux-loss-free balancing, via
    Megatron-Core's get_updated_expert_bias): each bias element moves by exactly +-rate per
    step, by the sign of (mean - count) over the batch's 57 real tokens (HF reference routes),
    the same with micro-batches of 1 or 2 sequences (padding positions are not counted)."""
    b = res["bias_update"]
    assert b["exact"], b
    assert b["n"] == 2 * 8 and b["moved"] > 0 and b["tokens"] == 57


def test_bias_rate_refused_without_expert_bias(res):
    msg = res["bias_rate_refused"]
    assert "trainer.moe_router_bias_update_rate" in msg and "mixtral" in msg
