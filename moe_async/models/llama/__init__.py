"""Llama family (HF ``model_type="llama"``, dense): config reading and parameter mapping.

Same as Mixtral's table except the dense MLP: Megatron ``mlp.linear_fc1.weight`` [2I,H] =
``[mlp.gate_proj; mlp.up_proj]``, ``mlp.linear_fc2.weight`` = ``mlp.down_proj``, and
``mlp.pre_mlp_layernorm`` is folded by the local spec into ``pre_mlp_layernorm``.
"""

from __future__ import annotations

from typing import Any

from moe_async.models.family import (
    ArchArgs,
    EMBEDDING_RULE,
    FINAL_RULES,
    ModelFamily,
    hf_config_dict,
    gqa_attention_rules,
    read_rope_theta,
    register_family,
    reject_fields,
)
from moe_async.models.mapping import Rule, cat_rows, split_rows_2

_L = "model.layers.{i}."
_M = "decoder.layers.{i}."

LLAMA_RULES: list[Rule] = [
    EMBEDDING_RULE,
    *gqa_attention_rules(),
    Rule(
        _M + "mlp.linear_fc1.weight",
        (_L + "mlp.gate_proj.weight", _L + "mlp.up_proj.weight"),
        fuse=cat_rows,
        split=split_rows_2,
        scope="layer",
    ),
    Rule(_M + "mlp.linear_fc2.weight", (_L + "mlp.down_proj.weight",), scope="layer"),
    *FINAL_RULES,
]


class LlamaFamily(ModelFamily):
    model_types = ("llama",)

    def arch_args(self, hf_config: Any) -> ArchArgs:
        d = hf_config_dict(hf_config)
        if d.get("model_type") not in self.model_types:
            raise ValueError(f"not a Llama config: model_type={d.get('model_type')!r}")
        reject_fields(
            d,
            {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "pretraining_tp": 1},
        )
        nh, h = d["num_attention_heads"], d["hidden_size"]
        ng = d.get("num_key_value_heads") or nh
        if nh % ng:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
        return ArchArgs(
            model_type=d["model_type"],
            vocab_size=d["vocab_size"],
            hidden_size=h,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=ng,
            head_dim=d.get("head_dim") or h // nh,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=read_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
        )

    def rules(self) -> list[Rule]:
        return LLAMA_RULES


LLAMA = register_family(LlamaFamily())
