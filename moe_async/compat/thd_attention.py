"""Packed-sequence (THD) core attention for Megatron-Core's LOCAL layer spec, used only when
CUDA is absent (the CPU/gloo path) and ``trainer.sequence_packing`` resolves to ``thd``. Not
used with Transformer Engine: on GPU the TE spec's ``TEDotProductAttention`` runs TE's own THD
attention (cu_seqlens kernels) and nothing here is imported.

Answers megatron/core/transformer/dot_product_attention.py (0.16.1): the local
``DotProductAttention.forward`` asserts ``packed_seq_params is None`` ("Packed sequence is not
supported by DotProductAttention. Please use TEDotProductAttention instead."), and TE needs
CUDA, so without this no packed micro-batch runs on a CPU. The same holds for MLA's local core
attention (:class:`moe_async.compat.mla_local_attention.MLADotProductAttention`, a
``DotProductAttention`` subclass).

What reaches the core attention with ``packed_seq_params.qkv_format == 'thd'`` (Megatron's
``Attention.forward`` / ``MultiLatentAttention.get_query_key_value_tensors``): ``query
[T, np, hn]``, ``key``/``value [T, ng, hn(v)]`` (the dummy batch dim squeezed off), RoPE
already applied per sequence (``rope_utils._apply_rotary_pos_emb_thd`` splits ``T`` by
``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) and gives each sequence positions 0..l-1; the
split must cover all ``T`` tokens, so the caller's tail padding belongs to the last sequence
in the padded ``cu_seqlens``). Megatron reshapes the output ``[T, 1, heads x v_channels]``
back to ``[T, 1, h]`` itself.

What it computes: the math of the local ``DotProductAttention`` unchanged (softmax scale, GQA
head grouping, softmax in fp32 when ``attention_softmax_in_fp32``), run once per segment of
``cu_seqlens_q_padded`` (else ``cu_seqlens_q``) as a sequence ``[l, 1, ...]`` of its own under
the causal mask, outputs concatenated back in packed order: the block-diagonal causal
attention TE computes, with no scores across sequences (``sum(l^2)``, not ``T^2``, per head).
Tail padding tokens belong to the last segment after its real tokens, which never see them
(causal). One call per sequence and layer: a correctness path for CPU, not a fused kernel.

Test: tests/compat/test_thd_attention.py (packed outputs and q/k/v gradients equal one causal
attention per sequence, GQA and MLA; a plain ``DotProductAttention`` still refuses
``packed_seq_params``, i.e. the test fails once Megatron's local attention learns THD and this
mend is no longer needed), and the ``th`` layouts of tests/trainer/test_layouts.py (every model
family: THD equals the padded path at 1 process, and 1 process at TP2+SP, EP2, PP2).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch

from moe_async.compat.attention_spec import mixed_core_attention, swap_core_attention

if TYPE_CHECKING:  # the checker sees the mixin over the class it is mixed into
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
    """Mixed in before a local ``DotProductAttention`` (sub)class; see the module docstring.
    Without ``packed_seq_params`` (or with a format other than ``thd``) it is the base class."""

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None):
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


def thd_layer_spec(spec: Any) -> tuple[Any, int]:
    """A copy of the layer spec (or decoder block spec) ``spec`` in which every
    ``core_attention`` that is a local ``DotProductAttention`` (sub)class (bare or in a
    ``ModuleSpec``) is its THD variant; returns ``(copy, number replaced)``. The given spec is
    not changed. Only for CUDA-less runs with ``trainer.sequence_packing`` = thd."""
    return swap_core_attention(spec, _THDCoreAttentionMixin, "THD")
