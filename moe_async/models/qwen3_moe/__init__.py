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
_X = _L + "mlp.experts.{e}."

QWEN3_MOE_RULES: list[Rule] = [
    EMBEDDING_RULE,
    *gqa_attention_rules(qk_norm=True),
    Rule(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), scope="layer"),
    Rule(
        _M + "mlp.experts.local_experts.{e}.linear_fc1.weight",
        (_X + "gate_proj.weight", _X + "up_proj.weight"),
        fuse=cat_rows,
        split=split_rows_2,
        scope="expert",
    ),
    Rule(_M + "mlp.experts.local_experts.{e}.linear_fc2.weight", (_X + "down_proj.weight",), scope="expert"),
    *FINAL_RULES,
]


class Qwen3MoeFamily(ModelFamily):
    model_types = ("qwen3_moe",)

    def arch_args(self, hf_config: Any) -> ArchArgs:
        d = hf_config_dict(hf_config)
        if d.get("model_type") not in self.model_types:
            raise ValueError(f"not a Qwen3-MoE config: model_type={d.get('model_type')!r}")
        reject_fields(
            d,
            {
                "use_sliding_window": False,
                "hidden_act": "silu",
                "attention_bias": False,
                "decoder_sparse_step": 1,
                "mlp_only_layers": lambda v: not v,
                "shared_expert_intermediate_size": lambda v: not v,
            },
        )
        nh, h = d["num_attention_heads"], d["hidden_size"]
        ng = d.get("num_key_value_heads") or nh
        if nh % ng:
            raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
        n_exp = d.get("num_experts", d.get("num_local_experts"))
        if not n_exp:
            raise ValueError("qwen3_moe config without num_experts / num_local_experts")
        return ArchArgs(
            model_type=d["model_type"],
            vocab_size=d["vocab_size"],
            hidden_size=h,
            intermediate_size=d["moe_intermediate_size"],
            num_layers=d["num_hidden_layers"],
            num_attention_heads=nh,
            num_key_value_heads=ng,
            head_dim=d.get("head_dim") or h // nh,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=read_rope_theta(d),
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            num_experts=int(n_exp),
            top_k=d["num_experts_per_tok"],
        )

    def rules(self) -> list[Rule]:
        return QWEN3_MOE_RULES

    def transformer_config(self, hf_config: Any, **kw: Any):
        """Mixtral's settings plus ``qk_layernorm=True`` and the router's softmax placement
        from ``norm_topk_prob`` (see the module docstring)."""
        d = hf_config_dict(hf_config)
        kw.setdefault("qk_layernorm", True)
        kw.setdefault("moe_router_pre_softmax", not bool(d.get("norm_topk_prob", False)))
        return super().transformer_config(hf_config, **kw)

    def layer_spec(self, hf_config: Any, *, use_te: bool = False):
        """Local (or TE) GPT layer spec with qk-layernorm."""
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        a = self.arch_args(hf_config)
        if use_te:
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=a.num_experts, moe_grouped_gemm=False, qk_layernorm=True
            )
        return get_gpt_layer_local_spec(
            num_experts=a.num_experts, moe_grouped_gemm=False, qk_layernorm=True, normalization="RMSNorm"
        )

    def normalize_hf_state(self, hf_state: Mapping[str, torch.Tensor], a: ArchArgs) -> dict[str, torch.Tensor]:
        """Accept transformers' in-memory layout too: ``mlp.experts.gate_up_proj`` [E,2I,H]
        (gate rows first) and ``mlp.experts.down_proj`` [E,H,I] are rewritten to the
        per-expert on-disk names."""
        out = dict(hf_state)
        for i in range(a.num_layers):
            pre = f"model.layers.{i}.mlp.experts."
            moves = {}
            gu = out.pop(pre + "gate_up_proj", None)
            if gu is not None:
                inter = gu.shape[1] // 2
                for e in range(gu.shape[0]):
                    moves[pre + f"{e}.gate_proj.weight"] = gu[e, :inter]
                    moves[pre + f"{e}.up_proj.weight"] = gu[e, inter:]
            dn = out.pop(pre + "down_proj", None)
            if dn is not None:
                for e in range(dn.shape[0]):
                    moves[pre + f"{e}.down_proj.weight"] = dn[e]
            for k, v in moves.items():
                if k in out:
                    raise ValueError(f"HF state gives {k!r} in both the fused and the per-expert layout")
                out[k] = v
        return out


QWEN3_MOE = register_family(Qwen3MoeFamily())
