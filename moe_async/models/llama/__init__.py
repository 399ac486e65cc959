"""Llama family (HF ``model_type="llama"``, dense): config reading and parameter mapping.

Same as Mixtral's table except the dense MLP: Megatron ``mlp.linear_fc1.weight`` [2I,H] =
``[mlp.gate_proj; mlp.up_proj]``, ``mlp.linear_fc2.weight`` = ``mlp.down_proj``, and
``mlp.pre_mlp_layernorm`` is folded by the local spec into ``pre_mlp_layernorm``.
"""

from __future__ import annotations

from moe_async.models.family import HF_LAYER, MG_LAYER, ModelFamily, gqa_decoder_rules, register_family
from moe_async.models.mapping import Rule, gated_mlp_rules

LLAMA_RULES: list[Rule] = gqa_decoder_rules(
    gated_mlp_rules(MG_LAYER + "mlp.", HF_LAYER + "mlp.", ("gate_proj", "up_proj", "down_proj"), scope="layer")
)


class LlamaFamily(ModelFamily):
    model_types = ("llama",)
    display_name = "Llama"
    unsupported_fields = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}
    default_max_position_embeddings = 2048

    def rules(self) -> list[Rule]:
        return LLAMA_RULES


LLAMA = register_family(LlamaFamily())
