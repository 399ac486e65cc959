"""Model families: HF config -> Megatron ``TransformerConfig`` / ``GPTModel`` args, layer spec,
and the family's declarative parameter mapping. Families are found by exact HF ``model_type``.
"""

from __future__ import annotations

import json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, TypeAlias, TypedDict

import torch

from moe_async.models.mapping import ExpandedTable, Rule, expand, fuse_all, gated_mlp_rules, split_all
from moe_async.models.rope import Rope, read_rope
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.transformer import ModuleSpec, TransformerConfig
    from transformers import PretrainedConfig

Tensor = torch.Tensor

#: An HF config as the families take it: a parsed ``config.json``, a ``PretrainedConfig``, or
#: the checkpoint directory / ``config.json`` path (:func:`hf_config_dict`).
HfConfig: TypeAlias = "Mapping[str, Any] | PretrainedConfig | str | os.PathLike[str]"
#: Keyword arguments of Megatron-Core's ``TransformerConfig`` (untyped library).
MegatronKwargs: TypeAlias = dict[str, object]


class GptModelKwargs(TypedDict):
    """``GPTModel`` keyword arguments besides config/spec/pre/post-process (:meth:`ModelFamily.gpt_model_kwargs`)."""

    vocab_size: int
    max_sequence_length: int
    share_embeddings_and_output_weights: bool
    position_embedding_type: str
    rotary_percent: float
    rotary_base: float

_REGISTRY: dict[str, "ModelFamily"] = {}


def register_family(family: "ModelFamily") -> "ModelFamily":
    """Register ``family`` under each of its ``model_types`` (exact keys)."""
    for mt in family.model_types:
        if mt in _REGISTRY:
            raise ValueError(f"model_type {mt!r} registered twice")
        _REGISTRY[mt] = family
    return family


def get_family(model_type: str | None) -> "ModelFamily":
    """The family registered for HF ``model_type`` (exact key); ValueError listing the known
    ones otherwise."""
    try:
        return _REGISTRY[model_type or ""]
    except KeyError:
        raise ValueError(
            f"unsupported HF model_type {model_type!r}; supported: {sorted(_REGISTRY)}"
        ) from None


def hf_config_dict(hf_config: HfConfig) -> JsonDict:
    """A plain dict of an HF config given as a dict, a ``PretrainedConfig`` or a directory /
    ``config.json`` path."""
    if isinstance(hf_config, (str, os.PathLike)):
        p = os.fspath(hf_config)
        if os.path.isdir(p):
            p = os.path.join(p, "config.json")
        with open(p) as f:
            return json.load(f)
    if isinstance(hf_config, Mapping):
        return dict(hf_config)
    if hasattr(hf_config, "to_dict"):
        return hf_config.to_dict()
    raise TypeError(f"cannot read an HF config from {type(hf_config).__name__}")


@dataclass(frozen=True)
class ArchArgs:
    """Architecture read from an HF config (units: elements; ``rope_theta`` is the RoPE base)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP / per-expert FFN width I
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    num_experts: int | None = None  # None for dense
    top_k: int | None = None
    rope: Rope | None = None  # the RoPE (type and scaling) read from the HF config; None: plain, rope_theta

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_key_value_heads


def qkv_fuse(ts, a: ArchArgs) -> Tensor:
    """q ``[nh*d, H]``, k ``[ng*d, H]``, v ``[ng*d, H]`` -> Megatron ``linear_qkv``
    ``[ng*(nh/ng + 2)*d, H]``, per query group ``[q heads of the group; k; v]``."""
    q, k, v = ts
    ng, d, hpg = a.num_key_value_heads, a.head_dim, a.heads_per_group
    h = q.shape[-1]
    qkv = torch.cat(
        [q.reshape(ng, hpg * d, h), k.reshape(ng, d, h), v.reshape(ng, d, h)], dim=1
    )
    return qkv.reshape(ng * (hpg + 2) * d, h)


def qkv_split(t: Tensor, a: ArchArgs) -> list[Tensor]:
    """Inverse of :func:`qkv_fuse`."""
    ng, d, hpg = a.num_key_value_heads, a.head_dim, a.heads_per_group
    h = t.shape[-1]
    g = t.reshape(ng, (hpg + 2) * d, h)
    q, k, v = torch.split(g, [hpg * d, d, d], dim=1)
    return [q.reshape(-1, h).contiguous(), k.reshape(-1, h).contiguous(), v.reshape(-1, h).contiguous()]


# Rules every GQA decoder family (llama, mixtral, qwen3_moe) shares, in table order:
# embedding first; per layer input norm, fused qkv, [q/k norms], o_proj, pre-MLP norm (the
# family's MLP rules follow); final norm and output layer last.
HF_LAYER = "model.layers.{i}."
MG_LAYER = "decoder.layers.{i}."
_HF_L, _MG_L = HF_LAYER, MG_LAYER

EMBEDDING_RULE = Rule("embedding.word_embeddings.weight", ("model.embed_tokens.weight",))
FINAL_RULES: tuple[Rule, ...] = (
    Rule("decoder.final_layernorm.weight", ("model.norm.weight",)),
    Rule("output_layer.weight", ("lm_head.weight",)),
)


def gqa_attention_rules(*, qk_norm: bool = False) -> list[Rule]:
    """Per-layer rules from the input norm through the pre-MLP norm of a GQA decoder
    (HF ``self_attn.{q,k,v,o}_proj``, optional ``q_norm``/``k_norm``; Megatron local spec)."""
    rules = [
        Rule(_MG_L + "input_layernorm.weight", (_HF_L + "input_layernorm.weight",), scope="layer"),
        Rule(
            _MG_L + "self_attention.linear_qkv.weight",
            (_HF_L + "self_attn.q_proj.weight", _HF_L + "self_attn.k_proj.weight", _HF_L + "self_attn.v_proj.weight"),
            fuse=qkv_fuse,
            split=qkv_split,
            scope="layer",
        ),
    ]
    if qk_norm:
        rules += [
            Rule(_MG_L + "self_attention.q_layernorm.weight", (_HF_L + "self_attn.q_norm.weight",), scope="layer"),
            Rule(_MG_L + "self_attention.k_layernorm.weight", (_HF_L + "self_attn.k_norm.weight",), scope="layer"),
        ]
    rules += [
        Rule(_MG_L + "self_attention.linear_proj.weight", (_HF_L + "self_attn.o_proj.weight",), scope="layer"),
        Rule(_MG_L + "pre_mlp_layernorm.weight", (_HF_L + "post_attention_layernorm.weight",), scope="layer"),
    ]
    return rules


def gqa_decoder_rules(mlp_rules: Iterable[Rule], *, qk_norm: bool = False) -> list[Rule]:
    """A GQA decoder family's whole table: embedding, the per-layer attention rules
    (:func:`gqa_attention_rules`), the family's ``mlp_rules``, final norm and output layer."""
    return [EMBEDDING_RULE, *gqa_attention_rules(qk_norm=qk_norm), *mlp_rules, *FINAL_RULES]


def moe_mlp_rules(router: str, experts: str, names: tuple[str, str, str]) -> list[Rule]:
    """An MoE MLP of every layer: Megatron ``mlp.router.weight`` [E,H] = HF
    ``model.layers.{i}.<router>``, and the routed experts ``mlp.experts.local_experts.{e}``
    as gated MLPs of HF ``model.layers.{i}.<experts><gate|up|down>.weight``
    (:func:`mapping.gated_mlp_rules`, ``names = (gate, up, down)``; ``experts`` holds ``{e}``)."""
    return [
        Rule(_MG_L + "mlp.router.weight", (_HF_L + router,), scope="layer"),
        *gated_mlp_rules(_MG_L + "mlp.experts.local_experts.{e}.", _HF_L + experts, names, scope="expert"),
    ]


# TE layer spec fuses the pre-attention / dense pre-MLP norms into the following linear.
_TE_SUFFIX_TO_LOCAL = {
    ".self_attention.linear_qkv.layer_norm_weight": ".input_layernorm.weight",
    ".mlp.linear_fc1.layer_norm_weight": ".pre_mlp_layernorm.weight",
    # MLA with q/kv norms: fused into the up projections (DeepSeek-V3 under TE)
    ".self_attention.linear_q_up_proj.layer_norm_weight": ".self_attention.q_layernorm.weight",
    ".self_attention.linear_kv_up_proj.layer_norm_weight": ".self_attention.kv_layernorm.weight",
}


def local_spec_name(name: str) -> str:
    """Megatron parameter name under the local layer spec for a name under either spec."""
    for te, local in _TE_SUFFIX_TO_LOCAL.items():
        if name.endswith(te):
            return name[: -len(te)] + local
    return name



def gqa_heads(d: JsonDict) -> tuple[int, int, int]:
    """``(num_attention_heads, hidden_size, num_key_value_heads)`` of an HF config dict of a
    GQA decoder (``num_key_value_heads`` defaults to ``num_attention_heads``).

    Raises:
        KeyError: ``num_attention_heads`` or ``hidden_size`` missing.
        ValueError: ``num_attention_heads`` not a multiple of ``num_key_value_heads``.
    """
    nh, h = d["num_attention_heads"], d["hidden_size"]
    ng = d.get("num_key_value_heads") or nh
    if nh % ng:
        raise ValueError(f"num_attention_heads={nh} is not a multiple of num_key_value_heads={ng}")
    return nh, h, ng


def decoder_fields(d: JsonDict, *, num_key_value_heads: int, head_dim: int, rms_norm_eps: float,
                   max_position_embeddings: int, rope_types: tuple[str, ...] = ("default",)) -> JsonDict:
    """The :class:`ArchArgs` fields every decoder family reads the same way from its HF config
    dict ``d`` (``rms_norm_eps`` and ``max_position_embeddings``: the family's defaults when
    ``d`` lacks them; ``num_key_value_heads``, ``head_dim``: as the family derives them).

    ``rope_types``: the RoPE types the family implements (:func:`rope.read_rope`).

    Raises:
        KeyError: ``model_type``, ``vocab_size``, ``hidden_size``, ``num_hidden_layers`` or
            ``num_attention_heads`` missing.
        ValueError: a RoPE the family does not implement, naming the field.
    """
    rope = read_rope(d, rope_types)
    return dict(
        model_type=d["model_type"],
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_attention_heads=d["num_attention_heads"],
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=float(d.get("rms_norm_eps", rms_norm_eps)),
        rope_theta=rope.theta,
        rope=rope,
        max_position_embeddings=d.get("max_position_embeddings", max_position_embeddings),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
    )

class ModelFamily(ABC):
    """One HF architecture family. Subclasses declare ``model_types``, ``rules`` and the class
    fields below; the defaults read a GQA decoder (Llama-style config fields) into
    :class:`ArchArgs` and build Megatron's GPT model for it. Families with another attention
    (DeepSeek-V3's MLA) override :meth:`arch_args`, :meth:`model_config_kwargs` and
    :meth:`layer_spec`.
    """

    model_types: tuple[str, ...] = ()
    #: name in the "not a ... config" error
    display_name: str = ""
    #: field -> supported value (or a tuple of them), checked by :func:`reject_fields`
    unsupported_fields: Mapping[str, object] = {}
    #: HF field read as :attr:`ArchArgs.intermediate_size` (the per-expert width for MoE)
    intermediate_size_field: str = "intermediate_size"
    #: defaults of HF fields a config may leave out
    default_rms_norm_eps: float = 1e-6
    default_max_position_embeddings: int = 4096
    #: per-head RMSNorm on queries and keys (HF ``q_norm``/``k_norm``; Megatron ``qk_layernorm``)
    qk_layernorm: bool = False
    #: transformers' in-memory fused experts (``model.layers.{i}.mlp.experts.gate_up_proj``
    #: [E,2I,H], gate rows first, and ``...down_proj`` [E,H,I]) -> the per-expert on-disk names
    #: ``(gate, up, down)`` under ``model.layers.{i}.`` with ``{e}``; None: no such layout
    fused_expert_names: tuple[str, str, str] | None = None
    #: other in-memory -> on-disk names under ``model.layers.{i}.``
    in_memory_renames: Mapping[str, str] = {}
    #: the attention builds its own RoPE from the config (MLA); else GPTModel's rotary embedding
    rope_in_attention: bool = False

    def read_hf_config(self, hf_config: HfConfig) -> JsonDict:
        """The HF config as a dict (:func:`hf_config_dict`), checked.

        Raises:
            ValueError: ``model_type`` not one of ``model_types`` ("not a <display_name>
                config"), or naming the first field of ``unsupported_fields`` whose value is
                not the supported one.
        """
        d = hf_config_dict(hf_config)
        if d.get("model_type") not in self.model_types:
            raise ValueError(f"not a {self.display_name} config: model_type={d.get('model_type')!r}")
        reject_fields(d, self.unsupported_fields)
        return d

    def moe_args(self, d: JsonDict) -> JsonDict:
        """``num_experts`` / ``top_k`` of :class:`ArchArgs` from the checked config dict ``d``
        (empty for a dense family)."""
        return {}

    def arch_args(self, hf_config: HfConfig) -> ArchArgs:
        """Read and validate an HF config of a GQA decoder (``num_key_value_heads`` defaults to
        ``num_attention_heads``, ``head_dim`` to ``hidden_size // num_attention_heads``).

        Raises:
            ValueError: naming any unsupported field (:meth:`read_hf_config`), or
                ``num_attention_heads`` not a multiple of ``num_key_value_heads``.
            KeyError: a required field is missing.
        """
        d = self.read_hf_config(hf_config)
        nh, h, ng = gqa_heads(d)
        moe = self.moe_args(d)
        return ArchArgs(
            **decoder_fields(d, num_key_value_heads=ng, head_dim=d.get("head_dim") or h // nh,
                             rms_norm_eps=self.default_rms_norm_eps, rope_types=("default", "yarn"),
                             max_position_embeddings=self.default_max_position_embeddings),
            intermediate_size=d[self.intermediate_size_field],
            **moe,
        )

    @abstractmethod
    def rules(self) -> list[Rule]:
        """The declarative Megatron <-> HF mapping."""

    def normalize_hf_state(self, hf_state: Mapping[str, Tensor], a: ArchArgs) -> dict[str, Tensor]:
        """Rewrite transformers' in-memory layout into the on-disk names
        (``in_memory_renames``, ``fused_expert_names``); other names pass unchanged.

        Raises:
            ValueError: a tensor is given in both the fused and the per-expert layout.
        """
        out = dict(hf_state)
        if self.fused_expert_names is None and not self.in_memory_renames:
            return out
        for i in range(a.num_layers):
            pre = f"model.layers.{i}."
            moves = {}
            for src, dst in self.in_memory_renames.items():
                if pre + src in out:
                    moves[pre + dst] = out.pop(pre + src)
            if self.fused_expert_names is not None:
                gate, up, down = (pre + n for n in self.fused_expert_names)
                gu = out.pop(pre + "mlp.experts.gate_up_proj", None)
                if gu is not None:
                    inter = gu.shape[1] // 2
                    for e in range(gu.shape[0]):
                        moves[gate.format(e=e)] = gu[e, :inter]
                        moves[up.format(e=e)] = gu[e, inter:]
                dn = out.pop(pre + "mlp.experts.down_proj", None)
                if dn is not None:
                    for e in range(dn.shape[0]):
                        moves[down.format(e=e)] = dn[e]
            for k, v in moves.items():
                if k in out:
                    raise ValueError(f"HF state gives {k!r} in both the fused and the per-expert layout")
                out[k] = v
        return out

    # ---- mapping -------------------------------------------------------------------------
    def skip_rule(self, r: Rule, a: ArchArgs) -> bool:
        """Whether rule ``r`` has no tensors for config ``a`` (``output_layer`` when tied)."""
        return r.megatron == "output_layer.weight" and a.tie_word_embeddings

    def scopes(self, a: ArchArgs) -> dict[str, list[dict[str, int]]]:
        """Rule scopes besides (or replacing) :func:`mapping.expand`'s global/layer/expert."""
        return {}

    def table(self, a: ArchArgs) -> ExpandedTable:
        """The exact-name table of :meth:`rules` for config ``a`` (:func:`mapping.expand`)."""
        return expand(self.rules(), a.num_layers, a.num_experts or 0, a, skip=self.skip_rule,
                      scopes=self.scopes(a))

    def hf_to_megatron(self, hf_state: Mapping[str, Tensor], hf_config: HfConfig) -> dict[str, Tensor]:
        a = self.arch_args(hf_config)
        state = self.normalize_hf_state(hf_state, a)
        if a.tie_word_embeddings and "lm_head.weight" in state:
            # transformers' in-memory state_dict lists the tied head; it must be the embedding.
            lm, emb = state.pop("lm_head.weight"), state.get("model.embed_tokens.weight")
            if emb is None or not torch.equal(lm, emb):
                raise ValueError(
                    "tie_word_embeddings=True but lm_head.weight differs from model.embed_tokens.weight"
                )
        return fuse_all(self.table(a), state, a)

    def megatron_to_hf(
        self, named: Iterable[tuple[str, Tensor]], hf_config: HfConfig
    ) -> Iterator[tuple[str, Tensor]]:
        a = self.arch_args(hf_config)
        return split_all(self.table(a), ((local_spec_name(n), t) for n, t in named), a)

    def hf_keys(self, hf_config: HfConfig) -> tuple[str, ...]:
        """The exact HF on-disk tensor names of this config, in table order."""
        return self.table(self.arch_args(hf_config)).hf_keys

    # ---- Megatron model ------------------------------------------------------------------
    def transformer_config(
        self,
        hf_config: HfConfig,
        *,
        params_dtype: str = "fp32",
        moe_aux_loss_coeff: float = 0.0,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        expert_model_parallel_size: int = 1,
        expert_tensor_parallel_size: int = 1,
        **overrides: object,
    ) -> TransformerConfig:
        """Megatron config (:meth:`config_class`) for this HF config: CPU-safe settings (no
        bias, dropout 0, no fusions, ``use_cpu_initialization``) plus the family's fields
        (:meth:`model_config_kwargs`; MoE via the alltoall dispatcher); ``overrides`` last.

        Raises:
            ValueError: ``params_dtype`` not "fp32"/"bf16", or an unsupported HF config field.
        """
        a = self.arch_args(hf_config)
        if params_dtype not in ("fp32", "bf16"):
            raise ValueError(f"params_dtype must be 'fp32' or 'bf16', got {params_dtype!r}")
        bf16 = params_dtype == "bf16"
        kw: MegatronKwargs = dict(
            num_layers=a.num_layers,
            hidden_size=a.hidden_size,
            num_attention_heads=a.num_attention_heads,
            layernorm_epsilon=a.rms_norm_eps,
            normalization="RMSNorm",
            gated_linear_unit=True,
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            add_qkv_bias=False,
            hidden_dropout=0.0,
            attention_dropout=0.0,
            use_cpu_initialization=True,
            params_dtype=torch.bfloat16 if bf16 else torch.float32,
            bf16=bf16,
            pipeline_dtype=torch.bfloat16 if bf16 else torch.float32,
            tensor_model_parallel_size=tensor_model_parallel_size,
            pipeline_model_parallel_size=pipeline_model_parallel_size,
            expert_model_parallel_size=expert_model_parallel_size,
            expert_tensor_parallel_size=expert_tensor_parallel_size,
            sequence_parallel=tensor_model_parallel_size > 1,
            attention_softmax_in_fp32=True,
            apply_rope_fusion=False,
            bias_activation_fusion=False,
            bias_dropout_fusion=False,
            masked_softmax_fusion=False,
            gradient_accumulation_fusion=False,
            persist_layer_norm=False,
        )
        kw.update(self.model_config_kwargs(a, moe_aux_loss_coeff=moe_aux_loss_coeff))
        kw.update(self.config_from_hf(hf_config_dict(hf_config)))
        kw.update(overrides)
        cfg = self.config_class()(**kw)
        if a.rope is not None and a.rope.is_yarn and not getattr(cfg, "multi_latent_attention", False):
            # GPTModel's position_embedding_type="yarn" reads these attributes (TransformerConfig
            # declares none of them; getattr in gpt_model.py / attention.py)
            for k, v in a.rope.gpt_yarn_config().items():
                setattr(cfg, k, v)
        return cfg

    def config_from_hf(self, d: JsonDict) -> MegatronKwargs:
        """``TransformerConfig`` fields the family reads from the HF config dict ``d`` itself
        (beyond :meth:`model_config_kwargs`); before the caller's overrides. Default: none."""
        return {}

    def config_class(self) -> type:
        """Megatron's config class of this family (``TransformerConfig``)."""
        from megatron.core.transformer import TransformerConfig

        return TransformerConfig

    def model_config_kwargs(self, a: ArchArgs, *, moe_aux_loss_coeff: float) -> MegatronKwargs:
        """The family's ``TransformerConfig`` fields: GQA attention, FFN width and, with
        experts, the MoE router (Mixtral: top-k on logits, softmax over the k == softmax,
        top-k, renormalise)."""
        kw: MegatronKwargs = dict(
            ffn_hidden_size=a.intermediate_size,
            num_query_groups=a.num_key_value_heads,
            kv_channels=a.head_dim,
            qk_layernorm=self.qk_layernorm,
        )
        if a.num_experts:
            kw.update(
                num_moe_experts=a.num_experts,
                moe_ffn_hidden_size=a.intermediate_size,
                moe_router_topk=a.top_k,
                moe_router_pre_softmax=False,
                moe_router_score_function="softmax",
                moe_router_load_balancing_type="aux_loss",
                moe_aux_loss_coeff=moe_aux_loss_coeff,
                moe_token_dispatcher_type="alltoall",
                moe_grouped_gemm=False,
            )
        return kw

    def layer_spec(self, hf_config: HfConfig, *, use_te: bool = False) -> ModuleSpec:
        """Megatron layer spec: TE spec when ``use_te`` (CUDA + transformer_engine), else local;
        with ``qk_layernorm`` when the family has it."""
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_local_spec,
            get_gpt_layer_with_transformer_engine_spec,
        )

        a = self.arch_args(hf_config)
        if use_te:
            return get_gpt_layer_with_transformer_engine_spec(
                num_experts=a.num_experts, moe_grouped_gemm=False, qk_layernorm=self.qk_layernorm
            )
        return get_gpt_layer_local_spec(
            num_experts=a.num_experts, moe_grouped_gemm=False, qk_layernorm=self.qk_layernorm,
            normalization="RMSNorm",
        )

    def gpt_model_kwargs(self, hf_config: HfConfig) -> GptModelKwargs:
        """Keyword arguments of ``GPTModel`` besides config/spec/pre/post-process."""
        a = self.arch_args(hf_config)
        yarn = a.rope is not None and a.rope.is_yarn and not self.rope_in_attention
        return GptModelKwargs(
            vocab_size=a.vocab_size,
            max_sequence_length=a.max_position_embeddings,
            share_embeddings_and_output_weights=a.tie_word_embeddings,
            position_embedding_type="yarn" if yarn else "rope",  # YaRN's fields: transformer_config
            rotary_percent=1.0,
            rotary_base=a.rope_theta,
        )


def reject_fields(d: JsonDict, checks: Mapping[str, object]) -> None:
    """Raise ValueError naming the first field whose value is not the supported one.
    ``checks`` maps field -> the supported value, or a tuple of supported values (the
    message lists them)."""
    for field, ok in checks.items():
        if field not in d:
            continue
        v = d[field]
        good = v in ok if isinstance(ok, tuple) else v == ok
        if not good:
            want = "one of " + ", ".join(repr(x) for x in ok) if isinstance(ok, tuple) else repr(ok)
            raise ValueError(f"unsupported HF config field {field}={v!r} (supported: {want})")
