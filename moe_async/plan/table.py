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
        f"  activations at T = {t.tokens_per_micro_batch} tokens per micro-batch ({t.tokens_note}), {t.recompute}",
        f"  recompute: activations {_g(t.activations).strip()} GiB ({_g(t.activations_no_recompute).strip()} GiB "
        f"without recompute); routed experts' activations x{t.moe_imbalance:g} (cluster.moe_imbalance; balanced: "
        f"{_g(t.activations_balanced).strip()} GiB)",
        f"  pipeline stages: {'+'.join(str(n) for n in t.stage_layers)} layers"
        + (" (uneven: trainer.num_layers_in_first/last_pipeline_stage)" if len(set(t.stage_layers)) > 1 else ""),
        f"  sync buckets on a sending rank: {_g(t.sync_buckets).strip()} GiB (weight_sync.bucket_bytes"
        f"{' x 2 with overlap' if cfg.weight_sync.overlap else ''})",
        f"  {'GiB per GPU':<34}{'weights':>9}{'grads':>9}{'optim':>9}{'static':>9}{'activ':>9}{'total':>9}",
    ]
    if cfg.trainer.lora is not None:
        lo = cfg.trainer.lora
        out.insert(-1, f"  LoRA rank {lo.rank} (experts: {lo.experts}): {t.adapter_params:,} adapter parameters per GPU; "
                       "the base is frozen (weights only: no grads, no optimizer state)")
    wd = "bf16" if cfg.trainer.params_dtype == "bf16" else "fp32"
    f = t.offload_fraction
    rows = [
        ("optimizer on every rank", t.optimizer_plain, not t.distributed),
        (f"distributed (dense /{lay.dp * lay.cp}, expert /{lay.edp})", t.optimizer_distributed, t.distributed and not f),
        (f"distributed, {f:.0%} offloaded to CPU" if f else "distributed, offloaded to CPU",
         int(t.optimizer_distributed * (1 - f)) if f else 0, bool(f)),
    ]
    for name, opt, configured in rows:
        static = t.weights + t.grads + opt
        total = static + t.activations + t.sync_buckets
        mark = (f" <- configured, headroom {100 * (1 - total / t.usable):.0f}%" if configured else "")
        out.append(f"  {name:<34}{_g(t.weights)} {_g(t.grads)} {_g(opt)} {_g(static)} {_g(t.activations)} "
                   f"{_g(total)}{mark}")
    out.append(f"  ({wd} weights, fp32 grads, fp32 master + Adam moments; total includes the sync buckets; usable "
               f"{t.usable / GiB:.1f} GiB = cluster.gpu_memory_gib - reserved_gib; offloaded optimizer: "
               f"{t.host_optimizer_per_node / GiB:.0f} GiB host memory per node)")
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
        f"{c.link_bandwidth_gb_s:g} GB/s (every engine rank receives every byte)",
    ]
    if cfg.trainer.lora is not None:
        out[-1] = (f"weight sync  adapter only: {w.bytes / 1e9:.4f} GB ({w.bytes / GiB:.4f} GiB, the PEFT tensors in "
                   f"fp32); lower bound {w.seconds:.4f} s at cluster.link_bandwidth_gb_s={c.link_bandwidth_gb_s:g} GB/s")
    if w.sender_bytes:
        out.append(f"  weight_sync.senders: all: {len(w.sender_bytes)} senders (by trainer rank), GB each: "
                   + " ".join(f"{b / 1e9:.2f}" for b in w.sender_bytes)
                   + f"; the busiest sends for {w.sender_seconds:.2f} s (one sender: {w.bytes / w.bandwidth:.2f} s)")
    else:
        out.append(f"  weight_sync.senders: one: rank 0 sends all {w.bytes / 1e9:.2f} GB")
    for x in plan.warnings:
        out.append(f"warning: {x}")
    for x in plan.refusals:
        out.append(f"DOES NOT FIT: {x}")
    return "\n".join(out) + "\n"
