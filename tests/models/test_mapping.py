"""HF <-> Megatron mapping: bit-exact round trips and loud failures (cases.md C3)."""

from __future__ import annotations

import json

import pytest
import torch
from _tiny import make_tiny_mixtral
from safetensors.torch import load_file

from moe_async.models import get_family, hf_config_dict, hf_to_megatron, megatron_to_hf, tensor_checksum


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def ckpt(request, tmp_path_factory):
    p = make_tiny_mixtral(str(tmp_path_factory.mktemp("mix")), tie=request.param)
    return p, json.load(open(f"{p}/config.json")), load_file(f"{p}/model.safetensors")


def test_round_trip_bit_exact(ckpt):
    _, cfg, sd = ckpt
    meg = hf_to_megatron(sd, cfg)
    assert ("output_layer.weight" in meg) == (not cfg["tie_word_embeddings"])
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == (64 + 2 * 32, 64)
    assert meg["decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (256, 64)
    back = dict(megatron_to_hf(meg.items(), cfg))
    assert set(back) == set(sd)
    for k in sd:
        assert back[k].dtype == sd[k].dtype and torch.equal(back[k], sd[k]), k
    assert set(get_family("mixtral").hf_keys(cfg)) == set(sd)


def test_qkv_interleave_layout(ckpt):
    _, cfg, sd = ckpt
    qkv = hf_to_megatron(sd, cfg)["decoder.layers.0.self_attention.linear_qkv.weight"]
    q, k, v = (sd[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    d = 16  # head_dim; 4 q heads, 2 groups -> per group [q0 q1 k v]
    assert torch.equal(qkv[: 2 * d], q[: 2 * d])
    assert torch.equal(qkv[2 * d : 3 * d], k[:d])
    assert torch.equal(qkv[3 * d : 4 * d], v[:d])
    assert torch.equal(qkv[4 * d : 6 * d], q[2 * d :])


def test_in_memory_fused_layout_accepted(ckpt):
    path, cfg, sd = ckpt
    from transformers import MixtralForCausalLM

    mem = MixtralForCausalLM.from_pretrained(path).state_dict()
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in mem)
    a, b = hf_to_megatron(mem, cfg), hf_to_megatron(sd, cfg)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_extra_hf_key_raises(ckpt):
    _, cfg, sd = ckpt
    bad = dict(sd, **{"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(8)})
    with pytest.raises(KeyError, match="rotary_emb.inv_freq"):
        hf_to_megatron(bad, cfg)


def test_missing_hf_key_raises(ckpt):
    _, cfg, sd = ckpt
    bad = {k: v for k, v in sd.items() if k != "model.layers.1.block_sparse_moe.experts.2.w3.weight"}
    with pytest.raises(KeyError, match="experts.2.w3"):
        hf_to_megatron(bad, cfg)


def test_megatron_side_raises(ckpt):
    _, cfg, sd = ckpt
    meg = hf_to_megatron(sd, cfg)
    with pytest.raises(KeyError, match="bogus"):
        list(megatron_to_hf([*meg.items(), ("decoder.layers.0.bogus.weight", torch.zeros(1))], cfg))
    part = [(k, v) for k, v in meg.items() if "local_experts.1." not in k]
    with pytest.raises(KeyError, match="experts.1.w1"):
        list(megatron_to_hf(part, cfg))


def test_te_spec_names_accepted(ckpt):
    _, cfg, sd = ckpt
    meg = hf_to_megatron(sd, cfg)
    te = {
        k.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"): v
        for k, v in meg.items()
    }
    back = dict(megatron_to_hf(te.items(), cfg))
    assert all(torch.equal(back[k], sd[k]) for k in sd)


def test_unsupported_fields_rejected(ckpt):
    _, cfg, _ = ckpt
    fam = get_family("mixtral")
    with pytest.raises(ValueError, match="sliding_window"):
        fam.arch_args(dict(cfg, sliding_window=4096))
    with pytest.raises(ValueError, match="rope_parameters.rope_type='dynamic'"):
        fam.arch_args(dict(cfg, rope_parameters={"rope_type": "dynamic", "rope_theta": 1e4, "factor": 4}))
    with pytest.raises(ValueError, match="rope_parameters.original_max_position_embeddings"):  # YaRN needs it
        fam.arch_args(dict(cfg, rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4}))
    with pytest.raises(ValueError, match="qwen9"):
        get_family("qwen9")
    with pytest.raises(ValueError):
        get_family("Mixtral")  # exact key only


def test_transformer_config_fields(ckpt):
    _, cfg, _ = ckpt
    tc = get_family("mixtral").transformer_config(cfg, moe_aux_loss_coeff=0.01)
    assert tc.num_query_groups == 2 and tc.kv_channels == 16 and tc.layernorm_epsilon == 1e-5
    assert tc.gated_linear_unit and tc.normalization == "RMSNorm" and not tc.add_bias_linear
    assert tc.num_moe_experts == 4 and tc.moe_router_topk == 2 and not tc.moe_router_pre_softmax
    assert tc.moe_aux_loss_coeff == 0.01 and tc.moe_token_dispatcher_type == "alltoall"
    kw = get_family("mixtral").gpt_model_kwargs(cfg)
    assert kw["rotary_base"] == 10000.0 and kw["share_embeddings_and_output_weights"] == cfg["tie_word_embeddings"]
    assert get_family("mixtral").arch_args({**cfg, "rope_parameters": None, "rope_theta": 5e5}).rope_theta == 5e5


def test_llama_dense_round_trip(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    LlamaForCausalLM(c).save_pretrained(tmp_path)
    sd = load_file(tmp_path / "model.safetensors")
    cfg = hf_config_dict(str(tmp_path))
    back = dict(megatron_to_hf(hf_to_megatron(sd, cfg).items(), cfg))
    assert set(back) == set(sd) and all(torch.equal(back[k], sd[k]) for k in sd)


def test_tensor_checksum():
    t = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    assert tensor_checksum(t) == tensor_checksum(t.t().contiguous().t())
    assert tensor_checksum(t.to(torch.bfloat16)) == tensor_checksum(t)
    assert tensor_checksum(t) != tensor_checksum(t + 1e-6)
