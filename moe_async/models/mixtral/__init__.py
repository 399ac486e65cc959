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

import torch

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
_X = _L + "block_sparse_moe.experts.{e}."

MIXTRAL_RULES: list[Rule] = [
    EMBEDDING_RULE,
    *gqa_attention_rules(),
    Rule(_M + "mlp.router.weight", (_L + "block_sparse_moe.gate.weight",), scope="layer"),
    Rule(
        _M + "mlp.experts.local_experts.{e}.linear_fc1.weight",
        (_X + "w1.weight", _X + "w3.weight"),
        fuse=cat_rows,
        split=split_rows_2,
        scope="expert",
    ),
    Rule(_M + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_X + "w2.weight",), scope="expert"),
    *FINAL_RULES,
]


class MixtralFamily(ModelFamily):
    model_types = ("mixtral",)

    def arch_args(self, hf_config: Any) -> ArchArgs:
        d = hf_config_dict(hf_config)
        if d.get("model_type") not in self.model_types:
            raise ValueError(f"not a Mixtral config: model_type={d.get('model_type')!r}")
        reject_fields(
            d,
            {
                "sliding_window": None,
                "hidden_act": "silu",
                "router_jitter_noise": lambda v: not v,
                "attention_bias": False,
                "mlp_bias": False,
            },
        )
        nh, ng, h = d["num_attention_heads"], d.get("num_key_value_heads") or d["num_attention_heads"], d["hidden_size"]
        if nh % ng:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
        head_dim = d.get("head_dim") or h // nh
        return ArchArgs(
            model_type=d["model_type"],
            vocab_size=d["vocab_size"],
            hidden_size=h,
            intermediate_size=d["intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=ng,
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=read_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_experts=d["num_local_experts"],
            top_k=d["num_experts_per_tok"],
        )

    def rules(self) -> list[Rule]:
        return MIXTRAL_RULES

    def normalize_hf_state(self, hf_state: Mapping[str, torch.Tensor], a: ArchArgs) -> dict[str, torch.Tensor]:
        """Accept transformers' in-memory layout too: ``mlp.gate.weight`` [E,H],
        ``mlp.experts.gate_up_proj`` [E,2I,H] (gate rows first) and ``mlp.experts.down_proj``
        [E,H,I] are rewritten to the per-expert on-disk names."""
        out = dict(hf_state)
        for i in range(a.num_layers):
            pre = f"model.layers.{i}."
            moves = {}
            if pre + "mlp.gate.weight" in out:
                moves[pre + "block_sparse_moe.gate.weight"] = out.pop(pre + "mlp.gate.weight")
            gu = out.pop(pre + "mlp.experts.gate_up_proj", None)
            if gu is not None:
                inter = gu.shape[1] // 2
                for e in range(gu.shape[0]):
                    moves[pre + f"block_sparse_moe.experts.{e}.w1.weight"] = gu[e, :inter]
                    moves[pre + f"block_sparse_moe.experts.{e}.w3.weight"] = gu[e, inter:]
            dn = out.pop(pre + "mlp.experts.down_proj", None)
            if dn is not None:
                for e in range(dn.shape[0]):
                    moves[pre + f"block_sparse_moe.experts.{e}.w2.weight"] = dn[e]
            for k, v in moves.items():
                if k in out:
                    raise ValueError(f"HF state gives {k!r} in both the fused and the per-expert layout")
                out[k] = v
        return out


MIXTRAL = register_family(MixtralFamily())
