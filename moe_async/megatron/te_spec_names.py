"""torch_dist key names of the Transformer Engine layer spec, whatever spec the model runs.

Maps the local spec's key names to the TE spec's (and back) for the norms TE fuses into the
following linear, so a checkpoint written on a CPU loads under TE and vice versa; also lists
the ``_extra_state`` keys a TE-spec model expects.

Design notes: ``docs/design/megatron.md``."""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Iterable

if TYPE_CHECKING:
    from megatron.core.dist_checkpointing.mapping import ShardedStateDict

_PREFIX = re.compile(r"^((?:.*\.)?decoder\.layers\.(?:\d+\.)?)(.+)$")

# (local name, TE name) per layer kind; suffixes after the layer prefix
_GQA_MOE = (("mlp.linear_fc1.layer_norm_weight", "pre_mlp_layernorm.weight"),
            ("mlp.linear_fc1.layer_norm_bias", "pre_mlp_layernorm.bias"))
_MLA = (("self_attention.q_layernorm.weight", "self_attention.linear_q_up_proj.layer_norm_weight"),
        ("self_attention.q_layernorm.bias", "self_attention.linear_q_up_proj.layer_norm_bias"),
        ("self_attention.kv_layernorm.weight", "self_attention.linear_kv_up_proj.layer_norm_weight"),
        ("self_attention.kv_layernorm.bias", "self_attention.linear_kv_up_proj.layer_norm_bias"))
_MLA_DENSE = (("pre_mlp_layernorm.weight", "mlp.linear_fc1.layer_norm_weight"),
              ("pre_mlp_layernorm.bias", "mlp.linear_fc1.layer_norm_bias"))
_MOE_MARK = "mlp.router.weight"
_MLA_MARK = "self_attention.linear_kv_down_proj.weight"


def layer_kinds(keys: Iterable[str]) -> dict[str, tuple[bool, bool]]:
    """``{layer prefix: (is_moe, is_mla)}`` of the layers named in ``keys`` (torch_dist keys
    of either spec)."""
    rests: dict[str, set[str]] = {}
    for k in keys:
        m = _PREFIX.match(k)
        if m:
            rests.setdefault(m.group(1), set()).add(m.group(2))
    return {p: (_MOE_MARK in r, _MLA_MARK in r) for p, r in rests.items()}


def _pairs(kind: tuple[bool, bool]) -> tuple[tuple[str, str], ...]:
    moe, mla = kind
    if mla:
        return _MLA + (() if moe else _MLA_DENSE)
    return _GQA_MOE if moe else ()


def te_name(key: str, kinds: dict[str, tuple[bool, bool]]) -> str:
    """The TE-spec name of the torch_dist key ``key`` (either spec's; a TE name is returned
    as is). ``kinds``: :func:`layer_kinds` of the whole state dict."""
    m = _PREFIX.match(key)
    if not m or m.group(1) not in kinds:
        return key
    for local, te in _pairs(kinds[m.group(1)]):
        if m.group(2) == local:
            return m.group(1) + te
    return key


def local_name(key: str, kinds: dict[str, tuple[bool, bool]]) -> str:
    """The local-spec name (as Megatron-Core's local spec writes it, and as this project's
    checkpoints had it before the TE names) of the torch_dist key ``key``."""
    m = _PREFIX.match(key)
    if not m or m.group(1) not in kinds:
        return key
    for local, te in _pairs(kinds[m.group(1)]):
        if m.group(2) == te:
            return m.group(1) + local
    return key


def _sharded_items(sd: ShardedStateDict) -> list:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory

    return [v for v in nested_values(sd) if isinstance(v, (ShardedTensor, ShardedTensorFactory))]


def to_te_names(sharded_state_dict: ShardedStateDict) -> dict[str, str]:
    """Rename, in place, the ``ShardedTensor`` / ``ShardedTensorFactory`` keys of a model's
    sharded state dict (one chunk's, or ``{"model0": ..., ...}``) to the TE spec's. Returns
    ``{TE key: key before}`` of the renamed ones."""
    items = _sharded_items(sharded_state_dict)
    kinds = layer_kinds(t.key for t in items)
    renamed: dict[str, str] = {}
    for t in items:
        new = te_name(t.key, kinds)
        if new != t.key:
            renamed[new] = t.key
            t.key = new
    return renamed


def match_checkpoint(sharded_state_dict: ShardedStateDict, checkpoint_keys: Iterable[str]) -> dict[str, str]:
    """Rename, in place, the keys of a model's sharded state dict to the names a checkpoint
    holds: TE names (:func:`to_te_names`), and where the checkpoint lacks a TE name but has
    the local spec's, that one. ``checkpoint_keys``: the checkpoint's tensor keys (its DCP
    metadata's ``state_dict_metadata``). Keys the checkpoint has under neither name are left
    at the TE name (the load then names them as missing). Returns ``{key now: spec name}``
    of the keys that now carry the local spec's name."""
    have = set(checkpoint_keys)
    items = _sharded_items(sharded_state_dict)
    kinds = layer_kinds(t.key for t in items)
    old: dict[str, str] = {}
    for t in items:
        te = te_name(t.key, kinds)
        loc = local_name(te, kinds)
        t.key = loc if te not in have and loc in have else te
        if t.key != te:
            old[t.key] = te
    return old


def is_te_extra_state(key: str) -> bool:
    """True for a torch_dist key of a module's ``_extra_state`` object (``..._extra_state`` or
    ``..._extra_state/shard_<i>_<n>``): TE's FP8 metadata, no weights."""
    return re.search(r"(^|\.)_extra_state(/shard_[\d_.]+)?$", key) is not None


# TE-named suffixes (after the layer prefix) of the modules that carry ``_extra_state`` under the
# TE spec, by a tensor every such module has (``weight``; LN-fused linears also ``layer_norm_weight``)
_EXTRA_STATE_MODULES = (
    "self_attention.linear_qkv", "self_attention.linear_proj", "self_attention.linear_q_proj",
    "self_attention.linear_q_down_proj", "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
    "self_attention.linear_kv_up_proj", "self_attention.q_layernorm", "self_attention.k_layernorm",
    "input_layernorm", "pre_mlp_layernorm", "mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1",
    "mlp.shared_experts.linear_fc2", "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2",
)
_FINAL_NORM = re.compile(r"^((?:.*\.)?decoder\.)final_layernorm\.weight$")


def _extra_state_module(key: str) -> str | None:
    """The module (TE-named torch_dist prefix) whose ``_extra_state`` the TE spec writes beside
    the tensor ``key`` (a TE-named key), or None."""
    if _FINAL_NORM.match(key):
        return key[: -len(".weight")]
    m = _PREFIX.match(key)
    if not m:
        return None
    rest = m.group(2)
    for mod in _EXTRA_STATE_MODULES:
        if rest.startswith(mod + ".") and "." not in rest[len(mod) + 1:]:
            return m.group(1) + mod
    return None


def add_te_extra_state(sharded_state_dict: ShardedStateDict) -> list[str]:
    """Add, in place, the ``_extra_state`` ``ShardedObject`` of every module that carries one
    under the TE spec (``docs/design/megatron.md``) to a model's sharded state dict whose keys are TE
    names (:func:`to_te_names` first; one chunk's dict or ``{"model0": ..., ...}``). Each is
    built as Megatron-Core's ``make_sharded_object_for_checkpoint`` builds it: global shape /
    offset = the prepended (layer, expert) axes of a ``ShardedTensor`` of the same layer (of
    the same expert for routed experts), or ``(1,)`` / ``(0,)`` without; replica id ``(0, TP
    rank, DP rank of that tensor)`` (expert TP rank for routed experts); value an empty
    ``uint8`` tensor (TE's non-FP8 extra state). Keys the state dict already holds as objects
    (a model built with the TE spec) are left as they are. Returns the added keys."""
    import torch
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    added: list[str] = []
    for chunk in _chunks(sharded_state_dict):
        have = {v.key for v in chunk.values() if isinstance(v, ShardedObject)}
        wanted: dict[tuple[str, str], str] = {}  # (unit, object key) -> dict key
        axes: dict[str, ShardedTensor] = {}  # unit -> a ShardedTensor of it
        for dict_key, t in chunk.items():
            if not isinstance(t, (ShardedTensor, ShardedTensorFactory)):
                continue
            unit = _unit(dict_key)
            if isinstance(t, ShardedTensor):
                axes.setdefault(unit, t)
            mod = _extra_state_module(t.key)
            if mod and f"{mod}._extra_state" not in have:
                wanted.setdefault((unit, f"{mod}._extra_state"), f"{unit}te_extra_state:{mod}")
        for (unit, key), dict_key in wanted.items():
            t = axes[unit]
            n = t.prepend_axis_num
            shape, offset = (tuple(t.global_shape[:n]), tuple(t.global_offset[:n])) if n else ((1,), (0,))
            tp = ps.get_expert_tensor_parallel_rank() if ".mlp.experts." in key else ps.get_tensor_model_parallel_rank()
            chunk[dict_key] = ShardedObject(key, torch.empty(0, dtype=torch.uint8), shape, offset, (0, tp, t.replica_id[2]))
            added.append(key)
    return added


def _unit(dict_key: str) -> str:
    """The state-dict key prefix a tensor shares with the other tensors of its layer (``...
    layers.<i>.``), of its routed expert (``...local_experts.<e>.``), or ``""`` outside layers."""
    m = re.match(r"^(.*?layers\.\d+\.(?:.*?local_experts\.\d+\.)?)", dict_key)
    return m.group(1) if m else ""


def _chunks(sd: ShardedStateDict) -> list[dict]:
    """The model chunk dicts of a sharded state dict: ``sd`` itself, or its dict values
    (``{"model": ...}`` / ``{"model0": ..., "model1": ...}``)."""
    if any(isinstance(v, dict) for v in sd.values()):
        return [v for v in sd.values() if isinstance(v, dict)]
    return [sd]
