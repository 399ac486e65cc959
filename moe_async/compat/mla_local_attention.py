"""Local (non-TE) core attention for Megatron-Core's MLA (not a patch: a module the
deepseek_v3 family puts into its layer spec).

Megatron's local ``DotProductAttention`` accepts neither ``k_channels`` nor ``v_channels``, so
MLA's local spec cannot be built without TE; this subclass takes both and sizes the output
``[sq, b, heads/TP * v_channels]``, with DotProductAttention's math and MLA's softmax scale.

Design notes: ``docs/design/compat.md``."""

from __future__ import annotations

from typing import Optional

from megatron.core.transformer.dot_product_attention import DotProductAttention
from megatron.core.utils import divide


class MLADotProductAttention(DotProductAttention):
    """``DotProductAttention`` that accepts MLA's ``k_channels`` / ``v_channels``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: Optional[float] = None,
        softmax_scale: Optional[float] = None,
        k_channels: Optional[int] = None,
        v_channels: Optional[int] = None,
        cp_comm_type: Optional[str] = None,
        pg_collection=None,
    ):
        super().__init__(
            config=config,
            layer_number=layer_number,
            attn_mask_type=attn_mask_type,
            attention_type=attention_type,
            attention_dropout=attention_dropout,
            softmax_scale=softmax_scale,
            cp_comm_type=cp_comm_type,
            pg_collection=pg_collection,
        )
        if softmax_scale is None and k_channels is not None:
            import math

            self.softmax_scale = 1.0 / math.sqrt(k_channels)
            if self.config.apply_query_key_layer_scaling:
                self.softmax_scale /= self.layer_number
        if v_channels is not None:
            tp = self.pg_collection.tp.size()
            self.hidden_size_per_partition = divide(v_channels * self.config.num_attention_heads, tp)
            self.hidden_size_per_attention_head = v_channels


def mend_mla_without_te() -> bool:
    """Mend megatron/core/transformer/multi_latent_attention.py (0.16.1) when Transformer
    Engine is absent: its ``from megatron.core.extensions.transformer_engine import TELinear``
    does NOT raise without TE (that module subclasses a ``MagicMock`` stand-in), so the file
    sets ``HAVE_TE = True`` and ``MultiLatentAttention.__init__`` then calls
    ``isinstance(self.linear_proj, TELinear)`` with a mock -> ``TypeError: isinstance() arg 2
    must be a type``. Setting the module's ``HAVE_TE = False`` (what its ``except ImportError``
    branch would have set) skips that fp8/fp4-only check. Applied only when ``TELinear`` is not
    a class (i.e. TE is absent); idempotent. Returns True when the mend is active.

    Test: tests/models/test_deepseek_v3_mapping.py::test_mla_local_attention_mend."""
    import megatron.core.transformer.multi_latent_attention as mla

    if isinstance(mla.TELinear, type):
        return False  # real Transformer Engine: nothing to mend
    mla.HAVE_TE = False
    return True


def local_mla_submodules(sub) -> None:
    """Make the local (non-TE) MLA spec of Megatron-Core 0.16.1 buildable and exact under TP,
    in place on one layer's ``MLASelfAttentionSubmodules`` ``sub``:

    * ``core_attention`` -> :class:`MLADotProductAttention` (design notes: ``docs/design/compat.md``);
    * ``linear_q_down_proj`` / ``linear_kv_down_proj`` -> duplicated (not TP-split) Linears,
      what the TE spec uses (``TELinear`` with ``parallel_mode="duplicated"``). Answers
      megatron/core/models/gpt/gpt_layer_specs.py (``get_gpt_layer_local_spec`` builds them as
      ``ColumnParallelLinear``) with megatron/core/transformer/multi_latent_attention.py
      (``get_query_key_value_tensors``): on that branch ``kv_combined`` is gathered over TP
      and ``k_pos_emb`` (the rope key, shared by all heads) is split off the gathered tensor,
      so its gradient, which each TP rank computes from its own heads only, is never summed
      over TP (the gather's backward only takes this rank's slice). At TP2+SP the grad norm
      was 1.9% off the 1-process value. The Linear chosen here is the module MLA itself
      accepts (``multi_latent_attention.Linear``); it marks its weight ``sequence_parallel``
      under SP, so finalize_model_grads sums its partial (per sequence shard) gradient over TP,
      and ``k_pos_emb`` is gathered with ``gather_from_sequence_parallel_region``, whose
      backward reduce-scatters (sums) the heads' contributions.

    Not a patch of Megatron code: a choice among the submodules MLA supports, for the local
    spec only (the TE spec already uses duplicated ``TELinear``).

    Test: tests/models/test_family_layouts.py (deepseek_v3 at TP2+SP, TP2+EP2, TP2+PP2+EP2 equal
    the 1-process loss/grad norm; ``ds3cpl-tp2pp1ep1`` builds the down projections as
    ``ColumnParallelLinear`` again and must still differ, i.e. fails once Megatron fixes the
    k_pos_emb gradient and this part of the mend is no longer needed).

    Raises RuntimeError when ``multi_latent_attention.Linear`` is unavailable."""
    import megatron.core.transformer.multi_latent_attention as mla

    if mla.Linear is None:
        raise RuntimeError(
            "megatron.core.transformer.multi_latent_attention.Linear is None (modelopt layers not importable):"
            " the local MLA spec needs it for the duplicated q/kv down projections"
        )
    sub.core_attention = MLADotProductAttention
    sub.linear_q_down_proj = mla.Linear
    sub.linear_kv_down_proj = mla.Linear
