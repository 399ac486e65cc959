"""DeepSeek-V3 family (HF ``model_type="deepseek_v3"``): config reading, Megatron
``MLATransformerConfig`` / block spec, and the HF <-> Megatron parameter mapping.

MLA attention, first dense layers then MoE with shared experts, the fp32 sigmoid router with
expert bias and group-limited top-k, plain or YaRN RoPE. A config field Megatron-Core cannot
reproduce exactly raises ``ValueError`` naming it (never approximated).

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_async.models.family import (
    EMBEDDING_RULE,
    FINAL_RULES,
    HF_LAYER as _L,
    MG_LAYER as _M,
    ArchArgs,
    decoder_fields,
    register_family,
    HfConfig,
    MegatronKwargs,
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
from moe_async.types import JsonDict

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
    ``docs/design/models.md`` and :class:`~moe_async.models.sigmoid_moe.SigmoidMoeFamily`)."""

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

    def arch_args(self, hf_config: HfConfig) -> DeepseekV3Args:
        """Read and validate a DeepSeek-V3 HF config.

        Raises:
            ValueError: naming an unsupported field (design notes: ``docs/design/models.md``).
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

    def model_config_kwargs(self, a: ArchArgs, *, moe_aux_loss_coeff: float) -> MegatronKwargs:
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

    def layer_spec(self, hf_config: HfConfig, *, use_te: bool = False, vp_stage: int | None = None):
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
