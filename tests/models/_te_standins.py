"""Stand-ins for the Transformer Engine modules of Megatron-Core 0.16.1's TE layer spec, so that
a ``GPTModel`` shaped as ``get_gpt_layer_with_transformer_engine_spec`` /
``get_gpt_decoder_block_spec(use_transformer_engine=True)`` build it exists on a machine
without TE, and its ``sharded_state_dict()`` (Megatron-Core's own) has the keys a TE model has.

Each stand-in is Megatron's local module of the same role plus TE's extra state
(``get_extra_state``: an empty ``uint8`` tensor, TE 2.x ``TransformerEngineBaseModule`` without
FP8; ``set_extra_state`` records what it got) and the sharded state dict of its TE
counterpart in megatron/core/extensions/transformer_engine.py:

* ``TELayerNormColumnParallelLinear`` -> ColumnParallelLinear + ``layer_norm_weight``;
  ``TEColumnParallelLinear`` / ``TERowParallelLinear``: Megatron's Column/RowParallelLinear
  (whose sharded_state_dict is TE's: ``make_sharded_tensors_for_checkpoint`` of the module's
  state dict with weight/bias split over TP, ``_extra_state`` as a ShardedObject);
* ``TELinear`` (duplicated: MLA's down projections): a replicated weight;
* ``TENorm``: an RMSNorm without ``sharded_state_dict`` (TE's norm has none: Megatron's
  generic ``sharded_state_dict_default`` path), with TE's extra state;
* ``TEDotProductAttention``: no parameters; its sharded state dict is empty, as Megatron's
  is for ``softmax_type="vanilla"``, and a missing ``_extra_state`` is dropped on load as TE does.

:func:`te_spec_model` installs them as the spec provider (Megatron's ``BackendSpecProvider``
extension point, named ``TESpecProvider`` in gpt_layer_specs) and builds the model.
"""

from __future__ import annotations

from typing import Any

import torch
from megatron.core.dist_checkpointing.mapping import ShardedStateDict
from megatron.core.models.backends import BackendSpecProvider
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.mlp import MLPSubmodules
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.moe.experts import SequentialMLP
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

EXTRA_STATE_LOADED: list = []  # every set_extra_state call's value, in order


class _TEExtraState:
    def get_extra_state(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        EXTRA_STATE_LOADED.append(state)


def _drop(kw: dict, *names: str) -> dict:
    return {k: v for k, v in kw.items() if k not in names}


class StandInTEColumnParallelLinear(_TEExtraState, ColumnParallelLinear):
    def __init__(self, input_size, output_size, *, config, init_method, gather_output=False, bias=True,
                 skip_bias_add=False, is_expert=False, skip_weight_param_allocation=False,
                 tp_comm_buffer_name=None, tp_group=None, **_):
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         gather_output=gather_output, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         skip_weight_param_allocation=skip_weight_param_allocation, tp_group=tp_group)


class StandInTELayerNormColumnParallelLinear(StandInTEColumnParallelLinear):
    def __init__(self, input_size, output_size, *, config, **kw):
        super().__init__(input_size, output_size, config=config, **kw)
        self.layer_norm_weight = torch.nn.Parameter(torch.ones(input_size, dtype=config.params_dtype))


class StandInTERowParallelLinear(_TEExtraState, RowParallelLinear):
    def __init__(self, input_size, output_size, *, config, init_method, bias=True, input_is_parallel=True,
                 skip_bias_add=False, is_expert=False, tp_comm_buffer_name=None, tp_group=None, **_):
        super().__init__(input_size, output_size, config=config, init_method=init_method, bias=bias,
                         input_is_parallel=input_is_parallel, skip_bias_add=skip_bias_add, is_expert=is_expert,
                         tp_group=tp_group)


class StandInTELinear(_TEExtraState, MegatronModule):
    """Duplicated (``parallel_mode=None``) TELinear: the weight replicated over TP."""

    def __init__(self, input_size, output_size, *, config, parallel_mode=None, bias=False, **_):
        super().__init__(config=config)
        assert parallel_mode in (None, "duplicated") and not bias, (parallel_mode, bias)
        self.weight = torch.nn.Parameter(torch.empty(output_size, input_size, dtype=config.params_dtype))

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> ShardedStateDict:
        return make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, None,
                                                   sharded_offsets)


class StandInTENorm(_TEExtraState, torch.nn.Module):
    """TE's RMSNorm as ``TENorm`` builds it: no ``sharded_state_dict`` of its own."""

    def __init__(self, config, hidden_size, eps=1e-5, **_):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))


class StandInTEDotProductAttention(_TEExtraState, MegatronModule):
    """No parameters; like TE's DotProductAttention, a load that lacks its ``_extra_state`` is
    not an error (TE registers a load_state_dict post hook dropping that missing key)."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, **_):
        super().__init__(config=config)

        def drop_missing_extra_state(module, incompatible_keys):
            for key in [k for k in incompatible_keys.missing_keys if k.endswith("core_attention._extra_state")]:
                incompatible_keys.missing_keys.remove(key)

        self.register_load_state_dict_post_hook(drop_missing_extra_state)

    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None) -> ShardedStateDict:
        return make_sharded_tensors_for_checkpoint({}, prefix, {"softmax_offset": 0}, sharded_offsets)


class StandInTESpecProvider(BackendSpecProvider):
    """Megatron's ``TESpecProvider`` with the stand-ins (moe_grouped_gemm off: SequentialMLP)."""

    def linear(self) -> type:
        return StandInTELinear

    def column_parallel_linear(self) -> type:
        return StandInTEColumnParallelLinear

    def row_parallel_linear(self) -> type:
        return StandInTERowParallelLinear

    def fuse_layernorm_and_linear(self) -> bool:
        return True

    def column_parallel_layer_norm_linear(self) -> type:
        return StandInTELayerNormColumnParallelLinear

    def layer_norm(self, rms_norm: bool = False, for_qk: bool = False) -> type:
        return StandInTENorm

    def core_attention(self) -> type:
        return StandInTEDotProductAttention

    def grouped_mlp_modules(self, moe_use_grouped_gemm: bool, moe_use_legacy_grouped_gemm: bool):
        assert not moe_use_grouped_gemm
        return SequentialMLP, MLPSubmodules(linear_fc1=StandInTEColumnParallelLinear,
                                            linear_fc2=StandInTERowParallelLinear)

    def activation_func(self):
        """TE's is ``TEActivationOp`` (no parameters, used only with ``use_te_activation_func``)."""
        return None


def te_spec_model(hf_config: dict, padded_vocab: int):
    """A 1-process ``GPTModel`` of ``hf_config`` built from the family's TE layer spec with the
    stand-ins (Megatron parallel state initialised by the caller; CPU compat applied). Installs the
    stand-ins where Megatron looks the TE classes up: ``TESpecProvider`` / ``TENorm`` of
    gpt_layer_specs, ``LayerNormImpl`` of transformer_block, ``TELinear`` of
    multi_latent_attention (test process only)."""
    import megatron.core.models.gpt.gpt_layer_specs as specs
    import megatron.core.transformer.transformer_block as tb
    from megatron.core.models.gpt import GPTModel

    from moe_async.compat.mla_local_attention import mend_mla_without_te
    from moe_async.models import get_family

    import megatron.core.transformer.multi_latent_attention as mla

    specs.TESpecProvider = StandInTESpecProvider
    mla.TELinear = StandInTELinear  # MLA picks the down projections' kwargs by this class
    specs.TENorm = StandInTENorm
    tb.LayerNormImpl = StandInTENorm
    mend_mla_without_te()
    fam = get_family(hf_config["model_type"])
    tf = fam.transformer_config(hf_config)
    spec = fam.layer_spec(hf_config, use_te=True)
    kw = fam.gpt_model_kwargs(hf_config)
    kw["vocab_size"] = padded_vocab
    return GPTModel(config=tf, transformer_layer_spec=spec, pre_process=True, post_process=True,
                    parallel_output=False, **kw)
