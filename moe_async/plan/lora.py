"""LoRA adapter counts for the plan (elements), as ``moe_async.lora`` builds and exports them.

Per adapted linear of input ``in`` and output ``out``, ``A [r, in]`` and ``B [out, r]``; on one
trainer GPU (TP as Megatron-Bridge shards LoRA): a column linear (fused qkv ``[q + 2 kv, H]``,
gated fc1 ``[2 I, H]``) keeps ``A`` whole and ``B / TP``, a row linear (o ``[H, q]``, fc2
``[H, I]``) ``A / TP`` and ``B`` whole; dense MLPs use ``intermediate_size``, shared experts
their width; routed experts (``I`` = ``moe_intermediate_size``) one adapter per expert held on
its EP rank (``per_expert``: ``E / EP`` of them) or one per layer on every rank (``shared``).
The sync sends the PEFT tensors (fp32): the fused weights' ``A`` once per part (q, k, v: 3;
gate, up: 2) and every routed expert's adapter (``shared``: the one adapter per expert).
MLA attention (no KV groups) has no fused qkv to adapt; its o projection (``linear_proj``, HF
``o_proj``) is a row linear ``[H, nh v_head_dim]``. No adapter at all (``peft == 0`` over the
model's layers): the targets match no linear of the model."""

from __future__ import annotations

from dataclasses import dataclass

from moe_async.layout import ParallelLayout
from moe_async.lora.config import LoraConfig
from moe_async.plan.arch import LayerParams, ModelShape


@dataclass(frozen=True)
class LoraCount:
    """Adapter elements: ``dense`` / ``expert`` on one GPU (the optimizer shards them over DP x
    CP / EDP), ``peft``: the whole exported adapter (the sync's tensors)."""

    dense: int = 0
    expert: int = 0
    peft: int = 0

    def __add__(self, o: "LoraCount") -> "LoraCount":
        return LoraCount(self.dense + o.dense, self.expert + o.expert, self.peft + o.peft)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _linear(r: int, n_in: int, n_out: int, kind: str, tp: int, a_copies: int = 1) -> LoraCount:
    """One adapted linear: per-GPU elements at TP ``tp`` and its PEFT elements (``A`` written
    ``a_copies`` times: the parts of a fused weight)."""
    a, b = r * n_in, n_out * r
    per_gpu = a + _ceil_div(b, tp) if kind == "column" else _ceil_div(a, tp) + b
    return LoraCount(dense=per_gpu, peft=a_copies * a + b)


def layer_lora(shape: ModelShape, lp: LayerParams, cfg: LoraConfig, lay: ParallelLayout) -> LoraCount:
    """The adapters of one decoder layer ``lp`` of ``shape`` under ``cfg`` at layout ``lay``."""
    r, H, t = cfg.rank, shape.hidden_size, set(cfg.target_modules)
    out = LoraCount()
    nh, ng = shape.num_attention_heads, shape.num_key_value_heads
    if ng:  # GQA: act_attn = 2 q + 2 kv (q, k, v and the attention output), d = head_dim
        d = shape.act_attn // (2 * (nh + ng))
        q, kv = nh * d, ng * d
        if "q_proj" in t:
            out += _linear(r, H, q + 2 * kv, "column", lay.tp, a_copies=3)
    else:  # MLA: the attention output is nh v heads; no fused qkv
        q = nh * shape.v_head_dim
    if "o_proj" in t:
        out += _linear(r, q, H, "row", lay.tp)
    width = (shape.shared_intermediate_size if lp.moe else shape.dense_intermediate_size) or 0
    if width and lp.mlp_tp:
        if "gate_proj" in t:
            out += _linear(r, H, 2 * width, "column", lay.tp, a_copies=2)
        if "down_proj" in t:
            out += _linear(r, width, H, "row", lay.tp)
    if lp.moe and lp.expert and cfg.experts != "off":
        im, E = shape.moe_intermediate_size, shape.num_experts
        one = (r * H + 2 * im * r if "gate_proj" in t else 0) + (r * im + H * r if "down_proj" in t else 0)
        held = _ceil_div(E, lay.ep) if cfg.experts == "per_expert" else 1  # ETP 1 with expert adapters
        out += LoraCount(expert=held * one, peft=E * one)
    return out


def lora_counts(shape: ModelShape, layers: list[LayerParams], cfg: LoraConfig, lay: ParallelLayout) -> LoraCount:
    """The adapters of ``layers`` (one pipeline stage's) summed; ``peft`` over those layers."""
    total = LoraCount()
    for lp in layers:
        total += layer_lora(shape, lp, cfg, lay)
    return total

