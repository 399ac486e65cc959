"""Model-build checks and settings of :class:`~moe_async.trainer.megatron_trainer.MegatronTrainer`.

Free functions of the trainer config, the HF config and its family: the ``TransformerConfig``
fields the trainer sets beyond the family's (:func:`layout_overrides`,
:func:`memory_overrides`, :func:`expert_bias_overrides`), the refusals that name the
``trainer.*`` fields before or while the model is built (ETP x EP vs the world, ETP vs the
expert FFN size, layers vs PP x VPP, unsupported combinations), and the CPU path's CP / THD
core-attention swap in the layer spec (:func:`cp_spec`). The caller closes the process
groups it created when one of them raises.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from moe_async.layout import ParallelLayout
from moe_async.models.family import ModelFamily
from moe_async.trainer.config import TrainerConfig, unsupported_combination
from moe_async.types import JsonDict

if TYPE_CHECKING:
    from megatron.core.transformer import ModuleSpec, TransformerConfig


def layout_overrides(cfg: TrainerConfig, family: ModelFamily, hf_config: JsonDict, *,
                     cpu: bool, thd: bool, vpp: int | None) -> dict[str, object]:
    """TransformerConfig fields set by the trainer (beyond the family's): on CPU,
    ``gradient_accumulation_fusion`` through the compat stand-in (each linear layer's
    weight gradient is accumulated into DDP's ``main_grad`` by one in-place GEMM instead of
    a fresh tensor plus an add per micro-batch; compat mend 12); with packed THD rows at PP > 1
    (no VPP) Megatron's ``variable_seq_lengths``."""
    from moe_async.compat import enable_cpu_wgrad_accumulation_fusion

    out: dict[str, object] = {}
    if cpu and enable_cpu_wgrad_accumulation_fusion():
        out["gradient_accumulation_fusion"] = True
    if thd and cfg.pipeline_model_parallel_size > 1 and not vpp:
        # packed rows of different T: each p2p exchange sends its shape first (Megatron-Core's
        # p2p_communication._communicate_shapes; on gloo too: PP2 rows of 119/91/136/110 tokens
        # gave the loss and grad norm of rows all padded to 136, <= 1.2e-7). Not with VPP
        # (overlapped p2p): there Batcher.pack pads every row to the batch's largest T.
        out["variable_seq_lengths"] = True
        if not family.arch_args(hf_config).num_experts:
            # a dense model never dispatches, but TransformerConfig refuses variable_seq_lengths
            # with its default "allgather" dispatcher type
            out["moe_token_dispatcher_type"] = "alltoall"
    if vpp:
        # Megatron-LM's interleaved-schedule defaults (overlap_p2p_comm on, batch_p2p_comm =
        # not overlap_p2p_comm). A batched exchange at PP2 holds two sends and two receives
        # between the same two ranks, matched in posting order: the backward gradient was
        # received as the next chunk's activation (a 4-layer mixtral's step-1 grad norm was
        # 6e4 vs 1.5 on gloo). Megatron-LM refuses that case ("pipeline-model-parallel size
        # should be greater than 2 ... multiple p2p sends and recvs between same 2 ranks").
        out.update(overlap_p2p_comm=True, batch_p2p_comm=False)
    return out


def memory_overrides(cfg: TrainerConfig, family: ModelFamily, hf_config: JsonDict) -> dict[str, object]:
    """TransformerConfig fields of the memory and MoE-kernel options, under Megatron's names
    (``trainer.recompute_*``, ``moe_token_dispatcher_type``, ``moe_expert_capacity_factor``,
    ``moe_pad_expert_input_to_capacity``, ``moe_token_drop_policy``, ``moe_grouped_gemm``,
    ``num_layers_in_first/last_pipeline_stage``); only those set away from the default, the
    MoE ones only for a model with experts. Megatron-Core's own modules then do the work
    (transformer_block's full recompute, each layer's selective recompute, the dispatchers).

    Raises:
        ValueError: ``moe_token_dispatcher_type='flex'`` where DeepEP cannot run (no CUDA or
            no ``deep_ep``), naming the field.
    """
    cfg = cfg
    out: dict[str, object] = {}
    if cfg.recompute_granularity is not None:
        out["recompute_granularity"] = cfg.recompute_granularity
        if cfg.recompute_granularity == "full":
            out.update(recompute_method=cfg.recompute_method, recompute_num_layers=cfg.recompute_num_layers)
        elif cfg.recompute_modules is not None:
            out["recompute_modules"] = list(cfg.recompute_modules)
    for k in ("num_layers_in_first_pipeline_stage", "num_layers_in_last_pipeline_stage"):
        if getattr(cfg, k) is not None:
            out[k] = getattr(cfg, k)
    if not family.arch_args(hf_config).num_experts:
        return out
    if cfg.moe_grouped_gemm:
        from moe_async.trainer.moe_kernels import check_grouped_gemm

        check_grouped_gemm()  # refused before the model is built, naming the field
        out["moe_grouped_gemm"] = True
    if cfg.moe_token_dispatcher_type == "flex":
        from moe_async.trainer.moe_kernels import check_flex_dispatcher

        out.update(check_flex_dispatcher())
    out["moe_token_dispatcher_type"] = cfg.moe_token_dispatcher_type
    if cfg.moe_expert_capacity_factor is not None:
        out.update(moe_expert_capacity_factor=cfg.moe_expert_capacity_factor,
                   moe_pad_expert_input_to_capacity=cfg.moe_pad_expert_input_to_capacity,
                   moe_token_drop_policy=cfg.moe_token_drop_policy)
    return out


def check_expert_tensor_parallel(cfg: TrainerConfig) -> None:
    """Megatron-Core's expert-layout rule (parallel_state.initialize_model_parallel), checked
    before it runs so that the error names the fields: ETP x EP x PP divides the world size,
    i.e. ETP x EP divides TP x CP x DP (expert data parallelism gets the rest).

    Raises:
        ValueError: naming ``trainer.expert_tensor_parallel_size`` and
            ``trainer.expert_model_parallel_size``.
    """
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    ParallelLayout.from_trainer_config(cfg).check_world(world)


def check_expert_ffn_split(cfg: TrainerConfig, tf_config: TransformerConfig, hf_path: str) -> None:
    """ETP splits every routed expert's FFN (``moe_ffn_hidden_size``: fc1's output rows per
    gate/up half, fc2's input columns) into ETP equal parts (transformer/moe/experts.py).

    Raises:
        ValueError: naming ``trainer.expert_tensor_parallel_size`` when it does not divide
            the expert FFN size.
    """
    etp = cfg.expert_tensor_parallel_size
    ffn = getattr(tf_config, "moe_ffn_hidden_size", None)
    if etp > 1 and getattr(tf_config, "num_moe_experts", None) and ffn and ffn % etp:
        raise ValueError(
            f"trainer.expert_tensor_parallel_size={etp} must divide the expert FFN size "
            f"(moe_ffn_hidden_size={ffn}, from the HF config of {hf_path})")


def expert_bias_overrides(cfg: TrainerConfig, family: ModelFamily, hf_config: JsonDict) -> dict[str, object]:
    """``moe_router_bias_update_rate`` for families whose router has an expert bias
    (Megatron's ``moe_router_enable_expert_bias``: deepseek_v3); Megatron-Core applies the
    update in ``finalize_model_grads`` after each step's gradients.

    Raises:
        ValueError: ``trainer.moe_router_bias_update_rate > 0`` for a family without one.
    """
    rate = float(cfg.moe_router_bias_update_rate)
    if rate == 0.0:
        return {}
    probe = family.transformer_config(hf_config)
    if not getattr(probe, "moe_router_enable_expert_bias", False):
        raise ValueError(
            f"trainer.moe_router_bias_update_rate={rate}: model_type="
            f"{hf_config.get('model_type')!r} has no router expert bias (only deepseek_v3's "
            "e_score_correction_bias is updated aux-loss-free); set it to 0"
        )
    return {"moe_router_bias_update_rate": rate}


def check_virtual_pipeline(cfg: TrainerConfig, vpp: int | None, hf_config: JsonDict, family: ModelFamily) -> None:
    """Refuse, naming the field, a layer count not divisible by PP x VPP (ValueError;
    Megatron's TransformerConfig) with virtual pipeline stages. (Router replay R2 with VPP:
    :func:`check_combinations`; R3 runs: the replay hook keeps its micro-batch counter per
    model chunk.)"""
    if not vpp:
        return
    pp = cfg.pipeline_model_parallel_size
    n = family.arch_args(hf_config).num_layers
    if n % (pp * vpp):
        raise ValueError(
            f"trainer.virtual_pipeline_model_parallel_size={vpp}: the model's {n} layers are not divisible "
            f"by pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp * vpp} "
            "(Megatron-Core's TransformerConfig requires it)")


def check_combinations(cfg: TrainerConfig) -> None:
    """Refuse, naming the fields, before any process group is created, a parallel
    combination this trainer does not run (:func:`moe_async.trainer.config.unsupported_combination`:
    R2 with CP or VPP, VPP with CP); a validated TrainerConfig refuses them already, this
    catches one built without validation. Raises NotImplementedError."""
    if (why := unsupported_combination(cfg)) is not None:
        raise NotImplementedError(why)


def cp_spec(spec: ModuleSpec, cfg: TrainerConfig, family: ModelFamily, hf_config: JsonDict, *,
            thd: bool, cpu: bool) -> ModuleSpec:
    """The layer spec to build with: ``spec`` itself, except on the CPU path (no CUDA, local
    spec) with ``context_parallel_size > 1``, where the local core attention (which asserts
    CP == 1) is replaced by the compat CP core attention
    (:mod:`moe_async.compat.cp_attention`). With CUDA + TE the TE spec's own CP attention
    runs and the compat module is not imported.

    Likewise packed THD micro-batches (``trainer.sequence_packing`` resolved to thd) on the
    CPU path: the local core attention (which asserts ``packed_seq_params is None``) is
    replaced by the compat THD core attention (:mod:`moe_async.compat.thd_attention`);
    with CUDA + TE the TE spec's THD attention runs."""
    if cfg.moe_grouped_gemm and family.arch_args(hf_config).num_experts:
        from moe_async.megatron.build import grouped_experts_spec

        spec, _ = grouped_experts_spec(spec)  # GPU + TE only (refused before otherwise)
    if thd and cpu:
        from moe_async.compat.thd_attention import thd_layer_spec

        spec, n = thd_layer_spec(spec)
        if n == 0:
            raise RuntimeError("trainer.sequence_packing='thd': the layer spec has no local core attention "
                               "to replace with the CPU packed-sequence attention")
        return spec
    if cfg.context_parallel_size <= 1 or not cpu:
        return spec
    from moe_async.compat.cp_attention import cp_layer_spec

    spec, n = cp_layer_spec(spec)
    if n == 0:
        raise RuntimeError("trainer.context_parallel_size > 1: the layer spec has no local core attention "
                           "to replace with the CPU context-parallel attention")
    return spec
