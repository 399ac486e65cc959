"""deepseek_v3 mapping: HF -> Megatron -> HF bit-exact (q_lora / no q_lora, tied / untied,
on-disk and in-memory fused expert layouts), loud on unused / unset keys, config rejection
naming the field, the Megatron config (MLA, dense-first layers, sigmoid group-limited router),
and the MLA local-attention mend."""

from __future__ import annotations


import pytest
import torch

from _tiny_deepseek_v3 import make_tiny_deepseek_v3
from _mapping_checks import check_expert_bias_required, check_in_memory_fused_layout, disk
from moe_async.models import get_family, hf_config_dict, hf_to_megatron, megatron_to_hf


@pytest.fixture(scope="module", params=[(32, False), (None, True)], ids=["qlora", "noqlora_tied"])
def ckpt(request, tmp_path_factory):
    q, tie = request.param
    return make_tiny_deepseek_v3(str(tmp_path_factory.mktemp("ds3")), q_lora_rank=q, tie=tie)


def test_round_trip_bit_exact(ckpt):
    hf = disk(ckpt)
    meg = hf_to_megatron(hf, ckpt)
    d = hf_config_dict(ckpt)
    assert meg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)  # dense layer
    assert "decoder.layers.0.mlp.router.weight" not in meg
    assert meg["decoder.layers.2.mlp.experts.local_experts.7.linear_fc1.weight"].shape == (64, 64)
    assert meg["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"].shape == (64, 32)
    bias = meg["decoder.layers.2.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    assert meg["decoder.layers.1.self_attention.linear_kv_up_proj.weight"].shape == (4 * (16 + 16), 32)
    assert ("decoder.layers.1.self_attention.linear_q_proj.weight" in meg) == (d["q_lora_rank"] is None)
    assert ("decoder.layers.1.self_attention.q_layernorm.weight" in meg) == (d["q_lora_rank"] is not None)
    assert ("output_layer.weight" in meg) == (not d["tie_word_embeddings"])
    back = dict(megatron_to_hf(meg.items(), ckpt))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)
    assert get_family("deepseek_v3").hf_keys(ckpt) == tuple(get_family("deepseek_v3").table(
        get_family("deepseek_v3").arch_args(ckpt)).hf_keys)


def test_loud_on_unused_and_unset(ckpt):
    hf = disk(ckpt)
    with pytest.raises(KeyError, match="unused HF tensors.*model.layers.3.mlp"):  # e.g. an MTP layer
        hf_to_megatron({**hf, "model.layers.3.mlp.gate.weight": torch.zeros(8, 64)}, ckpt)
    dense_bias = "model.layers.0.mlp.gate.e_score_correction_bias"  # no router in a dense layer
    with pytest.raises(KeyError, match="unused"):
        hf_to_megatron({**hf, dense_bias: torch.zeros(8)}, ckpt)
    check_expert_bias_required(hf, ckpt, hf_layer=1, megatron_layer=2)
    with pytest.raises(KeyError, match="unknown"):
        list(megatron_to_hf([("decoder.layers.0.mlp.router.weight", torch.zeros(8, 64))], ckpt))


def test_in_memory_fused_layout(ckpt):
    from transformers import DeepseekV3ForCausalLM

    check_in_memory_fused_layout(DeepseekV3ForCausalLM, ckpt)


@pytest.mark.parametrize(
    "field,bad",
    [
        ("rope_parameters", {"rope_type": "longrope", "rope_theta": 10000.0, "factor": 40.0}),
        ("norm_topk_prob", False),
        ("attention_bias", True),
        ("hidden_act", "gelu"),
        ("topk_group", 1),  # 4 // 1 = 4: Megatron would score groups by their top-4
        ("first_k_dense_replace", 3),
        ("pretraining_tp", 2),
    ],
)
def test_unsupported_fields_rejected(ckpt, field, bad):
    d = hf_config_dict(ckpt)
    with pytest.raises(ValueError, match=field if field != "rope_parameters" else "rope_type"):
        get_family("deepseek_v3").arch_args({**d, field: bad})


def test_megatron_config(ckpt):
    pytest.importorskip("megatron.core")
    fam = get_family("deepseek_v3")
    d = hf_config_dict(ckpt)
    c = fam.transformer_config(d)
    assert type(c).__name__ == "MLATransformerConfig" and c.multi_latent_attention
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_head_dim, c.qk_pos_emb_head_dim, c.v_head_dim) == (
        d["q_lora_rank"], 32, 16, 8, 16)
    assert c.rope_type == "rope" and not c.rotary_interleaved
    assert c.moe_layer_freq == [0, 1, 1] and c.ffn_hidden_size == 96 and c.moe_ffn_hidden_size == 32
    assert c.moe_shared_expert_intermediate_size == 32
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_dtype == "fp32" and c.moe_router_bias_update_rate == 0.0
    assert (c.moe_router_num_groups, c.moe_router_group_topk, c.moe_router_topk) == (4, 2, 4)
    assert c.moe_router_topk_scaling_factor == 2.5
    # every group selected -> no group limit
    c2 = fam.transformer_config({**d, "topk_group": 4})
    assert c2.moe_router_num_groups is None and c2.moe_router_group_topk is None


def test_mla_local_attention_mend():
    """Megatron 0.16.1: the local DotProductAttention rejects MLA's k_channels/v_channels and
    multi_latent_attention.py believes TE is present without it. Fails when either stops being
    true (the mend is then no longer needed) or when the mended module stops working."""
    pytest.importorskip("megatron.core")
    import inspect

    import megatron.core.transformer.multi_latent_attention as mla
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from moe_async.compat.mla_local_attention import MLADotProductAttention, mend_mla_without_te

    assert "k_channels" not in inspect.signature(DotProductAttention.__init__).parameters
    assert "k_channels" in inspect.signature(MLADotProductAttention.__init__).parameters
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        assert not isinstance(mla.TELinear, type)  # the mock that makes HAVE_TE wrongly True
        assert mend_mla_without_te() and mla.HAVE_TE is False
