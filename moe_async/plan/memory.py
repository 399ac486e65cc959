"""Layout checks against the model and the cluster, and per-GPU memory estimates.

Per-GPU trainer memory (weights, fp32 grads, Adam state on every rank, distributed or
offloaded, activations at the configured tokens per micro-batch and recompute), each engine's
weights and KV pool, and one weight sync's bytes. Units: bytes in the dataclasses; GiB = 2**30
bytes and GB/s = 10**9 bytes/s where printed.

Design notes: ``docs/design/plan.md``."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from moe_async.layout import ParallelLayout
from moe_async.plan.arch import ModelShape
from moe_async.plan.lora import lora_counts

if TYPE_CHECKING:
    from moe_async.config import ExperimentConfig

GiB = 2**30
_DTYPE_BYTES = {"bf16": 2, "fp32": 4}
#: SGLang's static memory fraction assumed when engine.sglang_args sets none (it picks one from the GPU)
DEFAULT_MEM_FRACTION_STATIC = 0.85


class PlanError(ValueError):
    """A layout the model or cluster cannot take; one line per field and rule."""


@dataclass(frozen=True)
class TrainerEstimate:
    """Per-GPU trainer memory (bytes) of the largest pipeline stage ``stage``."""

    layout: ParallelLayout
    vpp: int
    stage: int
    dense_params: int
    expert_params: int
    weights: int
    grads: int
    optimizer_plain: int
    optimizer_distributed: int
    distributed: bool
    activations: int
    tokens_per_micro_batch: int
    tokens_note: str
    host_optimizer_per_node: int  # the offloaded (distributed) optimizer state of one node's ranks
    ranks_per_node: int
    usable: int
    offload_fraction: float = 0.0  # trainer.optimizer_offload_fraction when optimizer_cpu_offload, else 0
    recompute: str = "no recompute"  # how the activations were counted (trainer.recompute_*)
    activations_no_recompute: int = 0  # the same stage without recompute
    activations_balanced: int = 0  # the activations at moe_imbalance 1 (balanced routing)
    moe_imbalance: float = 1.0
    sync_buckets: int = 0  # weight-sync bucket buffers on a sending rank
    stage_layers: tuple[int, ...] = ()  # layers per pipeline stage
    adapter_params: int = 0  # trainer.lora: adapter elements per GPU (the base is frozen: weights only)

    @property
    def params(self) -> int:
        return self.dense_params + self.expert_params

    @property
    def optimizer(self) -> int:
        """The configured optimizer's GPU bytes (distributed or not; the share not offloaded)."""
        opt = self.optimizer_distributed if self.distributed else self.optimizer_plain
        return int(opt * (1 - self.offload_fraction))

    @property
    def static(self) -> int:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.static + self.activations + self.sync_buckets

    @property
    def total_offloaded(self) -> int:
        """Weights + grads + activations + sync buckets: the whole optimizer in host memory."""
        return self.weights + self.grads + self.activations + self.sync_buckets

    @property
    def total_balanced(self) -> int:
        """:attr:`total` with balanced routing (moe_imbalance 1)."""
        return self.total - self.activations + self.activations_balanced


@dataclass(frozen=True)
class EngineEstimate:
    """Per-GPU memory (bytes) of one engine."""

    num_engines: int
    tp: int
    ep: int
    devices: int
    weights: int
    mem_fraction: float
    mem_fraction_assumed: bool
    kv_pool: int
    kv_bytes_per_token: int
    gpu_bytes: int

    @property
    def kv_tokens(self) -> int:
        return max(self.kv_pool, 0) // self.kv_bytes_per_token


@dataclass(frozen=True)
class SyncEstimate:
    """One weight sync: ``bytes`` over a link of ``bandwidth`` bytes/s, ``buckets`` of ``bucket_bytes``;
    ``sender_bytes``: what each sending trainer rank sends (``weight_sync.senders``: ``one``:
    rank 0 all of it; ``all``: every rank its own shards)."""

    bytes: int
    bandwidth: float
    bucket_bytes: int
    sender_bytes: tuple[int, ...] = ()

    @property
    def seconds(self) -> float:
        """Lower bound: every engine rank receives every byte over its link (and no sender
        sends more than all of them)."""
        return self.bytes / self.bandwidth

    @property
    def sender_seconds(self) -> float:
        """The busiest sender's bytes over its link (rank 0's whole model with one sender)."""
        return max(self.sender_bytes or (self.bytes,)) / self.bandwidth

    @property
    def buckets(self) -> int:
        return math.ceil(self.bytes / self.bucket_bytes)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron's padded vocab: ``vocab`` rounded up to a multiple of ``divisible_by x tp``."""
    m = divisible_by * tp
    return _ceil_div(vocab, m) * m


def check_layout(shape: ModelShape, cfg: "ExperimentConfig", *, cluster: bool = True) -> list[str]:
    """The rules ``cfg`` (an ExperimentConfig) breaks for ``shape``, one message each (empty: none).
    ``cluster=False``: only the rules of the model (``moe-async train`` at start-up, which has
    its own machines, not ``cluster.*``'s).

    Trainer (Megatron-Core): attention heads and KV groups divisible by TP, experts by EP, the
    expert FFN by ETP, dense / shared FFN widths by TP, layers by PP x VPP, full recompute's
    ``recompute_num_layers`` within a stage, ``moe_router_bias_update_rate`` only with a router expert
    bias, and its ranks per node at most ``cluster.gpus_per_node``. Engine (SGLang): heads divisible by its TP, KV heads
    and TP one a multiple of the other, experts by its EP, an engine within a node or on
    ``engine.nodes_per_engine`` whole nodes. Devices: trainer + engines within ``cluster.nodes x gpus_per_node`` when nodes is set.
    """
    t, e, c = cfg.trainer, cfg.engine, cfg.cluster
    lay = t.layout
    assert lay.world_size is not None  # the trainer's layout has its world size
    errs: list[str] = []
    src = shape.source

    def need(ok: bool, msg: str) -> None:
        if not ok:
            errs.append(msg)

    nh, ng = shape.num_attention_heads, shape.num_key_value_heads
    need(nh % lay.tp == 0, f"trainer.tensor_model_parallel_size={lay.tp} does not divide the {nh} attention heads "
                           f"({src}: num_attention_heads; Megatron splits heads over TP)")
    if ng is not None:
        need(ng % lay.tp == 0, f"trainer.tensor_model_parallel_size={lay.tp} does not divide the {ng} KV groups "
                               f"({src}: num_key_value_heads; Megatron splits query groups over TP)")
    need(shape.num_experts % lay.ep == 0,
         f"trainer.expert_model_parallel_size={lay.ep} does not divide the {shape.num_experts} experts ({src})")
    need(shape.moe_intermediate_size % lay.etp == 0,
         f"trainer.expert_tensor_parallel_size={lay.etp} does not divide the expert FFN size "
         f"{shape.moe_intermediate_size} ({src}: moe_intermediate_size)")
    for width, what in ((shape.dense_intermediate_size, "intermediate_size (dense layers)"),
                        (shape.shared_intermediate_size, "the shared experts' FFN")):
        if width:
            need(width % lay.tp == 0, f"trainer.tensor_model_parallel_size={lay.tp} does not divide {what} "
                                      f"{width} ({src})")
    vpp = t.virtual_pipeline_model_parallel_size or 1
    first, last = t.num_layers_in_first_pipeline_stage, t.num_layers_in_last_pipeline_stage
    if first is not None or last is not None:
        rest = shape.num_layers - (first or 0) - (last or 0)
        others = lay.pp - (first is not None) - (last is not None)
        # every other stage holds at least one layer (Megatron-Core refuses an empty middle stage)
        need(rest >= 0 and (rest % others == 0 and rest >= others if others else rest == 0),
             f"{shape.num_layers} layers ({src}: num_hidden_layers) less trainer.num_layers_in_first_pipeline_stage="
             f"{first} and num_layers_in_last_pipeline_stage={last} leave {rest} layers for {others} other "
             f"stage(s) of trainer.pipeline_model_parallel_size={lay.pp}: they must split evenly, at least one each "
             "(Megatron-Core's TransformerConfig)")
    else:
        need(shape.num_layers % (lay.pp * vpp) == 0,
             f"{shape.num_layers} layers ({src}: num_hidden_layers) are not divisible by trainer."
             f"pipeline_model_parallel_size={lay.pp} x virtual_pipeline_model_parallel_size={vpp} = {lay.pp * vpp} "
             "(each pipeline chunk holds the same number of layers)")
    n_rec = t.recompute_num_layers
    if t.recompute_granularity == "full" and n_rec is not None:
        counts = stage_layer_counts(shape.num_layers, lay.pp, first, last)
        most = max(counts) // vpp  # the layers of one model chunk (Megatron recomputes per chunk)
        need(n_rec <= most,
             f"trainer.recompute_num_layers={n_rec} exceeds the {most} layers of the largest pipeline "
             f"{'chunk' if vpp > 1 else 'stage'} ({shape.num_layers} layers, {src}: num_hidden_layers, over "
             f"trainer.pipeline_model_parallel_size={lay.pp}{f' x virtual stages {vpp}' if vpp > 1 else ''}); "
             "Megatron-Core takes 1 to the layers per pipeline rank")
    rate = t.moe_router_bias_update_rate
    if rate > 0:
        from moe_async.models import get_family
        from moe_async.models.sigmoid_moe import SigmoidMoeFamily  # the routers with an expert bias

        need(isinstance(get_family(shape.model_type), SigmoidMoeFamily),
             f"trainer.moe_router_bias_update_rate={rate}: model_type={shape.model_type!r} ({src}) has no router "
             "expert bias (only the sigmoid routers of deepseek_v3-style models update one aux-loss-free); "
             "set it to 0")
    per_node = lay.world_size // t.nodes
    need(not cluster or per_node <= c.gpus_per_node,
         f"trainer: {per_node} ranks per node (trainer.world_size={lay.world_size} / trainer.nodes={t.nodes}) exceed "
         f"cluster.gpus_per_node={c.gpus_per_node} (one GPU per rank); raise trainer.nodes")
    # engines
    need(nh % e.tensor_parallel_size == 0, f"engine.tensor_parallel_size={e.tensor_parallel_size} does not divide the "
                                          f"{nh} attention heads ({src}; SGLang splits heads over its TP)")
    if ng is not None:
        tp = e.tensor_parallel_size
        need(ng % tp == 0 or tp % ng == 0, f"engine.tensor_parallel_size={tp} and the {ng} KV heads ({src}): one must "
                                           "divide the other (SGLang splits or replicates KV heads)")
    need(shape.num_experts % e.expert_parallel_size == 0,
         f"engine.expert_parallel_size={e.expert_parallel_size} does not divide the {shape.num_experts} experts ({src})")
    if not cluster:
        return errs
    dpe, npe = e.resolved_devices_per_engine, e.nodes_per_engine
    need(e.devices_per_engine_node <= c.gpus_per_node,
         f"engine.devices_per_engine={dpe} on engine.nodes_per_engine={npe} node(s) = {e.devices_per_engine_node} "
         f"GPUs per node exceed cluster.gpus_per_node={c.gpus_per_node}: "
         + (f"set engine.nodes_per_engine={dpe // c.gpus_per_node} (SGLang --nnodes; each node holds one bundle of "
            "the engine)" if dpe % c.gpus_per_node == 0 else
            f"an engine larger than a node takes whole nodes, so its devices must be a multiple of "
            f"{c.gpus_per_node} (or at most {c.gpus_per_node})"))
    need(npe == 1 or e.devices_per_engine_node == c.gpus_per_node,
         f"engine.nodes_per_engine={npe}: an engine spanning nodes takes them whole ({e.devices_per_engine_node} of "
         f"cluster.gpus_per_node={c.gpus_per_node} GPUs per node)")
    if cfg.weight_sync.transport == "tensor":
        want_one = lay.world_size + e.num_engines * dpe
        need(npe == 1 and want_one <= c.gpus_per_node,
             f"weight_sync.transport='tensor' hands the engines memory handles (CUDA IPC, shared memory) that "
             f"only the trainer's host can open: trainer.world_size={lay.world_size} + engine.num_engines="
             f"{e.num_engines} x devices_per_engine={dpe} = {want_one} GPUs must fit one node "
             f"(cluster.gpus_per_node={c.gpus_per_node}); use weight_sync.transport='broadcast' across nodes")
    if c.nodes is not None:
        have = c.nodes * c.gpus_per_node
        want = lay.world_size + e.num_engines * dpe
        need(want <= have, f"trainer.world_size={lay.world_size} + engine.num_engines={e.num_engines} x "
                           f"devices_per_engine={dpe} = {want} GPUs exceed cluster.nodes={c.nodes} x "
                           f"gpus_per_node={c.gpus_per_node} = {have}")
    return errs


def stage_layer_counts(num_layers: int, pp: int, first: int | None, last: int | None) -> list[int]:
    """Layers per pipeline stage (no virtual stages): ``first`` / ``last`` on the first / last
    stage when set, the rest split evenly over the others (Megatron-Core's
    ``num_layers_in_first/last_pipeline_stage``); ``num_layers / pp`` each otherwise."""
    if pp == 1:
        return [num_layers]
    if first is None and last is None:
        return [num_layers // pp] * pp
    rest = num_layers - (first or 0) - (last or 0)
    others = pp - (first is not None) - (last is not None)
    mid = rest // others if others else 0
    counts = [mid] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def _stage_layers(shape: ModelShape, lay: ParallelLayout, vpp: int, stage: int, counts: list[int] | None) -> list:
    """The layer shapes pipeline ``stage`` holds: its chunks ``v*PP + stage`` of ``L/(PP x VPP)``
    layers, or with uneven stages (``counts``, no VPP) its own run of layers."""
    if counts is not None:
        start = sum(counts[:stage])
        return list(shape.layers[start:start + counts[stage]])
    n = shape.num_layers // (lay.pp * vpp)
    return [lp for v in range(vpp) for lp in shape.layers[(v * lay.pp + stage) * n:(v * lay.pp + stage + 1) * n]]


def _stage_params(shape: ModelShape, lay: ParallelLayout, vpp: int, vocab_pad: int, stage: int,
                  counts: list[int] | None = None) -> tuple[int, int]:
    """(dense, expert) parameters one GPU of pipeline ``stage`` holds."""
    dense = expert = 0
    for lp in _stage_layers(shape, lay, vpp, stage, counts):
        dense += _ceil_div(lp.attn_tp + lp.attn_kv + lp.mlp_tp, lay.tp) + lp.replicated
        expert += _ceil_div(lp.expert, lay.ep * lay.etp)
    emb = vocab_pad * shape.hidden_size // lay.tp
    if stage == 0:
        dense += emb
    if stage == lay.pp - 1:
        dense += shape.final_norm + (emb if not shape.tied or lay.pp > 1 else 0)
    return dense, expert


def _layer_activation_parts(shape: ModelShape, lp, lay: ParallelLayout, t: float,
                            imbalance: float = 1.0) -> dict[str, float]:
    """Bytes one layer keeps for its backward at ``t`` tokens per rank (``docs/design/plan.md``), by the
    part Megatron's selective recompute names: ``layernorm`` (the two norm outputs), ``attn``
    (QKV input side and q/k/v/output; ``core_attn`` recompute drops the S x S scores, which flash
    attention never keeps: nothing here), ``mla_up_proj`` (MLA's latents), ``moe`` (router
    input and scores), ``experts`` (the routed copies' inputs and gate/up outputs, times
    ``imbalance``), ``moe_act`` (their SwiGLU outputs, times ``imbalance``), ``shared_experts``,
    ``mlp`` (a dense layer's MLP)."""
    h = shape.hidden_size
    parts = {"layernorm": 2 * t * h * (2 if lp.moe or shape.dense_intermediate_size else 1),
             "attn": 2 * t * (h + shape.act_attn / lay.tp),  # act_attn widths are split over TP heads
             "mla_up_proj": 2 * t * lay.tp * shape.act_attn_whole}  # every TP rank, its group's tokens
    k, i = shape.top_k, shape.moe_intermediate_size
    if lp.moe:
        parts["moe"] = 2 * t * h + 4 * t * shape.num_experts
        parts["experts"] = 2 * t * k * (lay.etp * h + 2 * i) * imbalance
        parts["moe_act"] = 2 * t * k * i * imbalance
        if shape.shared_intermediate_size:
            parts["shared_experts"] = 2 * t * (h + 3 * shape.shared_intermediate_size / lay.tp)
    else:
        parts["mlp"] = 2 * t * (h + 3 * (shape.dense_intermediate_size or 0) / lay.tp)
    return parts


def _layer_activation_bytes(shape: ModelShape, lp, lay: ParallelLayout, t: float, imbalance: float = 1.0,
                            recompute_modules: tuple[str, ...] = ()) -> float:
    """Bytes one layer keeps for its backward at ``t`` tokens per rank (``docs/design/plan.md``), less
    the parts in ``recompute_modules`` (selective recompute; ``moe`` drops the experts' too)."""
    parts = _layer_activation_parts(shape, lp, lay, t, imbalance)
    drop = set(recompute_modules)
    if "moe" in drop:
        drop |= {"experts", "moe_act", "shared_experts"}
    return sum(v for k, v in parts.items() if k not in drop)


def stage_activation_bytes(shape: ModelShape, layers: list, lay: ParallelLayout, t: float, in_flight: float,
                           cfg_trainer, imbalance: float) -> float:
    """Activation bytes of one pipeline stage holding ``layers``, ``in_flight`` micro-batches
    (1F1B), at ``t`` tokens per rank, under the trainer's recompute setting:

    * none: every layer's :func:`_layer_activation_bytes`, times ``in_flight``;
    * selective: the same without ``recompute_modules``' parts (default ``core_attn``);
    * full: a recomputed layer keeps only its bf16 input ``2 t H``: 'uniform' keeps the input of
      each group of ``recompute_num_layers`` layers, 'block' the inputs of the first
      ``recompute_num_layers`` layers and everything of the others; plus, once, the largest
      group's activations while it is recomputed in the backward.
    """
    g = cfg_trainer.recompute_granularity
    h = shape.hidden_size
    full = [_layer_activation_bytes(shape, lp, lay, t, imbalance) for lp in layers]
    if g is None:
        return sum(full) * in_flight
    if g == "selective":
        mods = tuple(cfg_trainer.recompute_modules or ("core_attn",))
        return sum(_layer_activation_bytes(shape, lp, lay, t, imbalance, mods) for lp in layers) * in_flight
    n = cfg_trainer.recompute_num_layers
    if cfg_trainer.recompute_method == "uniform":
        groups = [full[i:i + n] for i in range(0, len(full), n)]
        return len(groups) * 2 * t * h * in_flight + max((sum(gr) for gr in groups), default=0)
    kept = sum(full[n:])
    return (min(n, len(full)) * 2 * t * h + kept) * in_flight + max(full[:n], default=0)


def recompute_note(cfg_trainer) -> str:
    """How the activations are counted, in the trainer's own field names."""
    g = cfg_trainer.recompute_granularity
    if g is None:
        return "no recompute"
    if g == "selective":
        return f"selective recompute of {','.join(cfg_trainer.recompute_modules or ('core_attn',))}"
    return (f"full recompute, {cfg_trainer.recompute_method} {cfg_trainer.recompute_num_layers} "
            "layer(s): layer inputs kept")


def tokens_per_micro_batch(cfg: "ExperimentConfig") -> tuple[int, str]:
    """T of the activation estimate and how it was chosen."""
    t, r = cfg.trainer, cfg.rollout
    if t.max_tokens_per_micro_batch is not None:
        if r.max_new_tokens > t.max_tokens_per_micro_batch:  # a longer sequence is a micro-batch of its own
            return r.max_new_tokens, (f"rollout.max_new_tokens, above trainer.max_tokens_per_micro_batch="
                                      f"{t.max_tokens_per_micro_batch}: a longer sequence goes alone")
        return t.max_tokens_per_micro_batch, "trainer.max_tokens_per_micro_batch"
    n = t.micro_batch_size * cfg.rollout.max_new_tokens
    return n, (f"trainer.micro_batch_size={t.micro_batch_size} x rollout.max_new_tokens={cfg.rollout.max_new_tokens} "
               "(prompt not included: set trainer.max_tokens_per_micro_batch for a bound)")


def estimate_trainer(shape: ModelShape, cfg: "ExperimentConfig") -> TrainerEstimate:
    """Per-GPU trainer memory of the largest stage (``docs/design/plan.md``); call after
    :func:`check_layout`."""
    t, c = cfg.trainer, cfg.cluster
    lay = t.layout
    assert lay.world_size is not None  # the trainer's layout has its world size
    vpp = t.virtual_pipeline_model_parallel_size or 1
    vocab_pad = padded_vocab(shape.vocab_size, t.make_vocab_size_divisible_by, lay.tp)
    w_bytes = _DTYPE_BYTES[t.params_dtype]
    opt_bytes = 12 if t.params_dtype == "bf16" else 8
    T, note = tokens_per_micro_batch(cfg)
    tok = T / (lay.cp * lay.tp)
    uneven = t.num_layers_in_first_pipeline_stage is not None or t.num_layers_in_last_pipeline_stage is not None
    counts = stage_layer_counts(shape.num_layers, lay.pp, t.num_layers_in_first_pipeline_stage,
                                t.num_layers_in_last_pipeline_stage) if uneven else None
    imb = c.moe_imbalance
    # weight sync: the bucket being sent and, with overlap, the next one being packed, on a sender
    sync = cfg.weight_sync.bucket_bytes * (2 if cfg.weight_sync.overlap else 1)
    if t.lora is not None:  # the adapter sync gathers the PEFT tensors in host memory: no GPU buckets
        sync = 0
    offload = t.optimizer_offload_fraction if t.optimizer_cpu_offload else 0.0
    best: TrainerEstimate | None = None
    for stage in range(lay.pp):
        dense, expert = _stage_params(shape, lay, vpp, vocab_pad, stage, counts)
        layers = _stage_layers(shape, lay, vpp, stage, counts)
        in_flight = lay.pp - stage  # 1F1B: stage p warms up PP - p micro-batches
        factor = 1 + (lay.pp - 1) / (lay.pp * vpp) if vpp > 1 and stage == 0 else 1
        act = stage_activation_bytes(shape, layers, lay, tok, in_flight * factor, t, imb)
        act1 = stage_activation_bytes(shape, layers, lay, tok, in_flight * factor, t, 1.0)
        act0 = sum(_layer_activation_bytes(shape, lp, lay, tok, imb) for lp in layers) * in_flight * factor
        if stage == lay.pp - 1:
            logits = 10 * (T / lay.cp) * (vocab_pad / lay.tp)
            act, act1, act0 = act + logits, act1 + logits, act0 + logits
        # trained: every parameter, or with trainer.lora the adapters only (grads, optimizer state)
        tr_dense, tr_expert = dense, expert
        if t.lora is not None:
            ad = lora_counts(shape, layers, t.lora, lay)
            tr_dense, tr_expert = ad.dense, ad.expert
        adapters = tr_dense + tr_expert if t.lora is not None else 0
        dist = tr_dense * opt_bytes / (lay.dp * lay.cp) + tr_expert * opt_bytes / lay.edp
        est = TrainerEstimate(
            layout=lay, vpp=vpp, stage=stage, dense_params=dense, expert_params=expert,
            weights=(dense + expert + adapters) * w_bytes, grads=(tr_dense + tr_expert) * 4,
            optimizer_plain=(tr_dense + tr_expert) * opt_bytes, optimizer_distributed=int(dist),
            adapter_params=adapters,
            distributed=t.use_distributed_optimizer, activations=int(act), tokens_per_micro_batch=T,
            tokens_note=note, host_optimizer_per_node=0, ranks_per_node=lay.world_size // t.nodes,
            usable=int((c.gpu_memory_gib - c.reserved_gib) * GiB), offload_fraction=offload,
            recompute=recompute_note(t), activations_no_recompute=int(act0), activations_balanced=int(act1),
            moe_imbalance=imb, sync_buckets=sync,
            stage_layers=tuple(counts or [len(_stage_layers(shape, lay, vpp, p, None)) for p in range(lay.pp)]))
        if best is None or est.total > best.total:
            best = est
    # the offloaded share of the largest stage's distributed optimizer, on every rank of a node
    assert best is not None  # at least one stage
    host = int(best.optimizer_distributed * (offload or 1.0)) * best.ranks_per_node
    return replace(best, host_optimizer_per_node=host)


def _mem_fraction(cfg: "ExperimentConfig") -> tuple[float, bool]:
    args = cfg.engine.sglang_args
    for k in ("mem_fraction_static", "mem-fraction-static"):
        if k in args:
            v = args[k]
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 1:
                raise PlanError(f"engine.sglang_args.{k}={v!r}: must be a fraction in (0, 1)")
            return float(v), False
    return DEFAULT_MEM_FRACTION_STATIC, True


def estimate_engine(shape: ModelShape, cfg: "ExperimentConfig") -> EngineEstimate:
    """Per-GPU memory of one engine (``docs/design/plan.md``)."""
    e, c = cfg.engine, cfg.cluster
    tp = e.tensor_parallel_size
    w = _DTYPE_BYTES[e.dtype]
    kv_split = min(tp, shape.num_key_value_heads) if shape.num_key_value_heads else 1
    params = _ceil_div(shape.embedding + shape.output, tp) + shape.final_norm
    for lp in shape.layers:
        params += _ceil_div(lp.attn_tp + lp.mlp_tp + lp.expert, tp) + _ceil_div(lp.attn_kv, kv_split) + lp.replicated
    weights = params * w
    frac, assumed = _mem_fraction(cfg)
    gpu = int(c.gpu_memory_gib * GiB)
    if shape.num_key_value_heads:
        kv_token = shape.num_layers * (shape.kv_cache_per_token_layer // kv_split) * w
    else:  # MLA latent, whole on every rank
        kv_token = shape.num_layers * shape.kv_cache_per_token_layer * w
    return EngineEstimate(num_engines=e.num_engines, tp=tp, ep=e.expert_parallel_size,
                          devices=e.resolved_devices_per_engine, weights=weights, mem_fraction=frac,
                          mem_fraction_assumed=assumed, kv_pool=int(frac * gpu) - weights,
                          kv_bytes_per_token=kv_token, gpu_bytes=gpu)


def estimate_sync(shape: ModelShape, cfg: "ExperimentConfig") -> SyncEstimate:
    """One weight sync: every parameter at ``engine.dtype`` over ``cluster.link_bandwidth_gb_s``
    (with ``trainer.lora``: the adapter's PEFT tensors, fp32, :mod:`moe_async.plan.lora`);
    with ``weight_sync.senders: all`` the bytes per sender as
    :func:`moe_async.weight_sync.senders.assign_senders` gives them for the shards and their
    data-parallel replicas on Megatron's rank grids (:func:`sender_meta`), listed by global rank (ranks that send
    nothing left out; never more senders than trainer ranks)."""
    from moe_async.weight_sync.senders import assign_senders

    w = _DTYPE_BYTES[cfg.engine.dtype]
    total = shape.total * w
    if cfg.trainer.lora is not None:  # adapter-only sync: the PEFT tensors, fp32, from rank 0
        whole = ParallelLayout(world_size=1)  # the PEFT counts do not depend on the layout
        peft = lora_counts(shape, list(shape.layers), cfg.trainer.lora, whole).peft
        return SyncEstimate(bytes=peft * 4, bandwidth=cfg.cluster.link_bandwidth_gb_s * 1e9,
                            bucket_bytes=cfg.weight_sync.bucket_bytes)
    sync = SyncEstimate(bytes=total, bandwidth=cfg.cluster.link_bandwidth_gb_s * 1e9,
                        bucket_bytes=cfg.weight_sync.bucket_bytes)
    lay = cfg.trainer.layout
    if cfg.weight_sync.senders != "all" or lay.world_size in (None, 1):
        return sync
    meta = sender_meta(shape, cfg, {2: "bfloat16", 4: "float32", 1: "uint8"}[w])
    per = [0] * len(meta)
    sizes = {name: fs[0] * w for rank_meta in meta for name, fs, *_ in rank_meta}
    for name, r in assign_senders(meta).items():
        per[r] += sizes[name]
    return replace(sync, sender_bytes=tuple(b for b in per if b))  # ranks assigned nothing send nothing


def sender_meta(shape: ModelShape, cfg: "ExperimentConfig", dtype: str) -> list[list[tuple]]:
    """Every trainer rank's shards with their data-parallel replicas (what the several-sender
    sync offers ``assign_senders``), in its metadata form (``(name, (numel,), (0,), (numel,),
    dtype)`` per holder), one pseudo tensor per layer and kind: TP-split attention / dense MLP
    (and embedding on the first stage, output layer on the last) held by the TP ranks of every
    data-parallel (and context-parallel) rank, norms by every rank of the stage, each routed
    expert by the ETP ranks of its EP rank at every expert data-parallel rank. Global ranks by
    Megatron-Core's order ``tp-cp-ep-dp-pp``: dense ``tp + TP*(cp + CP*(dp + DP*pp))``,
    expert ``etp + ETP*(ep + EP*(edp + EDP*pp))``."""
    t = cfg.trainer
    lay = t.layout
    uneven = t.num_layers_in_first_pipeline_stage is not None or t.num_layers_in_last_pipeline_stage is not None
    counts = stage_layer_counts(shape.num_layers, lay.pp, t.num_layers_in_first_pipeline_stage,
                                t.num_layers_in_last_pipeline_stage) if uneven else None
    vpp = t.virtual_pipeline_model_parallel_size or 1
    world = t.resolved_world_size
    per_stage = world // lay.pp
    meta: list[list[tuple]] = [[] for _ in range(world)]

    def add(name: str, numel: int, ranks) -> None:
        for r in ranks:
            meta[r].append((name, (numel,), (0,), (numel,), dtype))

    for stage in range(lay.pp):
        base = stage * per_stage
        tp_ranks = [base + i + lay.tp * c for c in range(lay.cp * lay.dp) for i in range(lay.tp)]
        stage_ranks = list(range(base, base + per_stage))
        for li, lp in enumerate(_stage_layers(shape, lay, vpp, stage, counts)):
            pre = f"pp{stage}.{li}."
            for kind in ("attn_tp", "attn_kv", "mlp_tp"):
                if getattr(lp, kind):
                    add(pre + kind, getattr(lp, kind), tp_ranks)
            if lp.replicated:
                add(pre + "replicated", lp.replicated, stage_ranks)
            if lp.expert:
                e_total = max(shape.num_experts, 1)
                for e in range(e_total):
                    ep = e * lay.ep // e_total
                    add(pre + f"expert{e}", lp.expert // e_total,
                        [base + i + lay.etp * (ep + lay.ep * d) for d in range(lay.edp) for i in range(lay.etp)])
        if stage == 0 and shape.embedding:
            add("embedding", shape.embedding, tp_ranks)
        if stage == lay.pp - 1:
            if shape.output:
                add("output_layer", shape.output, tp_ranks)
            if shape.final_norm:
                add("final_norm", shape.final_norm, stage_ranks)
    return meta
