"""DeepSeek-V3 family (HF ``model_type="deepseek_v3"``, transformers' ``DeepseekV3ForCausalLM``):
config reading, Megatron ``MLATransformerConfig`` / block spec, and parameter mapping.

Architecture -> Megatron-Core 0.16.1:

* MLA attention (``MLASelfAttention``, local spec ``multi_latent_attention=True`` with
  ``qk_layernorm=True`` so the ``q_a``/``kv_a`` RMSNorms exist). HF and Megatron lay the
  projections out identically (q per head ``[nope; rope]``, ``kv_a`` ``[kv_lora; rope]``, ``kv_b``
  per head ``[k_nope; v]``), so every attention weight maps 1:1. ``rope_interleave=True`` (HF
  default: rotary dims in interleaved pairs) is what Megatron's MLA RoPE does
  (``rope_utils._apply_rotary_pos_emb_bshd(multi_latent_attention=True)`` de-interleaves);
  ``rope_interleave=False`` is mapped by permuting the rope rows of ``q_proj``/``q_b_proj`` and
  ``kv_a_proj_with_mqa`` (see ``_rope_perm``).
* First ``first_k_dense_replace`` layers dense (``intermediate_size``), the rest MoE
  (``moe_layer_freq`` list; ``moe_intermediate_size`` per routed expert, shared experts of
  width ``moe_intermediate_size * n_shared_experts`` -> ``moe_shared_expert_intermediate_size``).
* Router: sigmoid scores in fp32 (``moe_router_dtype="fp32"``), ``e_score_correction_bias``
  -> Megatron's fp32 buffer ``router.expert_bias`` (``moe_router_enable_expert_bias``; used for
  the choice only), group-limited top-k (``n_group``/``topk_group`` ->
  ``moe_router_num_groups``/``moe_router_group_topk``), top-k weights renormalised
  (``norm_topk_prob=True``; Megatron always renormalises sigmoid top-k for k > 1) and scaled by
  ``routed_scaling_factor`` (``moe_router_topk_scaling_factor``).

  Megatron scores a group by the sum of its top ``topk // group_topk`` experts; HF by the sum
  of its top 2. They agree iff ``num_experts_per_tok // topk_group == 2`` (DeepSeek-V3: 8 // 4)
  or every group is selected (``topk_group >= n_group``: no group limit, mapped to none).

* RoPE: plain, or YaRN as released (``rope_scaling`` type ``yarn``, factor 40, ``mscale`` =
  ``mscale_all_dim`` = 1) -> MLA's ``rope_type="yarn"`` (Megatron's ``YarnRotaryEmbedding``: the
  same blended frequencies and cos/sin factor as transformers) with ``rotary_scaling_factor``,
  ``mscale``, ``mscale_all_dim``, ``original_max_position_embeddings``, ``beta_fast/slow``
  (:meth:`moe_async.models.rope.Rope.megatron_yarn`). Both sides also scale the attention
  softmax by ``get_mscale(factor, mscale_all_dim)^2`` (about 1.87 for the release):
  transformers in ``yarn_apply_mscale``, Megatron in ``MultiLatentAttention.softmax_scale``.

Rejected with the field named (never approximated): RoPE types other than default and yarn,
YaRN settings Megatron-Core cannot reproduce (:func:`moe_async.models.rope.read_rope`),
``norm_topk_prob=False``,
``attention_bias``, ``hidden_act`` other than silu, ``pretraining_tp`` != 1, group settings
Megatron cannot reproduce (see above). HF's ``q_a_layernorm``/``kv_a_layernorm`` use a fixed
eps 1e-6 whatever ``rms_norm_eps`` is; the local spec builds Megatron's latent norms so too.
``num_mtp_layers`` is ignored like transformers does (no MTP head is built). A released
checkpoint's MTP layer (``model.layers.{L}.*``, ``num_nextn_predict_layers``) and FP8
``weight_scale_inv`` tensors are taken off before this mapping sees the keys (skipped with a
logged list, resp. dequantized: :mod:`moe_async.models.deepseek_v3.hf_extras`).

HF on-disk names (transformers 5.23 ``save_pretrained``) <-> Megatron (local spec). ``{i}``
layer, ``{e}`` routed expert; ``A`` = ``model.layers.{i}.self_attn.``; ``n`` heads, ``dn``/``dr``/
``dv`` = qk_nope/qk_rope/v head dims, ``rq``/``rkv`` = q/kv lora ranks.

| Megatron (decoder.layers.{i}.)                        | HF                                          |
| ----------------------------------------------------- | ------------------------------------------- |
| input_layernorm.weight [H]                            | model.layers.{i}.input_layernorm.weight     |
| self_attention.linear_q_proj.weight [n(dn+dr),H]      | A q_proj.weight          (q_lora_rank None) |
| self_attention.linear_q_down_proj.weight [rq,H]       | A q_a_proj.weight        (q_lora_rank set)  |
| self_attention.q_layernorm.weight [rq]                | A q_a_layernorm.weight   (q_lora_rank set)  |
| self_attention.linear_q_up_proj.weight [n(dn+dr),rq]  | A q_b_proj.weight        (q_lora_rank set)  |
| self_attention.linear_kv_down_proj.weight [rkv+dr,H]  | A kv_a_proj_with_mqa.weight                 |
| self_attention.kv_layernorm.weight [rkv]              | A kv_a_layernorm.weight                     |
| self_attention.linear_kv_up_proj.weight [n(dn+dv),rkv]| A kv_b_proj.weight                          |
| self_attention.linear_proj.weight [H,n dv]            | A o_proj.weight                             |
| pre_mlp_layernorm.weight [H]                          | post_attention_layernorm.weight             |
| dense: mlp.linear_fc1.weight [2I,H]                   | mlp.gate_proj ; mlp.up_proj                 |
| dense: mlp.linear_fc2.weight [H,I]                    | mlp.down_proj.weight                        |
| moe: mlp.router.weight [E,H]                          | mlp.gate.weight                             |
| moe: mlp.router.expert_bias [E] (fp32 buffer)         | mlp.gate.e_score_correction_bias            |
| moe: mlp.experts.local_experts.{e}.linear_fc1 [2I',H] | mlp.experts.{e}.gate_proj ; .up_proj        |
| moe: mlp.experts.local_experts.{e}.linear_fc2 [H,I']  | mlp.experts.{e}.down_proj.weight            |
| moe: mlp.shared_experts.linear_fc1.weight [2Is,H]     | mlp.shared_experts.gate_proj ; .up_proj     |
| moe: mlp.shared_experts.linear_fc2.weight [H,Is]      | mlp.shared_experts.down_proj.weight         |

plus ``embedding.word_embeddings.weight`` / ``model.embed_tokens.weight``,
``decoder.final_layernorm.weight`` / ``model.norm.weight``, ``output_layer.weight`` /
``lm_head.weight`` (absent when tied).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from moe_async.models.family import (
    EMBEDDING_RULE,
    FINAL_RULES,
    HF_LAYER as _L,
    MG_LAYER as _M,
    ArchArgs,
    decoder_fields,
    register_family,
)
from moe_async.models.mapping import Rule
from moe_async.models.sigmoid_moe import (
    SigmoidMoeArgs,
    SigmoidMoeFamily,
    decoder_block_spec,
    read_sigmoid_moe,
    sigmoid_moe_kwargs,
    sigmoid_moe_rules,
)

_A = _L + "self_attn."
_S = _M + "self_attention."

# rope_interleave=False: HF rotates pairs (j, j + dr/2); Megatron's MLA RoPE always rotates
# pairs (2j, 2j + 1). Megatron's rope rows are HF's interleaved: m[2j] = h[j], m[2j+1] = h[j+dr/2]
# (a row permutation, bit-exact both ways; identity when rope_interleave=True).
def _rope_perm(dr: int) -> torch.Tensor:
    return torch.arange(dr).view(2, dr // 2).t().reshape(-1)


def _q_fuse(ts, a):
    (t,) = ts
    if a.rope_interleave:
        return t
    n, dr = a.num_attention_heads, a.qk_rope_head_dim
    blk = t.reshape(n, a.qk_nope_head_dim + dr, -1)
    blk = torch.cat([blk[:, : a.qk_nope_head_dim], blk[:, a.qk_nope_head_dim :][:, _rope_perm(dr)]], dim=1)
    return blk.reshape(t.shape).contiguous()


def _q_split(t, a):
    if a.rope_interleave:
        return [t]
    n, dr = a.num_attention_heads, a.qk_rope_head_dim
    blk = t.reshape(n, a.qk_nope_head_dim + dr, -1)
    inv = torch.argsort(_rope_perm(dr))
    blk = torch.cat([blk[:, : a.qk_nope_head_dim], blk[:, a.qk_nope_head_dim :][:, inv]], dim=1)
    return [blk.reshape(t.shape).contiguous()]


def _kv_a_fuse(ts, a):
    (t,) = ts
    if a.rope_interleave:
        return t
    r = a.kv_lora_rank
    return torch.cat([t[:r], t[r:][_rope_perm(a.qk_rope_head_dim)]], dim=0).contiguous()


def _kv_a_split(t, a):
    if a.rope_interleave:
        return [t]
    r = a.kv_lora_rank
    return [torch.cat([t[:r], t[r:][torch.argsort(_rope_perm(a.qk_rope_head_dim))]], dim=0).contiguous()]


# scope: "global" | "layer" (every layer) | "dense" (i < first_k_dense_replace) |
# "moe" (the other layers) | "expert" (moe layers x routed experts) | "q_lora" / "q_full"
# (every layer, when q_lora_rank is set / None).
DEEPSEEK_V3_RULES: list[Rule] = [
    EMBEDDING_RULE,
    Rule(_M + "input_layernorm.weight", (_L + "input_layernorm.weight",), scope="layer"),
    Rule(_S + "linear_q_proj.weight", (_A + "q_proj.weight",), fuse=_q_fuse, split=_q_split, scope="q_full"),
    Rule(_S + "linear_q_down_proj.weight", (_A + "q_a_proj.weight",), scope="q_lora"),
    Rule(_S + "q_layernorm.weight", (_A + "q_a_layernorm.weight",), scope="q_lora"),
    Rule(_S + "linear_q_up_proj.weight", (_A + "q_b_proj.weight",), fuse=_q_fuse, split=_q_split, scope="q_lora"),
    Rule(_S + "linear_kv_down_proj.weight", (_A + "kv_a_proj_with_mqa.weight",), fuse=_kv_a_fuse, split=_kv_a_split,
         scope="layer"),
    Rule(_S + "kv_layernorm.weight", (_A + "kv_a_layernorm.weight",), scope="layer"),
    Rule(_S + "linear_kv_up_proj.weight", (_A + "kv_b_proj.weight",), scope="layer"),
    Rule(_S + "linear_proj.weight", (_A + "o_proj.weight",), scope="layer"),
    Rule(_M + "pre_mlp_layernorm.weight", (_L + "post_attention_layernorm.weight",), scope="layer"),
    *sigmoid_moe_rules(),  # dense layers; MoE layers (router, expert bias, experts, shared experts)
    *FINAL_RULES,
]


@dataclass(frozen=True)
class DeepseekV3Args(SigmoidMoeArgs):
    """:class:`SigmoidMoeArgs` plus the MLA fields (``head_dim`` = qk_nope + qk_rope)."""

    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = True


class DeepseekV3Family(SigmoidMoeFamily):
    """DeepSeek-V3: MLA attention, first-k dense layers, sigmoid router with expert bias (see
    the module docstring and :class:`~moe_async.models.sigmoid_moe.SigmoidMoeFamily`)."""

    model_types = ("deepseek_v3",)
    display_name = "DeepSeek-V3"
    rope_in_attention = True  # MLA builds its (YaRN) rotary embedding from the config
    unsupported_fields = {
        "hidden_act": "silu",
        "attention_bias": False,
        "pretraining_tp": (None, 1),
        "norm_topk_prob": True,
        "topk_method": "noaux_tc",  # original DeepSeek remote-code configs
        "scoring_func": "sigmoid",
    }

    def arch_args(self, hf_config: Any) -> DeepseekV3Args:
        """Read and validate a DeepSeek-V3 HF config.

        Raises:
            ValueError: naming an unsupported field (see the module docstring).
            KeyError: a required field is missing.
        """
        d = self.read_hf_config(hf_config)
        return DeepseekV3Args(
            **decoder_fields(d, num_key_value_heads=d["num_attention_heads"],  # MLA: no query groups
                             head_dim=d["qk_nope_head_dim"] + d["qk_rope_head_dim"], rms_norm_eps=1e-6,
                             max_position_embeddings=4096, rope_types=("default", "yarn")),
            q_lora_rank=d.get("q_lora_rank"),
            kv_lora_rank=d["kv_lora_rank"],
            qk_nope_head_dim=d["qk_nope_head_dim"],
            qk_rope_head_dim=d["qk_rope_head_dim"],
            v_head_dim=d["v_head_dim"],
            rope_interleave=bool(d.get("rope_interleave", True)),
            **read_sigmoid_moe(d, "deepseek_v3"),
        )

    def rules(self) -> list[Rule]:
        return DEEPSEEK_V3_RULES

    # ---- mapping -------------------------------------------------------------------------
    def scopes(self, a: ArchArgs) -> dict[str, list[dict[str, int]]]:
        """The layer scopes of :data:`DEEPSEEK_V3_RULES` (see the comment above it)."""
        assert isinstance(a, DeepseekV3Args)
        every = [{"i": i} for i in range(a.num_layers)]
        return {
            "q_lora": every if a.q_lora_rank is not None else [],
            "q_full": every if a.q_lora_rank is None else [],
            **super().scopes(a),
        }

    # ---- Megatron model ------------------------------------------------------------------
    def config_class(self) -> type:
        """``MLATransformerConfig``."""
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        return MLATransformerConfig

    def model_config_kwargs(self, a: ArchArgs, *, moe_aux_loss_coeff: float) -> dict[str, Any]:
        """MLA fields of ``MLATransformerConfig``, then the dense/MoE layer pattern and the
        sigmoid group-limited router (:func:`sigmoid_moe.sigmoid_moe_kwargs`)."""
        assert isinstance(a, DeepseekV3Args) and a.rope is not None
        return dict(
            # MLA
            multi_latent_attention=True,
            q_lora_rank=a.q_lora_rank,
            kv_lora_rank=a.kv_lora_rank,
            qk_head_dim=a.qk_nope_head_dim,
            qk_pos_emb_head_dim=a.qk_rope_head_dim,
            v_head_dim=a.v_head_dim,
            qk_layernorm=True,  # builds the q_a / kv_a RMSNorms of the local MLA spec
            rotary_percent=1.0,
            # rope_type, rotary_base, rotary_scaling_factor, mscale, mscale_all_dim (+ YaRN's range)
            **a.rope.megatron_yarn(),
            **sigmoid_moe_kwargs(a, moe_aux_loss_coeff=moe_aux_loss_coeff),
        )

    def layer_spec(self, hf_config: Any, *, use_te: bool = False, vp_stage: int | None = None):
        """Block spec (dense / MoE layers per ``first_k_dense_replace``), sliced to this
        pipeline stage (parallel state must be initialised when PP > 1) and, with virtual
        pipeline stages (parallel state's VPP world size > 1), to model chunk ``vp_stage`` of
        that stage: layers ``[(vp_stage*PP + p) * L/(PP*VPP), ...)`` (Megatron's
        ``get_gpt_decoder_block_spec`` / ``get_transformer_layer_offset``).

        Raises:
            ValueError: ``vp_stage`` given without virtual pipeline stages, or missing with them.
        """
        block = decoder_block_spec(self, hf_config, use_te=use_te, vp_stage=vp_stage, name="deepseek_v3")
        if not use_te:
            # Megatron 0.16.1's local MLA spec is neither buildable nor exact under TP as is
            # (core attention; q/kv down projections): see moe_async.compat.mla_local_attention
            from moe_async.compat.mla_local_attention import local_mla_submodules, mend_mla_without_te

            mend_mla_without_te()
            for spec in {id(s): s for s in block.layer_specs}.values():
                sub = spec.submodules.self_attention.submodules
                local_mla_submodules(sub)
                # HF's q_a_layernorm / kv_a_layernorm use eps 1e-6 whatever rms_norm_eps is
                sub.q_layernorm = _fixed_eps_norm(sub.q_layernorm, _HF_LATENT_NORM_EPS)
                sub.kv_layernorm = _fixed_eps_norm(sub.kv_layernorm, _HF_LATENT_NORM_EPS)
        return block


_HF_LATENT_NORM_EPS = 1e-6  # transformers DeepseekV3RMSNorm default, used by q_a/kv_a_layernorm


def _fixed_eps_norm(base: type, eps: float) -> type:
    """A norm "class" for a Megatron spec that builds ``base`` with ``eps`` fixed (Megatron's
    MLA passes ``config.layernorm_epsilon`` to its q/kv latent norms)."""

    def __new__(cls, *args, **kw):
        kw["eps"] = eps
        return base(*args, **kw)

    return type(f"FixedEps{getattr(base, '__name__', 'Norm')}", (), {"__new__": __new__})


DEEPSEEK_V3 = register_family(DeepseekV3Family())
