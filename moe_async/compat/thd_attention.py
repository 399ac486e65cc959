"""Packed-sequence (THD) core attention for Megatron-Core's local layer spec, CPU only.

Used when CUDA is absent and ``trainer.sequence_packing`` resolves to ``thd`` (Megatron's local
``DotProductAttention`` refuses packed sequences; TE needs CUDA). Input ``query [T, np, hn]``,
``key``/``value [T, ng, hn]`` with RoPE applied per sequence; the local attention's math run
causally within each ``cu_seqlens`` segment (no scores across sequences), outputs concatenated
in packed order: equal to one causal attention per sequence.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from moe_async.compat.attention_spec import mixed_core_attention, swap_core_attention, LayerSpec

if TYPE_CHECKING:  # the checker sees the mixin over the class it is mixed into
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention as _MixinBase
else:
    _MixinBase = object

Tensor = torch.Tensor


def segment_bounds(cu_seqlens: Tensor, total: int) -> list[tuple[int, int]]:
    """``[(start, end), ...]``: the non-empty segments of ``cu_seqlens [n+1]`` (int, starting at
    0, non-decreasing), plus ``(cu_seqlens[-1], total)`` when the tokens go on past it (a tail
    of its own). Together they tile ``range(total)``.

    Raises:
        ValueError: ``cu_seqlens`` not 1-D, not starting at 0, decreasing, or past ``total``.
    """
    cu = cu_seqlens.to("cpu", torch.long)
    if cu.ndim != 1 or cu.numel() < 1 or int(cu[0]) != 0:
        raise ValueError(f"cu_seqlens must be 1-D and start at 0, got {cu.tolist()}")
    if bool((cu[1:] < cu[:-1]).any()) or int(cu[-1]) > total:
        raise ValueError(f"cu_seqlens {cu.tolist()} must be non-decreasing and end at <= {total} tokens")
    c = cu.tolist() + ([total] if int(cu[-1]) < total else [])
    return [(a, b) for a, b in zip(c[:-1], c[1:]) if b > a]


@functools.lru_cache(maxsize=256)
def _causal_mask(n: int, device: str) -> Tensor:
    """``[1, 1, n, n]`` bool, True above the diagonal (masked; Megatron's convention); cached
    per length, as every layer of a micro-batch asks for the same ones."""
    return torch.triu(torch.ones(n, n, dtype=torch.bool, device=device), diagonal=1).view(1, 1, n, n)


class _THDCoreAttentionMixin(_MixinBase):
    """Mixed in before a local ``DotProductAttention`` (sub)class; design notes: ``docs/design/compat.md``.
    Without ``packed_seq_params`` (or with a format other than ``thd``) it is the base class."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        """``query [T, np, hn]``, ``key``/``value [T, ng, hn(v)]`` with ``packed_seq_params``
        (``qkv_format='thd'``); ``attention_mask`` must be None (the mask is built from the
        cu_seqlens). Returns ``[T, 1, np x hn(v)]``.

        Raises:
            ValueError: a dense ``attention_mask`` with packed sequences, 4-D q/k/v, or
                ``cu_seqlens_q`` different from ``cu_seqlens_kv`` (self-attention only)."""
        if packed_seq_params is None or getattr(packed_seq_params, "qkv_format", None) != "thd":
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if attention_mask is not None:
            raise ValueError("packed sequences (thd): attention_mask must be None (the block-diagonal causal "
                             "mask comes from packed_seq_params.cu_seqlens_q)")
        if query.ndim != 3:
            raise ValueError(f"packed sequences (thd): query must be [T, heads, dim], got {tuple(query.shape)}")
        cu_q = packed_seq_params.cu_seqlens_q_padded
        cu_q = packed_seq_params.cu_seqlens_q if cu_q is None else cu_q
        cu_kv = packed_seq_params.cu_seqlens_kv_padded
        cu_kv = packed_seq_params.cu_seqlens_kv if cu_kv is None else cu_kv
        if cu_kv is not None and not torch.equal(cu_q.cpu(), cu_kv.cpu()):
            raise ValueError("packed sequences (thd): cu_seqlens_q and cu_seqlens_kv differ (self-attention only)")
        T = query.shape[0]
        bounds = segment_bounds(cu_q, T)
        outs = []
        for a, b in bounds:  # one causal attention per sequence: no FLOPs across sequences
            outs.append(super().forward(query[a:b].unsqueeze(1), key[a:b].unsqueeze(1), value[a:b].unsqueeze(1),
                                        _causal_mask(b - a, str(query.device)), attn_mask_type, attention_bias, None))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


def thd_core_attention(base: type) -> type:
    """The THD variant of a local core-attention class ``base`` (``DotProductAttention`` or a
    subclass such as ``MLADotProductAttention``); cached, so one class per base."""
    return mixed_core_attention(_THDCoreAttentionMixin, base, "THD")


def thd_layer_spec(spec: LayerSpec) -> tuple[LayerSpec, int]:
    """A copy of the layer spec (or decoder block spec) ``spec`` in which every
    ``core_attention`` that is a local ``DotProductAttention`` (sub)class (bare or in a
    ``ModuleSpec``) is its THD variant; returns ``(copy, number replaced)``. The given spec is
    not changed. Only for CUDA-less runs with ``trainer.sequence_packing`` = thd."""
    return swap_core_attention(spec, _THDCoreAttentionMixin, "THD")
