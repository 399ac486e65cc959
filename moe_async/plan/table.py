"""Printing a :class:`~moe_async.plan.report.Plan`: one table per role. GiB = 2**30 bytes,
GB = 10**9 bytes, B = 10**9 parameters."""

from __future__ import annotations

from moe_async.plan.memory import GiB


def _g(b: float) -> str:
    return f"{b / GiB:8.2f}"


def _b(n: int) -> str:
    return f"{n / 1e9:.2f}B"


def format_plan(plan, cfg, config_name: str) -> str:
    """The plan as text: model, trainer (one row per optimizer variant), engine, weight sync,
    then warnings and refusals."""
    s, t, e, w, c = plan.shape, plan.trainer, plan.engine, plan.sync, cfg.cluster
    lay = t.layout
    moe_layers = s.num_moe_layers
    out = [
        f"moe-async plan: {config_name}",
        f"model    {s.model_type} ({s.source}): {_b(s.total)} parameters, {_b(s.expert_total)} in routed experts "
        f"({s.num_experts} x {moe_layers} MoE layers, top-{s.top_k}), {_b(s.active)} active per token",
        f"rope     {s.rope}",
        f"cluster  {c.gpus_per_node} GPUs of {c.gpu_memory_gib:g} GiB per node; the roles use "
        f"{lay.world_size + e.num_engines * e.devices} GPUs = {plan.nodes_needed} node(s)"
        + (f" of cluster.nodes={c.nodes}" if c.nodes else ""),
        "",
        f"trainer  {lay.world_size} GPUs ({cfg.trainer.nodes} node(s)): TP{lay.tp} CP{lay.cp} PP{lay.pp}"
        f"{f' VPP{t.vpp}' if t.vpp > 1 else ''} EP{lay.ep} ETP{lay.etp} -> DP{lay.dp} EDP{lay.edp}; "
        f"per GPU of pipeline stage {t.stage}: {_b(t.params)} parameters ({_b(t.dense_params)} dense, "
        f"{_b(t.expert_params)} expert)",
        f"  activations at T = {t.tokens_per_micro_batch} tokens per micro-batch ({t.tokens_note}), no recompute",
        f"  {'GiB per GPU':<34}{'weights':>9}{'grads':>9}{'optim':>9}{'static':>9}{'activ':>9}{'total':>9}",
    ]
    wd = "bf16" if cfg.trainer.params_dtype == "bf16" else "fp32"
    rows = [
        ("optimizer on every rank", t.optimizer_plain, not t.distributed),
        (f"distributed (dense /{lay.dp * lay.cp}, expert /{lay.edp})", t.optimizer_distributed, t.distributed),
        ("distributed, offloaded to CPU", 0, False),
    ]
    for name, opt, configured in rows:
        static = t.weights + t.grads + opt
        mark = " <- configured" if configured else ""
        out.append(f"  {name:<34}{_g(t.weights)} {_g(t.grads)} {_g(opt)} {_g(static)} {_g(t.activations)} "
                   f"{_g(static + t.activations)}{mark}")
    out.append(f"  ({wd} weights, fp32 grads, fp32 master + Adam moments; usable {t.usable / GiB:.1f} GiB = "
               f"cluster.gpu_memory_gib - reserved_gib; offloaded optimizer: {t.host_optimizer_per_node / GiB:.0f} GiB "
               f"host memory per node)")
    kv_hint = f"{e.kv_tokens / max(cfg.rollout.max_new_tokens, 1):.0f} responses of rollout.max_new_tokens"
    out += [
        "",
        f"engine   {e.num_engines} x {e.devices} GPUs: TP{e.tp} EP{e.ep}, {cfg.engine.dtype}",
        f"  weights per GPU {_g(e.weights).strip()} GiB; KV pool {_g(max(e.kv_pool, 0)).strip()} GiB at "
        f"mem_fraction_static {e.mem_fraction:g}{' (assumed)' if e.mem_fraction_assumed else ''} = "
        f"{e.kv_tokens} tokens ({e.kv_bytes_per_token / 1024:.0f} KiB each; {kv_hint})",
        "",
        f"weight sync  {w.bytes / 1e9:.2f} GB ({w.bytes / GiB:.2f} GiB, {cfg.engine.dtype}) in {w.buckets} buckets of "
        f"{w.bucket_bytes / 2**20:g} MiB; lower bound {w.seconds:.2f} s at cluster.link_bandwidth_gb_s="
        f"{c.link_bandwidth_gb_s:g} GB/s",
    ]
    for x in plan.warnings:
        out.append(f"warning: {x}")
    for x in plan.refusals:
        out.append(f"DOES NOT FIT: {x}")
    return "\n".join(out) + "\n"
