"""The adapters' part of a torch_dist checkpoint: a LoRA trainer saves and loads its adapters
(and, through them, the optimizer state) only; the frozen base is read from the HF checkpoint.

Megatron's parallel linears build their sharded entries from their whole ``state_dict``, so an
adapter's ``lora.A`` / ``lora.B`` come out as TP-replicated entries; the TP-split factor (a
column linear's ``B``, a row linear's ``A``) is re-sharded here along its split axis (a gated
``linear_fc1``'s ``B``, ``[gate_r; up_r]`` per rank, as Megatron's swiglu factory shards the
weight), so that torch_dist writes every TP rank's piece and reshards on load. Adapters that
Megatron's modules leave out of their sharded state dict (the ``shared`` routed-expert adapter
registered on the expert MLP) are added as replicated entries under their global layer.
``moe_async_state.json`` records the base (:func:`lora_record`); a resume onto another base or
another adapter shape is refused (:func:`check_lora_resume`).
"""

from __future__ import annotations

import re
from typing import Any, Callable

import torch

from moe_async.lora.config import LoraConfig
from moe_async.lora.layers import is_adapter_param
from moe_async.types import JsonDict

Tensor = torch.Tensor


def adapter_sharded_state_dict(sd: dict[str, Any], model: torch.nn.Module) -> dict[str, Any]:
    """The adapter entries of ``sd`` (one model chunk's ``sharded_state_dict()``, keyed by the
    chunk's local state-dict names), TP-split factors re-sharded, missing adapters added.

    Raises:
        ValueError: an adapter entry that is not a plain ShardedTensor, or an adapter outside
            the decoder layers.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.utils import make_sharded_tensor_for_checkpoint

    out: dict[str, Any] = {}
    for k, sh in sd.items():
        if not is_adapter_param(k):
            continue
        if not isinstance(sh, ShardedTensor):
            raise ValueError(f"LoRA checkpoint: {k} is a {type(sh).__name__}, not a ShardedTensor")
        out[k] = _tp_sharded(sh, k)
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    for name, p in model.named_parameters():
        if is_adapter_param(name) and name not in out:
            m = re.match(r"decoder\.layers\.(\d+)\.(.*)$", name)
            if m is None:
                raise ValueError(f"LoRA checkpoint: adapter {name} is outside the decoder layers")
            gl = layers[int(m.group(1))].layer_number - 1
            out[name] = make_sharded_tensor_for_checkpoint(p, f"decoder.layers.{gl}.{m.group(2)}")
    return out


def _tp_sharded(sh: Any, key: str) -> Any:
    """``sh`` re-sharded along its tensor's TP split axis (its ``partition_dim``) when the tensor
    is TP-split (Megatron's ``tensor_model_parallel`` attribute), else ``sh``."""
    t = sh.data
    if not getattr(t, "tensor_model_parallel", False):
        return sh
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    replica = (sh.replica_id[0], 0, sh.replica_id[2]) if isinstance(sh.replica_id, tuple) else sh.replica_id
    n = sh.prepend_axis_num  # the stacked-layer (and expert) axes Megatron put in front
    lead = tuple((i, sh.global_offset[i], sh.axis_fragmentations[i]) for i in range(n))
    new = ShardedTensor.from_rank_offsets(sh.key, t, *lead, (n + t.partition_dim, rank, tp), replica_id=replica,
                                          prepend_axis_num=n)
    if key.endswith("linear_fc1.lora.B"):  # gated [gate_r; up_r] per rank: the weight's swiglu sharding
        return apply_swiglu_sharded_factory(new, lead)
    return new


# the trainer.lora fields a resume must keep (the adapters' shapes and their scaling)
_KEPT = ("rank", "alpha", "target_modules", "experts")


def lora_record(cfg: LoraConfig, base: str, base_digest: str) -> JsonDict:
    """The ``lora`` entry of ``moe_async_state.json``: the base the adapters were trained on
    (``base``: its HF directory; ``base_digest``: sha256 over its per-tensor checksums) and the
    ``trainer.lora`` fields a resume must keep."""
    return {"base": base, "base_digest": base_digest, **{k: getattr(cfg, k) for k in _KEPT}}


def check_lora_fields(path: str, saved: JsonDict | None, cfg: LoraConfig | None) -> None:
    """Refuse a resume whose ``trainer.lora`` disagrees with the checkpoint's adapters, from the
    checkpoint's ``moe_async_state.json`` alone (the driver calls it before any process starts).
    ``saved``: the checkpoint's ``lora`` record (None: saved without ``trainer.lora``); ``cfg``:
    the configured ``trainer.lora``.

    Raises:
        UserInputError (a ValueError): a LoRA checkpoint into a trainer without ``trainer.lora``
            or the reverse, or a differing ``rank`` / ``alpha`` / ``target_modules`` /
            ``experts`` (named, both values)."""
    from moe_async.errors import UserInputError

    if saved is None and cfg is None:
        return
    if cfg is None:
        assert saved is not None
        raise UserInputError(f"checkpoint {path} holds LoRA adapters only (trainer.lora.rank={saved.get('rank')}, "
                             f"base {saved.get('base')}); set trainer.lora as it was saved to resume it")
    if saved is None:
        raise UserInputError(f"checkpoint {path} was saved without trainer.lora (a full model checkpoint); "
                             "a LoRA trainer resumes only from its own adapter checkpoints (the base comes from "
                             "the model section: model.source, model.hf_path)")
    for k in _KEPT:
        if saved.get(k) != getattr(cfg, k):
            raise UserInputError(f"checkpoint {path}: its adapters have trainer.lora.{k}={saved.get(k)!r}, this "
                                 f"trainer trainer.lora.{k}={getattr(cfg, k)!r}; resume with the saved value")


def check_lora_resume(path: str, saved: JsonDict | None, cfg: LoraConfig | None, base: str,
                      base_digest: Callable[[], str]) -> None:
    """Refuse, before any state changes, a resume that would put adapters on another base or
    into another adapter shape: :func:`check_lora_fields`, then (both with LoRA) the base's
    digest. ``base_digest()``: this trainer's base digest (called only when both have LoRA).

    Raises:
        UserInputError (a ValueError): as :func:`check_lora_fields`, or another base (both
            bases and digests named).
    """
    from moe_async.errors import UserInputError

    check_lora_fields(path, saved, cfg)
    if saved is None or cfg is None:
        return
    now = base_digest()
    if saved.get("base_digest") != now:
        raise UserInputError(f"checkpoint {path}: its LoRA adapters were trained on base {saved.get('base')} "
                             f"(weights digest {str(saved.get('base_digest'))[:12]}), this trainer's base is {base} "
                             f"(weights digest {now[:12]}); resume on the same base model")
