"""Qwen3-MoE family (HF ``model_type="qwen3_moe"``): config reading and parameter mapping.

GQA with per-head q/k RMSNorm, every layer MoE, no shared expert, softmax router with top-k
renormalised iff ``norm_topk_prob`` (mapped to Megatron's ``moe_router_pre_softmax``).

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

from moe_async.models.family import MegatronKwargs, ModelFamily, gqa_decoder_rules, moe_mlp_rules, register_family
from moe_async.models.mapping import Rule
from moe_async.types import JsonDict

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

    def moe_args(self, d: JsonDict) -> JsonDict:
        """Raises ValueError when neither ``num_experts`` nor ``num_local_experts`` is set."""
        n_exp = d.get("num_experts", d.get("num_local_experts"))
        if not n_exp:
            raise ValueError("qwen3_moe config without num_experts / num_local_experts")
        return dict(num_experts=int(n_exp), top_k=d["num_experts_per_tok"])

    def rules(self) -> list[Rule]:
        return QWEN3_MOE_RULES

    def config_from_hf(self, d: JsonDict) -> MegatronKwargs:
        """Mixtral's settings plus the router's softmax placement from ``norm_topk_prob``
        (``qk_layernorm`` is the family's; design notes: ``docs/design/models.md``)."""
        return {"moe_router_pre_softmax": not bool(d.get("norm_topk_prob", False))}


QWEN3_MOE = register_family(Qwen3MoeFamily())
