"""Mixtral family (HF ``model_type="mixtral"``): config reading and parameter mapping.

HF on-disk names (transformers 5.23 ``save_pretrained``) <-> Megatron (local spec,
SequentialMLP experts). Shapes: ``H`` hidden, ``I`` expert FFN width, ``E`` experts,
``nh``/``ng`` query/KV heads, ``d`` head dim, ``V`` vocab.

| Megatron                                                    | HF                                                      |
| ----------------------------------------------------------- | ------------------------------------------------------- |
| embedding.word_embeddings.weight [V,H]                      | model.embed_tokens.weight                               |
| decoder.layers.{i}.input_layernorm.weight [H]               | model.layers.{i}.input_layernorm.weight                 |
| decoder.layers.{i}.self_attention.linear_qkv.weight         | self_attn.{q,k,v}_proj.weight (per group [q..; k; v])   |
| decoder.layers.{i}.self_attention.linear_proj.weight [H,nh*d]| self_attn.o_proj.weight                                |
| decoder.layers.{i}.pre_mlp_layernorm.weight [H]             | model.layers.{i}.post_attention_layernorm.weight        |
| decoder.layers.{i}.mlp.router.weight [E,H]                  | model.layers.{i}.block_sparse_moe.gate.weight           |
| ...mlp.experts.local_experts.{e}.linear_fc1.weight [2I,H]   | block_sparse_moe.experts.{e}.w1 (gate) ; .w3 (up)       |
| ...mlp.experts.local_experts.{e}.linear_fc2.weight [H,I]    | block_sparse_moe.experts.{e}.w2.weight (down)           |
| decoder.final_layernorm.weight [H]                          | model.norm.weight                                       |
| output_layer.weight [V,H] (absent when tied)                | lm_head.weight (absent when tied)                       |
"""

from __future__ import annotations

from typing import Any, Mapping

from moe_async.models.family import ModelFamily, gqa_decoder_rules, moe_mlp_rules, register_family
from moe_async.models.mapping import Rule

MIXTRAL_RULES: list[Rule] = gqa_decoder_rules(
    moe_mlp_rules("block_sparse_moe.gate.weight", "block_sparse_moe.experts.{e}.", ("w1", "w3", "w2"))
)


class MixtralFamily(ModelFamily):
    """Also reads transformers' in-memory layout: ``mlp.gate.weight`` [E,H],
    ``mlp.experts.gate_up_proj`` [E,2I,H] (gate rows first) and ``mlp.experts.down_proj``
    [E,H,I] are rewritten to the per-expert on-disk names."""

    model_types = ("mixtral",)
    display_name = "Mixtral"
    unsupported_fields = {
        "sliding_window": None,
        "hidden_act": "silu",
        "router_jitter_noise": (None, 0.0),
        "attention_bias": False,
        "mlp_bias": False,
    }
    default_rms_norm_eps = 1e-5
    fused_expert_names = (
        "block_sparse_moe.experts.{e}.w1.weight",
        "block_sparse_moe.experts.{e}.w3.weight",
        "block_sparse_moe.experts.{e}.w2.weight",
    )
    in_memory_renames = {"mlp.gate.weight": "block_sparse_moe.gate.weight"}

    def moe_args(self, d: Mapping[str, Any]) -> dict[str, Any]:
        return dict(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"])

    def rules(self) -> list[Rule]:
        return MIXTRAL_RULES


MIXTRAL = register_family(MixtralFamily())
