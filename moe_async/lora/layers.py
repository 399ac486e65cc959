"""LoRA adapters on Megatron-Core linear layers (ColumnParallelLinear / RowParallelLinear and
the local experts of a ``SequentialMLP``), attached by forward hook so the base module, its
parameter names and its checkpoint entries stay as they are. One adapted linear (``x`` its
input, ``W`` its frozen weight): ``y = W x + scaling * B (A dropout(x))``, scaling = alpha / rank.

Tensor parallelism, as Megatron-Bridge's LoRA shards it:

- ColumnParallelLinear (``W`` split on out): ``A [r, in]`` whole on every TP rank, ``B [out/TP, r]``
  split on out like ``W``. With sequence parallelism ``x`` is ``[s/TP, b, in]``: ``x A^T`` is
  all-gathered over the sequence (backward: reduce-scatter) and ``A``'s gradient, partial per
  rank, is summed over TP by ``finalize_model_grads`` (the ``sequence_parallel`` attribute).
- RowParallelLinear (``W`` split on in): ``A [r, in/TP]`` split on in, ``B [out, r]`` whole;
  ``x A^T`` partial sums are reduced (reduce-scattered with sequence parallelism) over TP.

Expert adapters live on the expert's EP rank, reduced over expert-DP (``allreduce=False``).
Design notes: ``docs/lora.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeAlias

import torch

from moe_async.lora.config import LoraConfig

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear
    from megatron.core.tensor_parallel.layers import RowParallelLinear
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.experts import SequentialMLP

Tensor = torch.Tensor

# Megatron submodule name (the part after ``decoder.layers.{i}.``) -> the PEFT names it covers
_MEGATRON_TARGETS = {
    "self_attention.linear_qkv": ("q_proj", "k_proj", "v_proj"),
    "self_attention.linear_proj": ("o_proj",),
    "linear_fc1": ("gate_proj", "up_proj"),
    "linear_fc2": ("down_proj",),
}
ADAPTER_ATTR = "lora"  # the child module name of an adapted linear (parameters ``...lora.A`` / ``...lora.B``)


#: A Megatron-Core tensor-parallel linear (``ColumnParallelLinear`` / ``RowParallelLinear``).
ParallelLinear: TypeAlias = "ColumnParallelLinear | RowParallelLinear"

class LoraAdapter(torch.nn.Module):
    """``A [r, in_local]`` and ``B [out_local, r]`` of one linear; :meth:`delta` maps the linear's
    input to the update of its (TP-local) output. ``kind`` is ``"column"`` or ``"row"``; ``tp_group``
    the linear's TP group (None or size 1: no communication); ``sequence_parallel`` its flag."""

    def __init__(self, kind: str, in_local: int, out_local: int, cfg: LoraConfig, dtype: torch.dtype,
                 tp_group: ProcessGroup | None = None, sequence_parallel: bool = False, seed_offset: int = 0) -> None:
        super().__init__()
        self.kind, self.tp_group, self.sp = kind, tp_group, sequence_parallel
        self.tp = tp_group.size() if tp_group is not None else 1
        self.scaling = cfg.scaling
        self.dropout = torch.nn.Dropout(cfg.dropout) if cfg.dropout > 0 else torch.nn.Identity()
        self.A = torch.nn.Parameter(torch.empty(cfg.rank, in_local, dtype=dtype))
        self.B = torch.nn.Parameter(torch.zeros(out_local, cfg.rank, dtype=dtype))
        # PEFT's default init of A: kaiming_uniform_(a=sqrt(5)) on the whole [r, in] (bound
        # 1/sqrt(in)), drawn whole and sliced, so every TP size starts from the same A
        split = kind == "row" and self.tp > 1
        full_in = in_local * (self.tp if split else 1)
        bound = 1.0 / math.sqrt(full_in)
        g = torch.Generator().manual_seed(seed_offset)
        full = torch.empty(cfg.rank, full_in).uniform_(-bound, bound, generator=g)
        if split and tp_group is not None:  # split: tp > 1, so a group
            r = tp_group.rank()
            full = full[:, r * in_local:(r + 1) * in_local]
        with torch.no_grad():
            self.A.copy_(full)
        if self.tp > 1:
            from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

            sharded, whole = (self.B, self.A) if kind == "column" else (self.A, self.B)
            # the TP-split factor: counted once per TP rank by the grad norm, resharded by checkpoints
            set_tensor_model_parallel_attributes(sharded, True, 0 if kind == "column" else 1, 1)
            if self.sp:
                whole.sequence_parallel = True  # type: ignore[attr-defined]  # summed over TP by finalize_model_grads

    def delta(self, x: Tensor) -> Tensor:
        """``x [..., in_local]`` (the linear's input) -> ``[..., out_local]`` (its output's update)."""
        from megatron.core.tensor_parallel import mappings as mp

        xa = self.dropout(x).to(self.A.dtype) @ self.A.t()  # [..., r]
        if self.tp > 1:
            if self.kind == "column":
                xa = (mp.gather_from_sequence_parallel_region(xa, tensor_parallel_output_grad=True, group=self.tp_group)
                      if self.sp else mp.copy_to_tensor_model_parallel_region(xa, group=self.tp_group))
            else:
                xa = (mp.reduce_scatter_to_sequence_parallel_region(xa, group=self.tp_group)
                      if self.sp else mp.reduce_from_tensor_model_parallel_region(xa, group=self.tp_group))
        return (xa @ self.B.t()) * self.scaling


def _hook(module: ParallelLinear, args: tuple[Tensor, ...], output: tuple[Tensor, Tensor | None]
          ) -> tuple[Tensor, Tensor | None]:
    adapter = module._lora_adapter
    out, bias = output
    d = adapter.delta(args[0])
    return (out + d.to(out.dtype)), bias


@dataclass(frozen=True)
class AdaptedLinear:
    """One adapted linear: its Megatron weight name (chunk-local), its PEFT names, the adapter,
    and whether it is a routed expert's (``expert``: its local index, else None)."""

    weight_name: str
    peft_names: tuple[str, ...]
    adapter: LoraAdapter
    expert: int | None


def _attach(linear: ParallelLinear, adapter: LoraAdapter, register: bool = True) -> None:
    if register:
        setattr(linear, ADAPTER_ATTR, adapter)
    else:  # a shared adapter: registered once, hooked on every expert
        object.__setattr__(linear, "_lora_shared", adapter)
    object.__setattr__(linear, "_lora_adapter", adapter)
    linear.register_forward_hook(_hook)


def _kind(linear: ParallelLinear) -> str:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    if isinstance(linear, ColumnParallelLinear):
        return "column"
    if isinstance(linear, RowParallelLinear):
        return "row"
    raise TypeError(f"LoRA: {type(linear).__name__} is not a Megatron ColumnParallelLinear/RowParallelLinear "
                     "(trainer.lora runs on the local layer spec's linears)")


def _new_adapter(linear: ParallelLinear, cfg: LoraConfig, seed: int) -> LoraAdapter:
    kind = _kind(linear)
    out_local, in_local = linear.weight.shape
    tp_group = getattr(linear, "tp_group", None)
    return LoraAdapter(kind, in_local, out_local, cfg, linear.weight.dtype, tp_group,
                       bool(getattr(linear, "sequence_parallel", False)), seed)


def add_lora(model: GPTModel, cfg: LoraConfig, *, layer_offset: int = 0) -> list[AdaptedLinear]:
    """Attach adapters to one ``GPTModel`` chunk per ``cfg`` and freeze every other parameter.

    ``layer_offset``: the global index of the chunk's first layer (A's init is seeded per global
    layer, so every layout starts from the same A). Returns the adapted linears in module order.

    The settings the adapters cannot run with (dropout or ETP > 1 with routed-expert adapters, a
    ``shared`` expert adapter at EP > 1, the grouped expert MLP) are refused by the trainer config
    (:func:`moe_async.trainer.config.lora_refusal`) before any process starts, not here.

    Raises:
        TypeError: an adapted module that is not a Megatron parallel linear, or routed experts that
            are not the sequential expert MLP (a model built past the config's checks).
    """
    from megatron.core.transformer.moe.experts import SequentialMLP

    for p in model.parameters():
        p.requires_grad_(False)
    wanted = set(cfg.target_modules)
    out: list[AdaptedLinear] = []
    layers = model.decoder.layers
    for li, layer in enumerate(layers):
        gl = getattr(layer, "layer_number", li + 1 + layer_offset) - 1
        prefix = f"decoder.layers.{li}."
        for name, mod in list(layer.named_modules()):
            sub = name.split(".")
            last = sub[-1]
            key = "self_attention." + last if sub[0] == "self_attention" else last
            peft = _MEGATRON_TARGETS.get(key)
            if peft is None or not (set(peft) <= wanted) or ".experts." in f".{name}.":
                continue
            a = _new_adapter(mod, cfg, seed=_seed(gl, name))
            _attach(mod, a)
            out.append(AdaptedLinear(prefix + name + ".weight", peft, a, None))
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is None or cfg.experts == "off":
            continue
        if not isinstance(experts, SequentialMLP):
            raise TypeError(f"LoRA adapts the sequential expert MLP; routed experts are {type(experts).__name__}")
        shared: dict[str, LoraAdapter] = {}
        for e, expert in enumerate(experts.local_experts):
            for fc in ("linear_fc1", "linear_fc2"):
                peft = _MEGATRON_TARGETS[fc]
                if not set(peft) <= wanted:
                    continue
                lin = getattr(expert, fc)
                if cfg.experts == "shared":
                    if fc not in shared:
                        shared[fc] = _new_adapter(lin, cfg, seed=_seed(gl, f"mlp.experts.shared.{fc}"))
                        setattr(experts, f"lora_{fc}", shared[fc])
                    a = shared[fc]
                    _attach(lin, a, register=False)
                else:
                    a = _new_adapter(lin, cfg, seed=_seed(gl, f"mlp.experts.{_global_expert(experts, e)}.{fc}"))
                    _attach(lin, a)
                for p in a.parameters():
                    p.allreduce = False  # type: ignore[attr-defined]  # reduced over expert-DP, like expert weights
                wn = f"{prefix}mlp.experts.local_experts.{e}.{fc}.weight"
                out.append(AdaptedLinear(wn, peft, a, _global_expert(experts, e)))
    return out


def _seed(layer: int, name: str) -> int:
    """A's init seed from the global layer and the module's layout-free name (every TP/EP/PP
    layout draws the same A for the same module)."""
    import zlib

    return zlib.crc32(f"{layer}.{name}".encode())


def _global_expert(experts: SequentialMLP, local: int) -> int:
    """Global expert index of local expert ``local`` (Megatron's contiguous EP split)."""
    from megatron.core import parallel_state as ps

    n_local = len(experts.local_experts)
    return ps.get_expert_model_parallel_rank() * n_local + local


def adapter_parameters(model: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """``(name, parameter)`` of the adapters in ``model`` (names end ``lora.A``/``lora.B`` or
    ``lora_linear_fc1.A`` ...)."""
    return [(n, p) for n, p in model.named_parameters() if is_adapter_param(n)]


def is_adapter_param(name: str) -> bool:
    """True for an adapter parameter name (skipped by base-weight export and checksums)."""
    return f".{ADAPTER_ATTR}." in name or ".lora_linear_fc" in name
