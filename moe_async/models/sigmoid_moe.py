"""The DeepSeek-style MoE shared by deepseek_v3 and glm4_moe: first layers dense, the others
MoE with a shared expert and a sigmoid router (fp32 scores, expert bias for the choice only,
group-limited top-k, weights renormalised and scaled). A group setting Megatron scores
differently from HF, or ``norm_topk_prob=False``, is refused by the families.

Design notes: ``docs/design/models.md``."""

from __future__ import annotations

from dataclasses import dataclass

from moe_async.models.family import HF_LAYER as _L
from moe_async.models.family import MG_LAYER as _M
from moe_async.models.family import ArchArgs, HfConfig, MegatronKwargs, ModelFamily
from moe_async.models.mapping import Rule, gated_mlp_rules
from moe_async.types import JsonDict

_MLP = ("gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class SigmoidMoeArgs(ArchArgs):
    """:class:`ArchArgs` plus the dense-first / shared-expert / sigmoid-router fields
    (``intermediate_size`` = the routed experts' width)."""

    dense_intermediate_size: int = 0
    first_k_dense: int = 0
    shared_intermediate_size: int | None = None
    n_group: int | None = None  # None: no group limit
    topk_group: int | None = None
    routed_scaling_factor: float = 1.0

    @property
    def moe_layers(self) -> list[int]:
        return list(range(self.first_k_dense, self.num_layers))


def read_sigmoid_moe(d: JsonDict, model_type: str) -> JsonDict:
    """The :class:`SigmoidMoeArgs` fields (and ``num_experts``/``top_k``/``intermediate_size``)
    of HF config dict ``d``.

    Raises:
        ValueError: naming the field: no ``n_routed_experts``; ``num_experts`` /
            ``num_local_experts`` given too with another value; ``first_k_dense_replace`` not
            in ``[0, num_hidden_layers)``; ``moe_layer_freq`` != 1; ``n_group`` not dividing
            the experts; a group limit Megatron cannot reproduce (``docs/design/models.md``).
    """
    L = d["num_hidden_layers"]
    E = d.get("n_routed_experts")
    if not E:
        raise ValueError(f"{model_type} config without n_routed_experts")
    for other in ("num_experts", "num_local_experts"):
        if d.get(other) is not None and d[other] != E:
            raise ValueError(f"{model_type} config gives n_routed_experts={E} and {other}={d[other]}: "
                             f"the routed experts are n_routed_experts; remove {other} or make them equal")
    k = d.get("first_k_dense_replace") or 0
    if not 0 <= k < L:
        raise ValueError(f"unsupported HF config field first_k_dense_replace={k} (num_hidden_layers={L})")
    if d.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"unsupported HF config field moe_layer_freq={d['moe_layer_freq']!r} (supported: 1)")
    topk = d["num_experts_per_tok"]
    ng, tg = d.get("n_group") or 1, d.get("topk_group") or 1
    if E % ng:
        raise ValueError(f"unsupported HF config field n_group={ng}: n_routed_experts={E} not divisible")
    if tg >= ng:
        ng_m = tg_m = None  # every group selected: no group limit
    else:
        if topk % tg or topk // tg != 2:
            raise ValueError(
                f"unsupported HF config field topk_group={tg}: HF scores a group by its top-2 experts,"
                f" Megatron by its top num_experts_per_tok // topk_group = {topk // tg}; need 2"
            )
        if E // ng < 2:
            raise ValueError(f"unsupported HF config field n_group={ng}: fewer than 2 experts per group")
        ng_m, tg_m = ng, tg
    nsh = d.get("n_shared_experts") or 0
    moe_i = d["moe_intermediate_size"]
    return dict(
        intermediate_size=moe_i,
        num_experts=int(E),
        top_k=int(topk),
        dense_intermediate_size=d["intermediate_size"],
        first_k_dense=int(k),
        shared_intermediate_size=moe_i * nsh if nsh else None,
        n_group=ng_m,
        topk_group=tg_m,
        routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
    )


def sigmoid_moe_rules() -> list[Rule]:
    """The MLP rules: dense gated MLP (scope ``"dense"``); router weight, fp32 expert bias,
    shared experts (``"moe"``) and routed experts (``"expert"``); HF ``mlp.gate``,
    ``mlp.experts.{e}``, ``mlp.shared_experts`` with ``gate_proj``/``up_proj``/``down_proj``."""
    return [
        *gated_mlp_rules(_M + "mlp.", _L + "mlp.", _MLP, scope="dense"),
        Rule(_M + "mlp.router.weight", (_L + "mlp.gate.weight",), scope="moe"),
        Rule(_M + "mlp.router.expert_bias", (_L + "mlp.gate.e_score_correction_bias",), scope="moe"),
        *gated_mlp_rules(_M + "mlp.experts.local_experts.{e}.", _L + "mlp.experts.{e}.", _MLP, scope="expert"),
        *gated_mlp_rules(_M + "mlp.shared_experts.", _L + "mlp.shared_experts.", _MLP, scope="moe"),
    ]


#: transformers' in-memory fused experts -> these per-expert on-disk names
FUSED_EXPERT_NAMES = ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight",
                      "mlp.experts.{e}.down_proj.weight")


def moe_scopes(a: SigmoidMoeArgs) -> dict[str, list[dict[str, int]]]:
    """The ``dense`` / ``moe`` / ``expert`` scopes of :func:`sigmoid_moe_rules`."""
    return {
        "dense": [{"i": i} for i in range(a.first_k_dense)],
        "moe": [{"i": i} for i in a.moe_layers],
        "expert": [{"i": i, "e": e} for i in a.moe_layers for e in range(a.num_experts or 0)],
    }


def skip_shared(r: Rule, a: SigmoidMoeArgs) -> bool:
    """Whether ``r`` is a shared-expert rule of a config without shared experts."""
    return a.shared_intermediate_size is None and "shared_experts" in r.megatron


def sigmoid_moe_kwargs(a: SigmoidMoeArgs, *, moe_aux_loss_coeff: float) -> MegatronKwargs:
    """``TransformerConfig`` fields of the dense/MoE layer pattern and the sigmoid router. The
    expert-bias update rate defaults to 0 (bias kept as loaded); pass
    ``moe_router_bias_update_rate`` to ``transformer_config`` to enable the aux-loss-free
    update."""
    return dict(
        ffn_hidden_size=a.dense_intermediate_size,
        num_moe_experts=a.num_experts,
        moe_layer_freq=[0] * a.first_k_dense + [1] * (a.num_layers - a.first_k_dense),
        moe_ffn_hidden_size=a.intermediate_size,
        moe_shared_expert_intermediate_size=a.shared_intermediate_size,
        moe_router_topk=a.top_k,
        moe_router_score_function="sigmoid",
        moe_router_pre_softmax=False,
        moe_router_enable_expert_bias=True,
        moe_router_bias_update_rate=0.0,
        moe_router_dtype="fp32",
        moe_router_num_groups=a.n_group,
        moe_router_group_topk=a.topk_group,
        moe_router_topk_scaling_factor=a.routed_scaling_factor,
        # "aux_loss": the trainer reports the tracker's "load_balancing_loss" (DeepSeek-V3 trains
        # with "seq_aux_loss", tracked as "seq_load_balancing_loss": pass it as an override)
        moe_router_load_balancing_type="aux_loss" if moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=moe_aux_loss_coeff,
        moe_token_dispatcher_type="alltoall",
        moe_grouped_gemm=False,
    )


def decoder_block_spec(family: ModelFamily, hf_config: HfConfig, *, use_te: bool, vp_stage: int | None, name: str):
    """Megatron's decoder block spec of ``family`` (dense / MoE layers per
    ``first_k_dense_replace``), sliced to this pipeline stage (parallel state must be
    initialised when PP > 1) and, with virtual pipeline stages (parallel state's VPP world
    size > 1), to model chunk ``vp_stage`` of that stage: layers ``[(vp_stage*PP + p) *
    L/(PP*VPP), ...)`` (``get_gpt_decoder_block_spec`` / ``get_transformer_layer_offset``).

    Raises:
        ValueError: ``vp_stage`` given without virtual pipeline stages, or missing with them.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec

    pp, vpp = 1, None
    if ps.model_parallel_is_initialized():
        pp = ps.get_pipeline_model_parallel_world_size()
        vpp = ps.get_virtual_pipeline_model_parallel_world_size()
    vpp = vpp if vpp is not None and vpp > 1 else None
    if (vpp is None) != (vp_stage is None):
        raise ValueError(f"{name} layer_spec: vp_stage={vp_stage!r} with virtual pipeline world size "
                         f"{vpp!r} (vp_stage is needed exactly when the parallel state has VPP > 1)")
    cfg = family.transformer_config(hf_config, pipeline_model_parallel_size=pp,
                                    virtual_pipeline_model_parallel_size=vpp)
    return get_gpt_decoder_block_spec(cfg, use_transformer_engine=use_te, normalization="RMSNorm",
                                      vp_stage=vp_stage)


class SigmoidMoeFamily(ModelFamily):
    """Base of the sigmoid-router MoE families (deepseek_v3, glm4_moe): transformers' fused
    in-memory expert names (:data:`FUSED_EXPERT_NAMES`), the MoE layer scopes
    (:func:`moe_scopes`) and the shared-expert rules skipped without shared experts
    (:func:`skip_shared`). Their HF load also reads transformers' in-memory layout:
    ``mlp.experts.gate_up_proj`` [E,2I,H] (gate rows first) and ``mlp.experts.down_proj``
    [E,H,I] -> per-expert on-disk names."""

    fused_expert_names = FUSED_EXPERT_NAMES

    def scopes(self, a: ArchArgs) -> dict[str, list[dict[str, int]]]:
        assert isinstance(a, SigmoidMoeArgs)
        return moe_scopes(a)

    def skip_rule(self, r: Rule, a: ArchArgs) -> bool:
        """Also the shared-expert rules when the config has no shared experts."""
        assert isinstance(a, SigmoidMoeArgs)
        return super().skip_rule(r, a) or skip_shared(r, a)
