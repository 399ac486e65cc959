"""Mixtral family (HF ``model_type="mixtral"``): config reading and parameter mapping.

GQA attention, every layer MoE with a softmax top-k router, SequentialMLP experts; HF's
per-expert ``w1``/``w3``/``w2`` map to Megatron's ``linear_fc1`` (gate; up) and ``linear_fc2``.

Design notes: ``docs/design/models.md``."""

from __future__ import annotations


from moe_async.models.family import ModelFamily, gqa_decoder_rules, moe_mlp_rules, register_family
from moe_async.models.mapping import Rule
from moe_async.types import JsonDict

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

    def moe_args(self, d: JsonDict) -> JsonDict:
        return dict(num_experts=d["num_local_experts"], top_k=d["num_experts_per_tok"])

    def rules(self) -> list[Rule]:
        return MIXTRAL_RULES


MIXTRAL = register_family(MixtralFamily())
