"""Hugging Face on-disk names <-> the in-memory parameters of a transformers model.

transformers 5 keeps MoE experts fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
gate rows first then up rows; ``mlp.experts.down_proj [E, H, I]``), while checkpoints and
the trainer's weight sync use the per-expert on-disk names (Mixtral:
``block_sparse_moe.experts.{e}.w1/w3/w2.weight``, ``block_sparse_moe.gate.weight``).
:class:`HFWeightMap` resolves every on-disk name to a *view* of the fused parameter, so an
update writes straight into the slice it names and checksums hash exactly the slice.

Families are chosen by the HF ``model_type`` through an exact-key registry.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moe_async.engines.checksum import tensor_checksum


@dataclass(frozen=True)
class ExpertNaming:
    """On-disk naming of one MoE family's expert block."""

    block: str  # module name of the MoE block on disk ("block_sparse_moe" | "mlp")
    gate: str  # per-expert gate projection ("w1" | "gate_proj")
    up: str  # per-expert up projection ("w3" | "up_proj")
    down: str  # per-expert down projection ("w2" | "down_proj")


EXPERT_NAMING: dict[str, ExpertNaming] = {
    "mixtral": ExpertNaming("block_sparse_moe", "w1", "w3", "w2"),
    "qwen2_moe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
    "qwen3_moe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
    "olmoe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
}

_GATE_UP = ".experts.gate_up_proj"
_DOWN = ".experts.down_proj"


@dataclass(frozen=True)
class _Slot:
    param_name: str
    index: tuple  # index into the parameter: () whole, (e,) one expert, (e, slice) rows
    shape: tuple[int, ...]


class HFWeightMap:
    """Every HF on-disk tensor name of ``model`` mapped to a view of its parameters."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        model_type = getattr(model.config, "model_type", "")
        self._params = dict(model.named_parameters())
        self._slots: dict[str, _Slot] = {}
        naming = EXPERT_NAMING.get(model_type)
        for pname, p in self._params.items():
            if pname.endswith(_GATE_UP) or pname.endswith(_DOWN):
                if naming is None:
                    raise ValueError(
                        f"model_type {model_type!r} has fused experts ({pname}) but no entry in "
                        f"EXPERT_NAMING; add its on-disk naming"
                    )
                self._add_experts(pname, p, naming)
            elif naming is not None and pname.endswith(".mlp.gate.weight"):
                disk = pname[: -len(".mlp.gate.weight")] + f".{naming.block}.gate.weight"
                self._slots[disk] = _Slot(pname, (), tuple(p.shape))
            else:
                self._slots[pname] = _Slot(pname, (), tuple(p.shape))

    def _add_experts(self, pname: str, p: torch.Tensor, naming: ExpertNaming) -> None:
        fused = _GATE_UP if pname.endswith(_GATE_UP) else _DOWN
        mlp_prefix = pname[: -len(fused)]  # "model.layers.0.mlp"
        disk_prefix = mlp_prefix.rsplit(".", 1)[0] + "." + naming.block + ".experts"
        num_experts = p.shape[0]
        for e in range(num_experts):
            if fused == _GATE_UP:
                inter = p.shape[1] // 2
                shape = (inter, p.shape[2])
                self._slots[f"{disk_prefix}.{e}.{naming.gate}.weight"] = _Slot(
                    pname, (e, slice(0, inter)), shape
                )
                self._slots[f"{disk_prefix}.{e}.{naming.up}.weight"] = _Slot(
                    pname, (e, slice(inter, 2 * inter)), shape
                )
            else:
                self._slots[f"{disk_prefix}.{e}.{naming.down}.weight"] = _Slot(
                    pname, (e,), tuple(p.shape[1:])
                )

    # ---- queries ----
    def names(self) -> list[str]:
        return list(self._slots)

    def __contains__(self, name: str) -> bool:
        return name in self._slots

    def shape(self, name: str) -> tuple[int, ...]:
        return self._slots[name].shape

    def view(self, name: str) -> torch.Tensor:
        """The live parameter slice behind on-disk ``name`` (writes go into the model)."""
        slot = self._slots[name]
        return self._params[slot.param_name].data[slot.index]

    def check(self, name: str, shape: list[int] | tuple[int, ...]) -> None:
        """Raise ``KeyError``/``ValueError`` naming ``name`` if unknown or mis-shaped."""
        if name not in self._slots:
            raise KeyError(f"unknown weight name {name!r} (not a tensor of this model)")
        if tuple(shape) != self._slots[name].shape:
            raise ValueError(
                f"shape mismatch for {name!r}: got {list(shape)}, model has {list(self._slots[name].shape)}"
            )

    # ---- mutation ----
    @torch.no_grad()
    def apply(self, staged: dict[str, torch.Tensor]) -> None:
        """Copy every staged tensor into its slice (call only between forward passes)."""
        for name, t in staged.items():
            self.view(name).copy_(t)

    def checksums(self) -> dict[str, str]:
        return {n: tensor_checksum(self.view(n)) for n in self._slots}
