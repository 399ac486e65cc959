"""Parameter counts by family (moe_async/plan/arch.py) against hand counts of the HF shapes,
and how pipeline stages and engines split them."""

from pathlib import Path

import pytest

from moe_async.config import load_config
from moe_async.plan.memory import _stage_params, estimate_engine, padded_vocab
from moe_async.plan.report import make_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NO_RECOMPUTE = ["trainer.recompute_granularity=null", "trainer.recompute_method=null", "trainer.recompute_num_layers=null"]


def test_deepseek_v3_mla_dense_first_layers_shared_expert_router_bias():
    s = make_plan(load_config(CONFIGS / "deepseek_v3.yaml"), family_check=False).shape
    h, nh = 7168, 128
    attn = (h * 1536 + 1536 + 1536 * nh * 192          # q_a, q_a_layernorm, q_b
            + h * 576 + 512 + 512 * nh * 256           # kv_a_proj_with_mqa, kv_a_layernorm, kv_b
            + nh * 128 * h + 2 * h)                    # o_proj, input / post-attention norms
    dense_mlp = 3 * h * 18432
    moe = 256 * h + 256 + 256 * 3 * h * 2048 + 3 * h * 2048  # router, e_score_correction_bias, experts, shared
    total = 61 * attn + 3 * dense_mlp + 58 * moe + 2 * 129280 * h + h
    assert s.total == total and s.expert_total == 58 * 256 * 3 * h * 2048
    assert s.num_moe_layers == 58 and s.num_key_value_heads is None
    assert s.kv_cache_per_token_layer == 512 + 64  # SGLang caches MLA's latent
    assert any("MTP" in n for n in s.not_counted)


def test_mixtral_and_glm_hand_counts():
    m = make_plan(load_config(CONFIGS / "mixtral_8x7b.yaml"), family_check=False).shape
    h = 4096
    layer = 2 * h * 4096 + 2 * h * 1024 + 2 * h + 8 * h + 8 * 3 * h * 14336
    assert m.total == 32 * layer + 2 * 32000 * h + h
    g = make_plan(load_config(CONFIGS / "glm45_air.yaml"), family_check=False).shape
    q, kv = 96 * 128, 8 * 128
    attn = 2 * h * q + q + 2 * h * kv + 2 * kv + 2 * h  # q/k/v biases (attention_bias), no q/k norms
    moe = 128 * h + 128 + 128 * 3 * h * 1408 + 3 * h * 1408
    assert g.total == 46 * attn + 3 * h * 10944 + 45 * moe + 2 * 151552 * h + h


def test_pipeline_stages_hold_interleaved_chunks_and_the_ends():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b.yaml", ["trainer.nodes=2", "trainer.pipeline_model_parallel_size=2",
                                                       "trainer.virtual_pipeline_model_parallel_size=2",
                                                       *NO_RECOMPUTE])
    p = make_plan(cfg, family_check=False)
    lay, s = p.trainer.layout, p.shape
    vp = padded_vocab(s.vocab_size, 128, lay.tp)
    per_layer_dense = (18_874_368 // 4) + 4_352 + 262_144
    d0, e0 = _stage_params(s, lay, 2, vp, 0)  # chunks 0 and 2: layers 0-11 and 24-35, plus the embedding
    d1, e1 = _stage_params(s, lay, 2, vp, 1)  # chunks 1 and 3, plus the output layer and final norm
    assert e0 == e1 == 24 * 603_979_776 // 8
    assert d0 == 24 * per_layer_dense + vp * 2048 // 4
    assert d1 == 24 * per_layer_dense + vp * 2048 // 4 + 2048
    assert p.trainer.stage == 0  # more micro-batches in flight on the first stage


def test_uneven_pipeline_stages():
    """slime's Qwen3-235B layout: PP4 with 22 layers on the last stage -> 24+24+24+22; the first
    stage holds 24 layers and the embedding, the last 22 and the output layer; a split that does
    not divide is refused naming the fields."""
    from moe_async.plan.memory import PlanError, stage_layer_counts

    assert stage_layer_counts(94, 4, None, 22) == [24, 24, 24, 22]
    assert stage_layer_counts(61, 4, None, 13) == [16, 16, 16, 13]
    assert stage_layer_counts(4, 2, 3, None) == [3, 1]
    cfg = load_config(CONFIGS / "qwen3_235b_a22b.yaml")
    p = make_plan(cfg, family_check=False)
    lay, s = p.trainer.layout, p.shape
    assert p.trainer.stage_layers == (24, 24, 24, 22)
    vp = padded_vocab(s.vocab_size, 128, lay.tp)
    counts = [24, 24, 24, 22]
    d0, e0 = _stage_params(s, lay, 1, vp, 0, counts)
    d3, e3 = _stage_params(s, lay, 1, vp, 3, counts)
    assert e0 * 22 == e3 * 24 and e0 == 24 * s.layers[0].expert // 16
    assert d0 - vp * s.hidden_size // 4 > d3 - vp * s.hidden_size // 4 - s.final_norm
    with pytest.raises(PlanError, match="num_layers_in_last_pipeline_stage=21 leave 73 layers for 3"):
        make_plan(load_config(CONFIGS / "qwen3_235b_a22b.yaml", ["trainer.num_layers_in_last_pipeline_stage=21"]),
                  family_check=False)


def test_engine_replicates_kv_heads_beyond_its_tp():
    cfg = load_config(CONFIGS / "qwen3_30b_a3b.yaml", ["engine.tensor_parallel_size=8", "engine.expert_parallel_size=8",
                                                        "engine.num_engines=1"])
    s = make_plan(cfg, family_check=False).shape
    e8 = estimate_engine(s, cfg)
    cfg4 = load_config(CONFIGS / "qwen3_30b_a3b.yaml")
    e4 = estimate_engine(s, cfg4)
    assert e8.kv_bytes_per_token == e4.kv_bytes_per_token  # 4 KV heads: one per rank at TP4 and at TP8
    # TP8 splits q/o and the experts 8 ways but k/v only 4 ways (each rank keeps a whole KV head)
    per_layer = (16_777_216 + 603_979_776) // 8 + 2_097_152 // 4 + 266_496
    assert e8.weights == 2 * (2 * 151_936 * 2048 // 8 + 2048 + 48 * per_layer)
