"""Case C18: torch_dist key names and Megatron-LM's container, whatever machine writes them.

Unit checks of :mod:`moe_async.megatron.te_spec_names` and :mod:`moe_async.megatron.container`
on key sets, then one process (``_te_names_checks.py``): for every family the converter
(local spec on this CPU) writes exactly the committed golden TE-spec keys
(``te_spec_keys/<family>.json``, see its README for where they come from); for Qwen3-MoE and
DeepSeek-V3 a TE-named checkpoint and an old local-named flat one both load into the CPU
trainer bit-exact, the trainer's own checkpoint has the golden keys, and the converter's
directory is Megatron-LM's container (tracker, ``iter_0000000/``, ``common.pt`` with the
iteration and args).
"""

from __future__ import annotations

import argparse
import json
import os

import pytest
import torch
from _launch import run_json

from moe_async.megatron import container
from moe_async.megatron.te_spec_names import is_te_extra_state, layer_kinds, local_name, te_name

HERE = os.path.dirname(__file__)
GOLDEN = os.path.join(HERE, "te_spec_keys")
FAMILIES = ("mixtral", "qwen3_moe", "llama", "deepseek_v3", "glm4_moe")

# DeepSeek-V3-like: layer 0 dense MLA, layer 1 MoE MLA; per-layer keys (layers differ)
DS_LOCAL = [
    "decoder.layers.0.input_layernorm.weight", "decoder.layers.0.pre_mlp_layernorm.weight",
    "decoder.layers.0.self_attention.q_layernorm.weight", "decoder.layers.0.self_attention.kv_layernorm.weight",
    "decoder.layers.0.self_attention.linear_kv_down_proj.weight", "decoder.layers.0.mlp.linear_fc1.weight",
    "decoder.layers.1.input_layernorm.weight", "decoder.layers.1.pre_mlp_layernorm.weight",
    "decoder.layers.1.self_attention.q_layernorm.weight", "decoder.layers.1.self_attention.kv_layernorm.weight",
    "decoder.layers.1.self_attention.linear_kv_down_proj.weight", "decoder.layers.1.mlp.router.weight",
]
DS_TE = {
    "decoder.layers.0.pre_mlp_layernorm.weight": "decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
    "decoder.layers.0.self_attention.q_layernorm.weight": "decoder.layers.0.self_attention.linear_q_up_proj.layer_norm_weight",
    "decoder.layers.0.self_attention.kv_layernorm.weight": "decoder.layers.0.self_attention.linear_kv_up_proj.layer_norm_weight",
    "decoder.layers.1.self_attention.q_layernorm.weight": "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight",
    "decoder.layers.1.self_attention.kv_layernorm.weight": "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight",
}
# Mixtral-like, stacked layers (local spec's own keys map: input norm already TE-named)
GQA_MOE_LOCAL = ["decoder.layers.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.router.weight",
                 "decoder.layers.self_attention.linear_qkv.weight"]
LLAMA_LOCAL = ["decoder.layers.self_attention.linear_qkv.layer_norm_weight",
               "decoder.layers.mlp.linear_fc1.layer_norm_weight", "decoder.layers.mlp.linear_fc1.weight"]


def test_names_per_layer_kind_and_back():
    kinds = layer_kinds(DS_LOCAL)
    assert kinds == {"decoder.layers.0.": (False, True), "decoder.layers.1.": (True, True)}
    te = {k: te_name(k, kinds) for k in DS_LOCAL}
    assert {k: v for k, v in te.items() if k != v} == DS_TE  # MoE MLA layer keeps pre_mlp_layernorm
    assert all(te_name(v, kinds) == v for v in te.values())  # TE names are fixed points
    assert all(local_name(te[k], kinds) == k for k in DS_LOCAL)  # and map back
    kinds = layer_kinds(GQA_MOE_LOCAL)
    assert te_name("decoder.layers.mlp.linear_fc1.layer_norm_weight", kinds) == "decoder.layers.pre_mlp_layernorm.weight"
    assert te_name("decoder.layers.self_attention.linear_qkv.layer_norm_weight", kinds) == \
        "decoder.layers.self_attention.linear_qkv.layer_norm_weight"
    kinds = layer_kinds(LLAMA_LOCAL)  # dense GQA: the local spec's names are the TE spec's already
    assert [te_name(k, kinds) for k in LLAMA_LOCAL] == LLAMA_LOCAL


def test_extra_state_keys():
    assert is_te_extra_state("decoder.layers.self_attention.core_attention._extra_state/shard_0_2")
    assert is_te_extra_state("decoder.layers.1.mlp.experts.experts.linear_fc1._extra_state/shard_3_8")
    assert is_te_extra_state("output_layer._extra_state")
    assert not is_te_extra_state("decoder.layers.mlp.linear_fc1.weight")
    assert not is_te_extra_state("decoder.layers.my_extra_state_w")


def test_container_resolve_and_tracker(tmp_path):
    flat = tmp_path / "flat"
    flat.mkdir()
    (flat / "metadata.json").write_text("{}")
    assert container.resolve(str(flat)) == str(flat)  # the old flat layout, as it is
    root = tmp_path / "root"
    (root / "iter_0000042").mkdir(parents=True)
    container.write_tracker(str(root), 42)
    assert (root / "latest_checkpointed_iteration.txt").read_text() == "42\n"
    assert container.resolve(str(root)) == str(root / "iter_0000042")
    assert container.resolve(str(root / "iter_0000042")) == str(root / "iter_0000042")
    container.write_tracker(str(root), 7)  # names a missing dir
    with pytest.raises(FileNotFoundError, match=r"latest_checkpointed_iteration\.txt names iteration 7, but .*iter_0000007 does not exist"):
        container.resolve(str(root))
    (root / "iter_0000007").write_text("x")  # a file where the iteration dir should be
    with pytest.raises(FileNotFoundError, match=r"iter_0000007 is a file, not a directory"):
        container.resolve(str(root))
    (root / "iter_0000007").unlink()
    (root / "latest_checkpointed_iteration.txt").write_text("seven")
    with pytest.raises(ValueError, match=r"latest_checkpointed_iteration\.txt \(Megatron-LM checkpoint tracker\) holds 'seven'"):
        container.resolve(str(root))
    (root / "latest_checkpointed_iteration.txt").write_text("release")
    (root / "release").mkdir()
    assert container.resolve(str(root)) == str(root / "release")


def test_link_iteration(tmp_path):
    (tmp_path / "step_3").mkdir()
    (tmp_path / "step_3" / "metadata.json").write_text("{}")
    container.link_iteration(str(tmp_path), "step_3", 3)
    assert os.readlink(tmp_path / "iter_0000003") == "step_3"
    assert container.resolve(str(tmp_path)) == str(tmp_path / "iter_0000003")
    assert (tmp_path / "iter_0000003" / "metadata.json").is_file()
    container.link_iteration(str(tmp_path), "step_3", 3)  # again: replaced, not an error
    assert sorted(os.listdir(tmp_path)) == ["iter_0000003", "latest_checkpointed_iteration.txt", "step_3"]


def test_megatron_lm_args_fields():
    from moe_async.models.family import ArchArgs

    a = ArchArgs("mixtral", 256, 64, 128, 2, 4, 2, 16, 1e-5, 1e6, 4096, False, 4, 2)
    ns = container.megatron_lm_args(a, tp=2, pp=1, ep=2, padded_vocab_size=512, vocab_div=128, params_dtype="bf16",
                                    world=4, iteration=5)
    assert isinstance(ns, argparse.Namespace)
    want = dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
                group_query_attention=True, kv_channels=16, max_position_embeddings=4096,
                add_position_embedding=False, padded_vocab_size=512, make_vocab_size_divisible_by=128,
                tensor_model_parallel_size=2, pipeline_model_parallel_size=1, expert_model_parallel_size=2,
                data_parallel_size=2, num_experts=4, moe_router_topk=2, bf16=True, ckpt_format="torch_dist",
                untie_embeddings_and_output_weights=True, iteration=5)
    assert {k: getattr(ns, k) for k in want} == want
    assert container.common_state(5, ns) == {"args": ns, "checkpoint_version": 3.0, "iteration": 5}


# what Megatron-Bridge's MLM-compat loader (load_megatron_model on a Megatron-LM iteration dir,
# megatron/bridge/training/mlm_compat/arguments.py, _transformer_config_from_args) reads from
# `args` by attribute, besides the TransformerConfig fields it copies by name
BRIDGE_READS = ("multi_latent_attention", "heterogeneous_layers_config_path", "no_persist_layer_norm",
                "apply_layernorm_1p", "norm_epsilon", "params_dtype", "overlap_p2p_comm", "num_experts",
                "rotary_interleaved", "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
                "fp8_param_gather", "swiglu", "bias_swiglu_fusion", "squared_relu", "init_method_xavier_uniform",
                "group_query_attention", "num_query_groups", "config_logger_dir", "cp_comm_type", "is_hybrid_model",
                # and its GPT provider (mlm_compat/model.py, _gpt_provider)
                "transformer_impl", "moe_grouped_gemm", "qk_layernorm", "qk_l2_norm", "normalization",
                "mtp_num_layers", "padded_vocab_size", "max_position_embeddings", "fp16_lm_cross_entropy",
                "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_percent", "rotary_base",
                "use_rope_scaling", "init_model_with_meta_device", "bf16", "fp16")


@pytest.mark.parametrize("name", ("qwen3_moe", "deepseek_v3"))
def test_args_give_megatron_bridge_the_model_config(tmp_path, name):
    """Bridge's MLM-compat path, re-enacted: every attribute it reads is there, and the
    TransformerConfig it builds (fields copied by name, then its overrides) has the family's
    architecture (the config the trainer builds its model from)."""
    import dataclasses
    import sys

    sys.path.insert(0, HERE)
    from _tiny import make_tiny_qwen3_moe
    from _tiny_deepseek_v3 import make_tiny_deepseek_v3
    from megatron.core.transformer import MLATransformerConfig, TransformerConfig

    from moe_async.models import get_family, hf_config_dict

    path = {"qwen3_moe": make_tiny_qwen3_moe, "deepseek_v3": make_tiny_deepseek_v3}[name](str(tmp_path / name))
    fam = get_family(name)
    a = fam.arch_args(hf_config_dict(path))
    ns = container.megatron_lm_args(a, tp=1, pp=1, ep=1, padded_vocab_size=256, vocab_div=128, params_dtype="fp32",
                                    world=1, iteration=0, extra=container.family_config_args(fam, a))
    assert [k for k in BRIDGE_READS if not hasattr(ns, k)] == []
    cls = MLATransformerConfig if ns.multi_latent_attention else TransformerConfig
    kw = {f.name: getattr(ns, f.name) for f in dataclasses.fields(cls) if hasattr(ns, f.name)}
    kw.update(layernorm_epsilon=ns.norm_epsilon, num_moe_experts=ns.num_experts, gated_linear_unit=ns.swiglu,
              num_query_groups=ns.num_query_groups if ns.group_query_attention else None)
    cfg = cls(**kw)
    want = fam.model_config_kwargs(a, moe_aux_loss_coeff=0.0)
    assert {k: getattr(cfg, k) for k in want if k != "moe_aux_loss_coeff"} == \
        {k: v for k, v in want.items() if k != "moe_aux_loss_coeff"}
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_attention_heads) == (a.num_layers, a.hidden_size,
                                                                          a.num_attention_heads)
    assert cfg.normalization == "RMSNorm" and cfg.gated_linear_unit and cfg.add_bias_linear is False


@pytest.fixture(scope="module")
def res(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("te_names"))
    return run_json(os.path.join(HERE, "_te_names_checks.py"), tmp, timeout=900)


def golden(name: str) -> dict:
    with open(os.path.join(GOLDEN, f"{name}.json")) as f:
        return json.load(f)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")
@pytest.mark.parametrize("name", FAMILIES)
def test_converted_checkpoint_has_exactly_the_te_spec_keys(res, name):
    assert res["keys"][name] == golden(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")
@pytest.mark.parametrize("name", ("qwen3_moe", "deepseek_v3"))
def test_c18_either_spec_loads_bit_exact(res, name):
    r = res["trainer"][name]
    assert r["before"]["differ"]  # the trainer started from other weights
    for k in ("te_into_local", "old_into_local", "old_to_hf"):
        assert r[k]["names_equal"] and r[k]["differ"] == [] and r[k]["n"] > 10, (k, r[k])
    old = res["old_keys"][name]
    assert set(old) != set(golden(name))  # the old checkpoint really has the local names
    assert sorted(old.values()) == sorted(golden(name).values())  # the same tensors under them
    if name == "qwen3_moe":
        assert "decoder.layers.mlp.linear_fc1.layer_norm_weight" in old
        assert "decoder.layers.pre_mlp_layernorm.weight" in golden(name)
    else:
        assert "decoder.layers.1.self_attention.q_layernorm.weight" in old
        assert "decoder.layers.1.self_attention.linear_q_up_proj.layer_norm_weight" in golden(name)
        assert "decoder.layers.1.self_attention.linear_kv_up_proj.layer_norm_weight" in golden(name)
        assert "decoder.layers.1.pre_mlp_layernorm.weight" in golden(name)  # MoE layer
        assert "decoder.layers.0.mlp.linear_fc1.layer_norm_weight" in golden(name)  # dense layer
    if name == "qwen3_moe":  # with a TE-only module's _extra_state object in it, too
        assert r["te_extra_saved"] and r["te_extra_into_local"]["differ"] == [], r["te_extra_into_local"]
    assert r["trainer_keys"] == golden(name)  # the trainer's own checkpoint: TE names too
    assert r["trainer_common"] == {"iteration": 0, "num_layers": 2 if name == "qwen3_moe" else 3}


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU/gloo checks")
@pytest.mark.parametrize("name", ("qwen3_moe", "deepseek_v3"))
def test_c18_converter_writes_megatron_lm_container(res, name):
    c = res["container"][name]
    assert c["root_files"] == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    assert c["tracker"] == "0\n"
    assert {"common.pt", ".metadata", "metadata.json", "__0_0.distcp"} <= set(c["iter_files"])
    assert c["iteration"] == 0 and c["checkpoint_version"] == 3.0
    a = c["args"]
    assert a["num_layers"] == (2 if name == "qwen3_moe" else 3) and a["hidden_size"] == 64
    assert a["add_position_embedding"] is False and a["ckpt_format"] == "torch_dist"
    assert a["tensor_model_parallel_size"] == 1 and a["pipeline_model_parallel_size"] == 1
    assert a["padded_vocab_size"] == golden(name)["embedding.word_embeddings.weight"][0]
    assert a["multi_latent_attention"] is (name == "deepseek_v3")
