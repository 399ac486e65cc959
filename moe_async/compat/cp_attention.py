"""Context-parallel (CP) core attention for Megatron-Core's local layer spec, CPU only.

Megatron's local ``DotProductAttention`` asserts ``context_parallel_size == 1`` and TE's CP
attention needs CUDA; this runs the local attention's math over the CP group (each rank's two
load-balanced sequence chunks, keys and values all-gathered), equal to 1 process.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import torch

from moe_async.compat.attention_spec import mixed_core_attention, swap_core_attention, LayerSpec
from moe_async.layout import cp_positions

if TYPE_CHECKING:  # the checker sees the mixin over the class it is mixed into
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.packed_seq_params import PackedSeqParams
    from torch.distributed import ProcessGroup
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.dot_product_attention import DotProductAttention as _MixinBase
else:
    _MixinBase = object

Tensor = torch.Tensor


def cp_chunk_positions(seq_len: int, cp_size: int, cp_rank: int) -> Tensor:
    """Global positions held by CP rank ``cp_rank`` (chunk ``cp_rank`` then chunk
    ``2 x cp_size - 1 - cp_rank``): :func:`moe_async.layout.cp_positions`."""
    return cp_positions(seq_len, cp_size, cp_rank)


class _GatherSequenceOverCP(torch.autograd.Function):
    """``x [s_local, ...]`` (this rank's two chunks, dim 0) -> ``[s_local x CP, ...]`` in global
    sequence order. Backward: the gradient summed over the CP group (all_reduce: gloo has no
    reduce_scatter), this rank's rows."""

    @staticmethod
    def forward(ctx, x: Tensor, group: ProcessGroup | None) -> Tensor:
        import torch.distributed as dist

        cp, r = dist.get_world_size(group), dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(cp)]
        dist.all_gather(parts, x.contiguous(), group=group)
        S = x.shape[0] * cp
        order = torch.cat([cp_chunk_positions(S, cp, j) for j in range(cp)])  # gathered row -> global pos
        out = torch.empty((S, *x.shape[1:]), dtype=x.dtype, device=x.device)
        out[order.to(x.device)] = torch.cat(parts)
        ctx.group, ctx.mine = group, cp_chunk_positions(S, cp, r).to(x.device)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        import torch.distributed as dist

        g = g.contiguous().clone()
        dist.all_reduce(g, group=ctx.group)
        return g[ctx.mine], None


def gather_sequence_over_cp(x: Tensor, group: ProcessGroup | None) -> Tensor:
    """Autograd all-gather of ``x [s_local, ...]`` over the CP ``group`` into global sequence
    order ``[s_local x CP, ...]`` (see :func:`cp_chunk_positions`)."""
    return _GatherSequenceOverCP.apply(x, group)


class _CPCoreAttentionMixin(_MixinBase):
    """Mixed in before a local ``DotProductAttention`` (sub)class; design notes: ``docs/design/compat.md``."""

    def __init__(self, config: TransformerConfig, *args: object, **kwargs: object) -> None:
        if getattr(config, "window_size", None) is not None:
            raise NotImplementedError(
                "sliding-window attention with trainer.context_parallel_size > 1 on the local (CPU) spec: "
                "the CP core attention builds a plain causal mask")
        one = copy.copy(config)
        one.context_parallel_size = 1  # DotProductAttention.__init__ asserts it; nothing else reads it there
        super().__init__(one, *args, **kwargs)
        self.config = config
        from megatron.core import parallel_state as ps

        self.cp_group = getattr(self.pg_collection, "cp", None) or ps.get_context_parallel_group()

    def forward(self, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                attn_mask_type: AttnMaskType | None = None, attention_bias: Tensor | None = None,
                packed_seq_params: PackedSeqParams | None = None) -> Tensor:
        """``query [sq, b, np, hn]``, ``key``/``value [sq, b, ng, hn(v)]``: this CP rank's two
        chunks. ``attention_mask`` is ignored (the causal mask of the global positions is
        built here; the trainer passes None under CP, as for TE's CP attention)."""
        import torch.distributed as dist

        cp, r = dist.get_world_size(self.cp_group), dist.get_rank(self.cp_group)
        if cp == 1:
            return super().forward(query, key, value, attention_mask, attn_mask_type, attention_bias,
                                   packed_seq_params)
        if packed_seq_params is not None:
            raise NotImplementedError("packed sequences with context parallelism on the local (CPU) spec")
        sq, b = query.shape[0], query.shape[1]
        # one collective for K and V (their head dims may differ: MLA): [sq, b, nk*hk + nv*hv]
        nk = key.shape[2] * key.shape[3]
        kv = gather_sequence_over_cp(torch.cat([key.reshape(sq, b, -1), value.reshape(sq, b, -1)], dim=-1),
                                     self.cp_group)
        S = kv.shape[0]
        key = kv[..., :nk].reshape(S, b, *key.shape[2:]).contiguous()
        value = kv[..., nk:].reshape(S, b, *value.shape[2:]).contiguous()
        q_pos = cp_chunk_positions(S, cp, r).to(query.device)
        mask = torch.arange(S, device=query.device).unsqueeze(0) > q_pos.unsqueeze(1)  # True = masked
        return super().forward(query, key, value, mask.view(1, 1, sq, S), attn_mask_type, attention_bias,
                               packed_seq_params)


def cp_core_attention(base: type) -> type:
    """The CP variant of a local core-attention class ``base`` (``DotProductAttention`` or a
    subclass such as ``MLADotProductAttention``); cached, so one class per base."""
    return mixed_core_attention(_CPCoreAttentionMixin, base, "CP")


def cp_layer_spec(spec: LayerSpec) -> tuple[LayerSpec, int]:
    """A copy of the layer spec (or decoder block spec) ``spec`` in which every
    ``core_attention`` that is a local ``DotProductAttention`` (sub)class (bare or in a
    ``ModuleSpec``) is its CP variant; returns ``(copy, number replaced)``. The given spec is
    not changed. Only for CUDA-less runs with ``context_parallel_size > 1``."""
    return swap_core_attention(spec, _CPCoreAttentionMixin, "CP")
