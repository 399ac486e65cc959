"""qwen3_moe mapping: HF -> Megatron -> HF bit-exact (on-disk and in-memory fused layouts),
config rejection naming the field, router softmax placement from norm_topk_prob."""

from __future__ import annotations

import os

import pytest
import torch

from _tiny import make_tiny_qwen3_moe
from moe_async.models import get_family, hf_config_dict, hf_to_megatron, megatron_to_hf


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_qwen3_moe(str(tmp_path_factory.mktemp("q3")))


def test_round_trip_bit_exact(ckpt):
    from safetensors.torch import load_file

    hf = load_file(os.path.join(ckpt, "model.safetensors"))
    meg = hf_to_megatron(hf, ckpt)
    assert meg["decoder.layers.1.self_attention.q_layernorm.weight"].shape == (32,)
    assert meg["decoder.layers.0.mlp.experts.local_experts.3.linear_fc1.weight"].shape == (192, 64)
    assert meg["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((2 + 2) * 2 * 32, 64)
    back = dict(megatron_to_hf(meg.items(), ckpt))
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


def test_in_memory_fused_layout(ckpt):
    from transformers import Qwen3MoeForCausalLM

    m = Qwen3MoeForCausalLM.from_pretrained(ckpt)
    sd = {k: v.detach() for k, v in m.state_dict().items()}
    from safetensors.torch import load_file

    disk = load_file(os.path.join(ckpt, "model.safetensors"))
    a, b = hf_to_megatron(sd, ckpt), hf_to_megatron(disk, ckpt)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_unsupported_fields_rejected(ckpt):
    fam = get_family("qwen3_moe")
    d = hf_config_dict(ckpt)
    for field, bad in (("use_sliding_window", True), ("mlp_only_layers", [1]), ("decoder_sparse_step", 2),
                       ("hidden_act", "gelu")):
        with pytest.raises(ValueError, match=field):
            fam.arch_args({**d, field: bad})
    # a field with several supported values: the message lists them (no predicate repr)
    with pytest.raises(ValueError) as e:
        fam.arch_args({**d, "shared_expert_intermediate_size": 64})
    assert str(e.value) == ("unsupported HF config field shared_expert_intermediate_size=64 "
                            "(supported: one of None, 0)")
    for field, ok in (("mlp_only_layers", None), ("mlp_only_layers", []), ("shared_expert_intermediate_size", 0)):
        assert fam.arch_args({**d, field: ok}) == fam.arch_args(d)


@pytest.mark.parametrize("norm", [True, False])
def test_router_softmax_placement(ckpt, norm):
    pytest.importorskip("megatron.core")
    d = {**hf_config_dict(ckpt), "norm_topk_prob": norm}
    c = get_family("qwen3_moe").transformer_config(d)
    assert c.qk_layernorm is True
    assert c.moe_router_pre_softmax is (not norm)
    assert c.moe_ffn_hidden_size == 96 and c.kv_channels == 32
