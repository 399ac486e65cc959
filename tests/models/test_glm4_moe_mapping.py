"""glm4_moe mapping (case C26): HF -> Megatron -> HF bit-exact (on-disk and in-memory fused
expert layouts, with / without q/k/v bias and q/k norm), the MTP block skipped through the
family's exact, logged list (never read as a decoder layer), loud on unused / unset keys,
config rejection naming the field (n_routed_experts vs num_experts), the Megatron config."""

from __future__ import annotations

import logging

import pytest
import torch

from _tiny_glm4_moe import make_tiny_glm4_moe
from _mapping_checks import check_expert_bias_required, check_in_memory_fused_layout, disk
from moe_async.models import get_family, hf_config_dict, hf_to_megatron, megatron_to_hf

FAM = "glm4_moe"


@pytest.fixture(scope="module", params=["bias_qknorm", "plain_tied"])
def ckpt(request, tmp_path_factory):
    kw = {} if request.param == "bias_qknorm" else dict(attention_bias=False, use_qk_norm=False, tie=True)
    return make_tiny_glm4_moe(str(tmp_path_factory.mktemp("glm")), **kw)


def _mtp(ckpt):
    fam = get_family(FAM)
    return set(fam.mtp_hf_keys(fam.arch_args(ckpt)))


def test_round_trip_bit_exact(ckpt, caplog):
    hf = disk(ckpt)
    d = hf_config_dict(ckpt)
    mtp = _mtp(ckpt)
    assert len(mtp & set(hf)) == (32 if d["attention_bias"] else 27) and all(k.startswith("model.layers.2.") for k in mtp)
    get_family(FAM)._mtp_logged.clear()
    with caplog.at_level(logging.INFO, logger="moe_async.models.glm4_moe"):
        meg = hf_to_megatron(hf, ckpt)
    logged = "".join(r.getMessage() for r in caplog.records)
    assert "model.layers.2.eh_proj.weight" in logged and "model.layers.2.mlp.gate.weight" in logged
    assert not any(k.startswith("decoder.layers.2.") for k in meg)  # never a decoder layer
    assert meg["decoder.layers.0.mlp.linear_fc1.weight"].shape == (2 * 96, 64)  # dense layer
    assert "decoder.layers.0.mlp.router.weight" not in meg
    assert meg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (64, 64)
    assert meg["decoder.layers.1.mlp.shared_experts.linear_fc2.weight"].shape == (64, 32)
    bias = meg["decoder.layers.1.mlp.router.expert_bias"]
    assert bias.dtype == torch.float32 and bias.abs().min() > 0
    qkv = meg["decoder.layers.1.self_attention.linear_qkv.weight"]
    assert qkv.shape == (2 * (2 + 2) * 16, 64)
    # per KV group [q heads of the group; k; v]: group 1 starts with q head 2
    assert torch.equal(qkv[64:80], hf["model.layers.1.self_attn.q_proj.weight"][32:48])
    assert torch.equal(qkv[96:112], hf["model.layers.1.self_attn.k_proj.weight"][16:32])
    assert ("decoder.layers.1.self_attention.linear_qkv.bias" in meg) == d["attention_bias"]
    if d["attention_bias"]:
        b = meg["decoder.layers.1.self_attention.linear_qkv.bias"]
        assert torch.equal(b[96:112], hf["model.layers.1.self_attn.k_proj.bias"][16:32])
    assert ("decoder.layers.0.self_attention.q_layernorm.weight" in meg) == d["use_qk_norm"]
    assert ("output_layer.weight" in meg) == (not d["tie_word_embeddings"])
    back = dict(megatron_to_hf(meg.items(), ckpt))
    assert set(back) == set(hf) - mtp and all(torch.equal(back[k], hf[k]) for k in back)


def test_mtp_list_is_exact(ckpt):
    hf = disk(ckpt)
    with pytest.raises(KeyError, match="unused HF tensors.*model.layers.2.mlp.gate.stray"):
        hf_to_megatron({**hf, "model.layers.2.mlp.gate.stray": torch.zeros(4)}, ckpt)
    with pytest.raises(KeyError, match="unused HF tensors.*model.layers.3.enorm"):  # past the MTP layers
        hf_to_megatron({**hf, "model.layers.3.enorm.weight": torch.zeros(64)}, ckpt)
    d = hf_config_dict(ckpt)
    with pytest.raises(KeyError, match="unused HF tensors.*model.layers.2.eh_proj"):  # no MTP layer declared
        hf_to_megatron(hf, {**d, "num_nextn_predict_layers": 0})
    no_mtp = {k: v for k, v in hf.items() if not k.startswith("model.layers.2.")}
    assert set(hf_to_megatron(no_mtp, ckpt)) == set(hf_to_megatron(hf, ckpt))  # MTP block optional


def test_loud_on_unused_and_unset(ckpt):
    hf = disk(ckpt)
    with pytest.raises(KeyError, match="unused"):
        hf_to_megatron({**hf, "model.layers.0.mlp.gate.e_score_correction_bias": torch.zeros(4)}, ckpt)
    check_expert_bias_required(hf, ckpt, hf_layer=1, megatron_layer=1)


def test_in_memory_fused_layout(ckpt):
    from transformers import Glm4MoeForCausalLM

    check_in_memory_fused_layout(Glm4MoeForCausalLM, ckpt)


def test_experts_from_n_routed_experts_never_num_experts(ckpt):
    d = hf_config_dict(ckpt)
    assert get_family(FAM).arch_args({**d, "num_experts": 4}).num_experts == 4  # equal: fine
    for other in ("num_experts", "num_local_experts"):
        with pytest.raises(ValueError, match=f"n_routed_experts=8 and {other}=256"):
            get_family(FAM).arch_args({**d, "n_routed_experts": 8, other: 256})


def test_partial_rotary_factor_read(ckpt):
    d = hf_config_dict(ckpt)
    fam = get_family(FAM)
    assert fam.arch_args(d).rotary_percent == 0.5
    rp = {k: v for k, v in d["rope_parameters"].items() if k != "partial_rotary_factor"}
    assert fam.arch_args({**d, "rope_parameters": rp}).rotary_percent == 0.5  # transformers' default
    assert fam.arch_args({**d, "rope_parameters": rp, "partial_rotary_factor": 0.25}).rotary_percent == 0.25
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        fam.arch_args({**d, "partial_rotary_factor": 0.25})  # disagrees with rope_parameters
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        fam.arch_args({**d, "rope_parameters": {**rp, "partial_rotary_factor": 0.3}})  # 4.8 dims


@pytest.mark.parametrize(
    "field,bad",
    [
        ("rope_parameters", {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0}),
        ("norm_topk_prob", False),
        ("hidden_act", "gelu"),
        ("first_k_dense_replace", 2),
        ("n_group", 3),  # 4 experts not divisible
        ("topk_group", 1),  # with n_group 2 below: top-2 // 1 = 2 is fine, so use n_group 4
    ],
)
def test_unsupported_fields_rejected(ckpt, field, bad):
    d = hf_config_dict(ckpt)
    if field == "topk_group":
        d = {**d, "n_group": 2, "num_experts_per_tok": 4}  # Megatron would score groups by their top-4
    with pytest.raises(ValueError, match=field if field != "rope_parameters" else "rope_type"):
        get_family(FAM).arch_args({**d, field: bad})


def test_megatron_config(ckpt):
    pytest.importorskip("megatron.core")
    fam = get_family(FAM)
    d = hf_config_dict(ckpt)
    c = fam.transformer_config(d)
    assert type(c).__name__ == "TransformerConfig" and not c.multi_latent_attention
    assert (c.num_attention_heads, c.num_query_groups, c.kv_channels) == (4, 2, 16)
    assert c.add_qkv_bias == d["attention_bias"] and not c.add_bias_linear
    assert c.qk_layernorm == d["use_qk_norm"]
    assert c.moe_layer_freq == [0, 1] and c.ffn_hidden_size == 96 and c.moe_ffn_hidden_size == 32
    assert c.num_moe_experts == 4 and c.moe_router_topk == 2 and c.moe_shared_expert_intermediate_size == 32
    assert c.moe_router_score_function == "sigmoid" and c.moe_router_enable_expert_bias
    assert c.moe_router_dtype == "fp32" and c.moe_router_bias_update_rate == 0.0
    assert c.moe_router_num_groups is None and c.moe_router_group_topk is None  # 1 group: no limit
    assert c.moe_router_topk_scaling_factor == 2.5
    assert fam.gpt_model_kwargs(d)["rotary_percent"] == 0.5
