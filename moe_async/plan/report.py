"""``moe-async plan``'s pipeline: the model's architecture (config.json or ``model.arch``), the
layout checks, the estimates, and what does not fit.

Errors (bad input, exit status 2): :class:`~moe_async.plan.arch.ArchError` and
:class:`~moe_async.plan.memory.PlanError`, naming the field and the rule. A layout that
checks but does not fit the devices is a :class:`Plan` with ``refusals`` (exit status 3).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from moe_async.errors import read_json_object
from moe_async.lora.config import LoraConfig
from moe_async.plan.arch import SUPPORTED, ArchError, ModelShape, model_shape
from moe_async.plan.memory import (
    GiB,
    EngineEstimate,
    PlanError,
    SyncEstimate,
    TrainerEstimate,
    check_layout,
    estimate_engine,
    estimate_sync,
    estimate_trainer,
)
from moe_async.types import JsonDict

#: a role within this share of its usable memory is warned about (allocator peaks, estimate error)
WARN_SHARE = 0.9


@dataclass
class Plan:
    """Everything ``moe-async plan`` prints."""

    shape: ModelShape
    trainer: TrainerEstimate
    engine: EngineEstimate
    sync: SyncEstimate
    nodes_needed: int
    warnings: list[str] = field(default_factory=list)
    refusals: list[str] = field(default_factory=list)


def read_arch(model_cfg) -> tuple[JsonDict, str]:
    """The HF config fields to plan with and where they came from: ``model.hf_path``'s
    config.json when it exists (checked against ``model.arch`` where both give a field), else
    ``model.arch``.

    Raises:
        PlanError: not an HF model, no architecture anywhere, an unreadable config.json, or a
            ``model.arch`` field that differs from config.json's.
    """
    if model_cfg.source != "hf":
        raise PlanError(f"model.source={model_cfg.source!r}: plan reads an HF architecture (model.source='hf' "
                        "with model.hf_path holding config.json, or model.arch)")
    p = Path(model_cfg.hf_path) / "config.json"
    if p.is_file():
        d = read_json_object(p, "model.hf_path", PlanError)  # PlanError naming the file
        for k, v in (model_cfg.arch or {}).items():
            if k in d and d[k] != v:
                raise PlanError(f"model.arch.{k}={v!r} differs from {p}: {k}={d[k]!r} (remove it or fix it)")
        return d, str(p)
    if model_cfg.arch is None:
        raise PlanError(f"model.arch: plan needs the model's architecture: model.hf_path={model_cfg.hf_path!r} has no "
                        "config.json and model.arch (the HF config fields) is not set")
    return dict(model_cfg.arch), "model.arch"


def _family_warning(d: JsonDict, source: str) -> str | None:
    """Whether moe-async's trainer has a family for this model (and, for a whole config.json,
    accepts its fields); None when it does."""
    from moe_async.models import get_family  # imports torch: only here

    try:
        fam = get_family(d.get("model_type"))
        if source != "model.arch":
            fam.arch_args(d)
    except (ValueError, KeyError) as e:
        return f"moe-async train would refuse this model ({source}): {e}"
    return None


def make_plan(cfg, *, family_check: bool = True) -> Plan:
    """Check ``cfg`` (an ExperimentConfig) and estimate every role.

    Raises:
        ArchError, PlanError: see the module docstring (every failed layout rule listed).
    """
    d, source = read_arch(cfg.model)
    shape = model_shape(d, source)
    errs = check_layout(shape, cfg)
    if errs:
        raise PlanError("layout does not fit the model or cluster:\n  " + "\n  ".join(errs))
    if cfg.trainer.lora is not None and (why := lora_shape_error(cfg.trainer.lora, shape)):  # as train refuses it
        raise PlanError(why)
    tr, en, sy = estimate_trainer(shape, cfg), estimate_engine(shape, cfg), estimate_sync(shape, cfg)
    c = cfg.cluster
    assert tr.layout.world_size is not None  # the trainer's layout has its world size
    gpus = tr.layout.world_size + en.num_engines * en.devices
    plan = Plan(shape, tr, en, sy, nodes_needed=-(-gpus // c.gpus_per_node))
    if family_check and (w := _family_warning(d, source)):
        plan.warnings.append(w)
    for note in shape.not_counted:
        plan.warnings.append(f"not counted: {note}")
    budget = "cluster.gpu_memory_gib - cluster.reserved_gib"
    if tr.total > tr.usable and tr.total_balanced <= tr.usable:
        plan.warnings.append(
            f"trainer: {tr.total / GiB:.1f} GiB per GPU at cluster.moe_imbalance={tr.moe_imbalance:g} exceed the "
            f"{tr.usable / GiB:.1f} GiB usable ({budget}); it fits ({tr.total_balanced / GiB:.1f} GiB) only with "
            "balanced routing (moe_imbalance 1): hot experts early in RL would run out of memory")
    elif tr.total > tr.usable:
        options: list[tuple[str, int | None]] = []
        if not tr.distributed:
            options.append(("trainer.use_distributed_optimizer=true",
                            tr.total - tr.optimizer + tr.optimizer_distributed))
        if tr.offload_fraction < 1:
            options.append(("trainer.use_distributed_optimizer=true trainer.optimizer_cpu_offload=true (Megatron-Core's "
                            "HybridDeviceOptimizer, as slime's --optimizer-cpu-offload)", tr.total_offloaded))
        if tr.activations_no_recompute == tr.activations:
            options.append(("trainer.recompute_granularity=full (recompute_method=uniform, recompute_num_layers=1)",
                            None))
        fits = [name for name, b in options if b is not None and b <= tr.usable]
        plan.refusals.append(
            f"trainer: {tr.total / GiB:.1f} GiB per GPU exceed the {tr.usable / GiB:.1f} GiB usable ({budget})"
            + (f"; it would fit with {' or '.join(fits)}" if fits else "")
            + ("; try trainer.recompute_granularity=full" if tr.activations_no_recompute == tr.activations else "")
            + "; or lower the tokens per micro-batch, or spread the model over more GPUs (EP, PP, TP, or more "
            "data-parallel ranks to shard the distributed optimizer)")
    elif tr.total > WARN_SHARE * tr.usable:
        plan.warnings.append(f"trainer: {tr.total / GiB:.1f} GiB per GPU are within {100 - WARN_SHARE * 100:.0f}% of "
                             f"the {tr.usable / GiB:.1f} GiB usable ({budget})")
    if c.cpu_memory_gib is not None and tr.host_optimizer_per_node > c.cpu_memory_gib * GiB:
        plan.warnings.append(f"trainer: an offloaded optimizer needs {tr.host_optimizer_per_node / GiB:.0f} GiB of host "
                             f"memory per node, more than cluster.cpu_memory_gib={c.cpu_memory_gib:g}")
    if en.kv_pool <= 0:
        plan.refusals.append(
            f"engine: weights of {en.weights / GiB:.1f} GiB per GPU leave no KV cache at mem_fraction_static "
            f"{en.mem_fraction:g} of {en.gpu_bytes / GiB:.1f} GiB (engine.sglang_args.mem_fraction_static, "
            "engine.tensor_parallel_size)")
    else:
        want = cfg.engine.max_running_requests * cfg.rollout.max_new_tokens
        if en.kv_tokens < want:
            plan.warnings.append(
                f"engine: the KV cache holds {en.kv_tokens} tokens, fewer than engine.max_running_requests="
                f"{cfg.engine.max_running_requests} x rollout.max_new_tokens={cfg.rollout.max_new_tokens} = {want}: "
                "SGLang will queue or retract requests")
    if en.mem_fraction_assumed:
        plan.warnings.append(f"engine: mem_fraction_static {en.mem_fraction:g} assumed "
                             "(engine.sglang_args.mem_fraction_static unset; SGLang chooses by GPU size)")
    if c.nodes is not None and plan.nodes_needed < c.nodes:
        plan.warnings.append(f"cluster.nodes={c.nodes} but the roles use {gpus} GPUs ({plan.nodes_needed} nodes)")
    return plan


def model_layout_errors(cfg, hf_dir: str) -> list[str]:
    """The model rules of :func:`check_layout` (heads, KV groups, experts, expert FFN, layers by
    the trainer's and the engine's sizes) for the HF checkpoint ``hf_dir`` that ``moe-async train``
    is about to load; empty when they hold or when plan does not know its ``model_type`` (the
    trainer's own checks then apply). Raises nothing for a readable config.json: an unreadable
    one is left to the loader, which names it."""
    path = Path(hf_dir) / "config.json"
    try:
        d = read_json_object(path, "model", ValueError)
    except ValueError:
        return []
    return hf_config_layout_errors(cfg, d, str(path))


def hf_config_layout_errors(cfg, hf_config: dict, where: str) -> list[str]:
    """:func:`model_layout_errors` for an HF config already read (a ``config.json``'s dict, e.g.
    :func:`moe_async.models.prepare.configured_hf_config`'s before the model is made); ``where``
    names its source in shape errors. Empty when the rules hold or plan does not know its
    ``model_type``."""
    if hf_config.get("model_type") not in SUPPORTED:
        return []
    try:
        shape = model_shape(hf_config, where)
    except ArchError:
        return []
    return check_layout(shape, cfg, cluster=False)


def lora_match_error(cfg, hf_config: dict, where: str) -> str | None:
    """The refusal of a ``trainer.lora`` whose target modules and ``experts`` match no linear of
    the model ``hf_config`` describes (no exported adapter element in
    :func:`~moe_async.plan.lora.lora_counts`; the trainer would build no adapter and fail in its
    first step), naming the fields and the model; None when something is adapted, without
    ``trainer.lora``, or when plan does not know the ``model_type``."""
    lo = cfg.trainer.lora
    if lo is None or hf_config.get("model_type") not in SUPPORTED:
        return None
    try:
        shape = model_shape(hf_config, where)
    except ArchError:
        return None
    return lora_shape_error(lo, shape)


def lora_shape_error(lo: LoraConfig, shape: ModelShape) -> str | None:
    """:func:`lora_match_error` for a model shape already made (``shape.source`` names the
    model): the refusal, or None when ``lo`` adapts at least one element."""
    from moe_async.layout import ParallelLayout
    from moe_async.plan.lora import lora_counts

    if lora_counts(shape, list(shape.layers), lo, ParallelLayout(world_size=1)).peft:
        return None
    where = shape.source
    attn = "MLA attention (no fused q/k/v; o_proj only)" if not shape.num_key_value_heads else "GQA attention"
    mlp = "dense or shared-expert MLPs" if any(lp.mlp_tp for lp in shape.layers) else "no dense or shared-expert MLP"
    return (f"trainer.lora.target_modules={lo.target_modules} with trainer.lora.experts={lo.experts!r} adapt no "
            f"linear of the model {where} ({shape.model_type}: {attn}, {mlp}, "
            f"{shape.num_moe_layers} MoE layer(s) of routed experts): nothing would train; add target modules"
            + (" or set trainer.lora.experts='per_expert'" if lo.experts == "off" and shape.num_moe_layers else ""))

