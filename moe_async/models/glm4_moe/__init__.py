"""GLM-4.5 family (HF ``model_type="glm4_moe"``: GLM-4.5, GLM-4.5-Air): config reading,
Megatron ``TransformerConfig`` / block spec, and the HF <-> Megatron parameter mapping.

GQA with q/k/v biases and qk-norm, partial RoPE (``rotary_percent``), DeepSeek-V3's MoE with the
fp32 sigmoid router; the MTP layers are dropped on load, logged by name. Unsupported fields
raise ``ValueError`` naming them.

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Mapping

from moe_async.models.family import (
    EMBEDDING_RULE,
    ArchArgs,
    FINAL_RULES,
    HF_LAYER as _L,
    MG_LAYER as _M,
    Tensor,
    gqa_attention_rules,
    decoder_fields,
    gqa_heads,
    qkv_fuse,
    qkv_split,
    register_family,
    HfConfig,
    MegatronKwargs,
    GptModelKwargs,
)
from moe_async.models.mapping import Rule, expand
from moe_async.models.sigmoid_moe import (
    SigmoidMoeArgs,
    SigmoidMoeFamily,
    decoder_block_spec,
    moe_scopes,
    read_sigmoid_moe,
    sigmoid_moe_kwargs,
    sigmoid_moe_rules,
)
from moe_async.types import JsonDict

log = logging.getLogger(__name__)

_A = _L + "self_attn."


def qkv_bias_fuse(ts, a) -> Tensor:
    """q/k/v biases -> Megatron's ``linear_qkv.bias``, laid out as :func:`qkv_fuse`'s rows."""
    return qkv_fuse([t.unsqueeze(-1) for t in ts], a).squeeze(-1)


def qkv_bias_split(t: Tensor, a) -> list[Tensor]:
    """Inverse of :func:`qkv_bias_fuse`."""
    return [x.squeeze(-1).contiguous() for x in qkv_split(t.unsqueeze(-1), a)]


_QKV_BIAS = Rule(_M + "self_attention.linear_qkv.bias",
                 (_A + "q_proj.bias", _A + "k_proj.bias", _A + "v_proj.bias"),
                 fuse=qkv_bias_fuse, split=qkv_bias_split, scope="layer")

# gqa_attention_rules with q/k norms (skipped without use_qk_norm), the qkv bias after the qkv
# weight (skipped without attention_bias), then the sigmoid MoE MLP rules.
_ATTN = gqa_attention_rules(qk_norm=True)
GLM4_MOE_RULES: list[Rule] = [EMBEDDING_RULE, *_ATTN[:2], _QKV_BIAS, *_ATTN[2:], *sigmoid_moe_rules(), *FINAL_RULES]
_QK_NORM = {_M + "self_attention.q_layernorm.weight", _M + "self_attention.k_layernorm.weight"}

#: MTP-only tensors of layer ``model.layers.{L+j}.`` besides its decoder layer
MTP_EXTRA = ("eh_proj.weight", "enorm.weight", "hnorm.weight", "shared_head.norm.weight",
             "shared_head.head.weight", "embed_tokens.weight")


@dataclass(frozen=True)
class Glm4MoeArgs(SigmoidMoeArgs):
    """:class:`SigmoidMoeArgs` plus GLM's attention and MTP fields."""

    rotary_percent: float = 0.5
    attention_bias: bool = False
    qk_norm: bool = False
    mtp_layers: int = 0


def read_partial_rotary(d: JsonDict, head_dim: int) -> float:
    """``partial_rotary_factor`` from ``rope_parameters`` or the top level (default 0.5).

    Raises:
        ValueError: naming the field when both places give different values or the rotary
            dim ``int(head_dim * factor)`` is zero, odd or above ``head_dim``.
    """
    rp = d.get("rope_parameters") or {}
    top, inner = d.get("partial_rotary_factor"), rp.get("partial_rotary_factor")
    if top is not None and inner is not None and float(top) != float(inner):
        raise ValueError(f"glm4_moe config gives partial_rotary_factor={top} and "
                         f"rope_parameters.partial_rotary_factor={inner}")
    f = float(inner if inner is not None else top if top is not None else 0.5)
    r = int(head_dim * f)
    if not 0 < r <= head_dim or r % 2:
        raise ValueError(f"unsupported HF config field partial_rotary_factor={f}: rotary dim "
                         f"int(head_dim={head_dim} * {f}) = {r} must be even and in (0, head_dim]")
    if r != head_dim * f:
        raise ValueError(f"unsupported HF config field partial_rotary_factor={f}: head_dim={head_dim} * {f} "
                         "is not a whole number of dims (Megatron's rotary_percent would round otherwise)")
    return f


class Glm4MoeFamily(SigmoidMoeFamily):
    """GLM-4.5: GQA attention with q/k/v bias, partial rotary, first-k dense layers, MTP
    layers on disk (design notes: ``docs/design/models.md`` and
    :class:`~moe_async.models.sigmoid_moe.SigmoidMoeFamily`)."""

    model_types = ("glm4_moe",)
    display_name = "GLM-4.5"
    unsupported_fields = {
        "hidden_act": "silu",
        "norm_topk_prob": True,
        "pretraining_tp": (None, 1),
    }

    def __init__(self) -> None:
        self._mtp_logged: set[str] = set()

    def arch_args(self, hf_config: HfConfig) -> Glm4MoeArgs:
        """Read and validate a GLM-4.5 HF config.

        Raises:
            ValueError: naming an unsupported field (design notes: ``docs/design/models.md``), or
                ``num_attention_heads`` not a multiple of ``num_key_value_heads``.
            KeyError: a required field is missing.
        """
        d = self.read_hf_config(hf_config)
        nh, h, ng = gqa_heads(d)
        hd = d.get("head_dim") or h // nh
        mtp = d.get("num_nextn_predict_layers", d.get("num_mtp_layers", 0)) or 0
        return Glm4MoeArgs(
            **decoder_fields(d, num_key_value_heads=ng, head_dim=hd, rms_norm_eps=1e-5, max_position_embeddings=131072),
            rotary_percent=read_partial_rotary(d, hd),
            attention_bias=bool(d.get("attention_bias", False)),
            qk_norm=bool(d.get("use_qk_norm", False)),
            mtp_layers=int(mtp),
            **read_sigmoid_moe(d, "glm4_moe"),
        )

    def rules(self) -> list[Rule]:
        return GLM4_MOE_RULES

    # ---- mapping -------------------------------------------------------------------------
    def skip_rule(self, r: Rule, a: ArchArgs) -> bool:
        """Also the shared-expert rules without shared experts, the qkv bias without
        ``attention_bias`` and the q/k norms without ``use_qk_norm``."""
        assert isinstance(a, Glm4MoeArgs)
        return (super().skip_rule(r, a) or (r is _QKV_BIAS and not a.attention_bias)
                or (r.megatron in _QK_NORM and not a.qk_norm))

    def mtp_hf_keys(self, a: Glm4MoeArgs) -> tuple[str, ...]:
        """The exact HF names an MTP layer ``model.layers.{L+j}`` may hold (j <
        ``num_nextn_predict_layers``): :data:`MTP_EXTRA` and the names of a whole MoE decoder
        layer at that index. Dropped on the way in, never mapped."""
        out: list[str] = []
        for j in range(a.mtp_layers):
            i = a.num_layers + j
            moe = replace(a, num_layers=i + 1, first_k_dense=i, mtp_layers=0)
            layer = [h for h in expand(self.rules(), i + 1, a.num_experts or 0, moe, skip=self.skip_rule,
                                       scopes={**moe_scopes(moe), "layer": [{"i": i}]}).hf_keys
                     if h.startswith(f"model.layers.{i}.")]
            out += [f"model.layers.{i}.{n}" for n in MTP_EXTRA] + layer
        return tuple(out)

    def normalize_hf_state(self, hf_state: Mapping[str, Tensor], a: ArchArgs) -> dict[str, Tensor]:
        """Drop the MTP layer's tensors (:meth:`mtp_hf_keys`, each name logged once per
        family instance), then the fused-expert rewrite of the base class."""
        assert isinstance(a, Glm4MoeArgs)
        mtp = set(self.mtp_hf_keys(a)) if a.mtp_layers else set()
        state = {k: v for k, v in hf_state.items() if k not in mtp}
        dropped = sorted(set(hf_state) - set(state) - self._mtp_logged)
        if dropped:
            self._mtp_logged.update(dropped)
            log.info("glm4_moe: skipping %d MTP tensor(s) of num_nextn_predict_layers=%d (not trained, "
                     "not exported, as transformers): %s", len(dropped), a.mtp_layers, dropped)
        return super().normalize_hf_state(state, a)

    # ---- Megatron model ------------------------------------------------------------------
    def model_config_kwargs(self, a: ArchArgs, *, moe_aux_loss_coeff: float) -> MegatronKwargs:
        """GQA attention (q/k/v bias, q/k norm) and the dense/MoE sigmoid router fields
        (:func:`sigmoid_moe.sigmoid_moe_kwargs`)."""
        assert isinstance(a, Glm4MoeArgs)
        return dict(
            num_query_groups=a.num_key_value_heads,
            kv_channels=a.head_dim,
            qk_layernorm=a.qk_norm,
            add_qkv_bias=a.attention_bias,
            **sigmoid_moe_kwargs(a, moe_aux_loss_coeff=moe_aux_loss_coeff),
        )

    def layer_spec(self, hf_config: HfConfig, *, use_te: bool = False, vp_stage: int | None = None):
        """Decoder block spec (:func:`sigmoid_moe.decoder_block_spec`: dense / MoE layers,
        this pipeline stage's, chunk ``vp_stage``'s with virtual pipeline stages)."""
        return decoder_block_spec(self, hf_config, use_te=use_te, vp_stage=vp_stage, name="glm4_moe")

    def gpt_model_kwargs(self, hf_config: HfConfig) -> GptModelKwargs:
        """The base kwargs with ``rotary_percent`` = ``partial_rotary_factor``."""
        kw = super().gpt_model_kwargs(hf_config)
        kw["rotary_percent"] = self.arch_args(hf_config).rotary_percent
        return kw


GLM4_MOE = register_family(Glm4MoeFamily())
