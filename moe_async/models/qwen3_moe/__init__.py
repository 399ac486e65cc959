"""Qwen3-MoE family (HF ``model_type="qwen3_moe"``): config reading and parameter mapping.

Architecture: GQA attention with per-head RMSNorm on queries and keys (``q_norm``/``k_norm``
over ``head_dim``, before RoPE), every layer MoE (``decoder_sparse_step=1``, no
``mlp_only_layers``), no shared expert, router = softmax over all experts then top-k, the
k weights renormalised to sum 1 iff ``norm_topk_prob``.

Router mapping to Megatron (``moe_router_score_function="softmax"``):
* ``norm_topk_prob=True``  -> ``moe_router_pre_softmax=False`` (top-k on the logits, softmax
  over the k: equal to softmax-all, top-k, renormalise);
* ``norm_topk_prob=False`` -> ``moe_router_pre_softmax=True`` (softmax over all experts, then
  top-k, no renormalisation).

HF on-disk names (transformers 5.23 ``save_pretrained``) <-> Megatron (local spec with
``qk_layernorm=True``, SequentialMLP experts). ``H`` hidden, ``I`` = ``moe_intermediate_size``,
``E`` experts, ``nh``/``ng`` query/KV heads, ``d`` head dim, ``V`` vocab.

| Megatron                                                     | HF                                                  |
| ------------------------------------------------------------ | --------------------------------------------------- |
| embedding.word_embeddings.weight [V,H]                       | model.embed_tokens.weight                           |
| decoder.layers.{i}.input_layernorm.weight [H]                | model.layers.{i}.input_layernorm.weight             |
| decoder.layers.{i}.self_attention.linear_qkv.weight          | self_attn.{q,k,v}_proj.weight (per group [q..;k;v]) |
| decoder.layers.{i}.self_attention.q_layernorm.weight [d]     | self_attn.q_norm.weight                             |
| decoder.layers.{i}.self_attention.k_layernorm.weight [d]     | self_attn.k_norm.weight                             |
| decoder.layers.{i}.self_attention.linear_proj.weight [H,nh*d]| self_attn.o_proj.weight                             |
| decoder.layers.{i}.pre_mlp_layernorm.weight [H]              | model.layers.{i}.post_attention_layernorm.weight    |
| decoder.layers.{i}.mlp.router.weight [E,H]                   | model.layers.{i}.mlp.gate.weight                    |
| ...mlp.experts.local_experts.{e}.linear_fc1.weight [2I,H]    | mlp.experts.{e}.gate_proj ; .up_proj                |
| ...mlp.experts.local_experts.{e}.linear_fc2.weight [H,I]     | mlp.experts.{e}.down_proj.weight                    |
| decoder.final_layernorm.weight [H]                           | model.norm.weight                                   |
| output_layer.weight [V,H] (absent when tied)                 | lm_head.weight (absent when tied)                   |
"""

from __future__ import annotations

from typing import Any, Mapping

from moe_async.models.family import ModelFamily, gqa_decoder_rules, hf_config_dict, moe_mlp_rules, register_family
from moe_async.models.mapping import Rule

QWEN3_MOE_RULES: list[Rule] = gqa_decoder_rules(
    moe_mlp_rules("mlp.gate.weight", "mlp.experts.{e}.", ("gate_proj", "up_proj", "down_proj")), qk_norm=True
)


class Qwen3MoeFamily(ModelFamily):
    """Also reads transformers' in-memory layout: ``mlp.experts.gate_up_proj`` [E,2I,H]
    (gate rows first) and ``mlp.experts.down_proj`` [E,H,I] are rewritten to the per-expert
    on-disk names."""

    model_types = ("qwen3_moe",)
    display_name = "Qwen3-MoE"
    unsupported_fields = {
        "use_sliding_window": False,
        "hidden_act": "silu",
        "attention_bias": False,
        "decoder_sparse_step": 1,
        "mlp_only_layers": (None, []),
        "shared_expert_intermediate_size": (None, 0),
    }
    intermediate_size_field = "moe_intermediate_size"
    qk_layernorm = True
    fused_expert_names = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                          "mlp.experts.{e}.down_proj.weight")

    def moe_args(self, d: Mapping[str, Any]) -> dict[str, Any]:
        """Raises ValueError when neither ``num_experts`` nor ``num_local_experts`` is set."""
        n_exp = d.get("num_experts", d.get("num_local_experts"))
        if not n_exp:
            raise ValueError("qwen3_moe config without num_experts / num_local_experts")
        return dict(num_experts=int(n_exp), top_k=d["num_experts_per_tok"])

    def rules(self) -> list[Rule]:
        return QWEN3_MOE_RULES

    def transformer_config(self, hf_config: Any, **kw: Any):
        """Mixtral's settings plus ``qk_layernorm=True`` and the router's softmax placement
        from ``norm_topk_prob`` (see the module docstring)."""
        d = hf_config_dict(hf_config)
        kw.setdefault("moe_router_pre_softmax", not bool(d.get("norm_topk_prob", False)))
        return super().transformer_config(hf_config, **kw)


QWEN3_MOE = register_family(Qwen3MoeFamily())
