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

from moe_async.models.checksum import tensor_checksum


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
    "glm4_moe": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
    "deepseek_v3": ExpertNaming("mlp", "gate_proj", "up_proj", "down_proj"),
}

# Buffers a checkpoint holds and weight sync updates like parameters: the sigmoid router's
# expert bias (deepseek_v3, glm4_moe; transformers keeps it fp32 whatever the model dtype).
_SYNCED_BUFFERS = (".e_score_correction_bias",)

_GATE_UP = ".experts.gate_up_proj"
_DOWN = ".experts.down_proj"


@dataclass(frozen=True)
class _Slot:
    param_name: str
    index: tuple  # index into the parameter: () whole, (e,) one expert, (e, slice) rows
    shape: tuple[int, ...]


class HFWeightMap:
    """Every HF on-disk tensor name of ``model`` mapped to a view of its parameters (and of
    the buffers in ``_SYNCED_BUFFERS``)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model
        model_type = getattr(model.config, "model_type", "")
        # parameters, then the buffers a checkpoint holds that weight sync updates (the router's
        # e_score_correction_bias of deepseek_v3 and glm4_moe: the trainer syncs it like a weight)
        self._params: dict[str, torch.Tensor] = dict(model.named_parameters())
        self._params.update({n: b for n, b in model.named_buffers() if n.endswith(_SYNCED_BUFFERS)})
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


class ParamArena:
    """Two flat copies of the model's parameters (live and standby), swapped by pointer.

    Layout: every parameter of ``weight_map.model`` (``named_parameters`` order) laid end to
    end in one ``uint8`` buffer, each at an offset aligned to its element size (a padding
    gap only where alignment needs one). An HF on-disk name is a contiguous byte span of it
    (a fused expert's gate rows, up rows and down matrix included), listed in arena order by
    :meth:`names` — the order a sender should use so that a bucket of consecutive names is
    one span and can be received straight into the standby buffer (no unflatten copy).

    Update protocol (the embedded engine's ``/update_weights_from_distributed``):
      * :meth:`bind` (once; scheduler thread): the live parameters become views of buffer A;
      * each bucket is written into the standby buffer B (:meth:`span` for a received span,
        :meth:`standby` for one tensor) and its names marked with :meth:`mark`;
      * :meth:`fill_stale` (any thread): names not written in this update whose standby
        bytes are stale (:attr:`dirty`: after a swap, the names the swapped update carried)
        are copied live -> standby, so a partial update keeps the current values of the rest
        at the cost of what changed since, not of the model;
      * :meth:`swap` (scheduler thread, between two forward passes): every parameter's
        ``.data`` now points into B; A becomes the standby. No tensor is copied here, and no
        forward pass ever reads B while it is being written (atomic apply).
    :meth:`discard` forgets a half-received update (B's bytes are then unused).

    Memory: two copies of the parameters (``nbytes`` each), on the parameters' device (the
    engine's: CPU or one CUDA device).
    """

    def __init__(self, weight_map: HFWeightMap):
        self.map = weight_map
        self.params = weight_map._params
        off = 0
        self.param_off: dict[str, int] = {}
        for pname, p in self.params.items():
            es = p.element_size()
            off = -(-off // es) * es
            self.param_off[pname] = off
            off += p.numel() * es
        self.nbytes = off
        # disk name -> (byte offset, byte length) in the arena
        self.slot: dict[str, tuple[int, int]] = {}
        for name, s in weight_map._slots.items():
            p = self.params[s.param_name]
            v = p.data[s.index]
            if not v.is_contiguous():  # pragma: no cover - every slot of a contiguous param is
                raise ValueError(f"{name!r} is not a contiguous slice of {s.param_name}")
            start = (v.data_ptr() - p.data.data_ptr()) if v.numel() else 0
            self.slot[name] = (self.param_off[s.param_name] + start, v.numel() * v.element_size())
        self._order = sorted(self.slot, key=lambda n: self.slot[n][0])
        self.bufs: list[torch.Tensor] | None = None  # [live, standby]
        self.fresh: set[str] = set()  # written into standby by the update under way
        self.dirty: set[str] = set(self.slot)  # standby bytes not known equal to live (all until filled)

    @property
    def bound(self) -> bool:
        return self.bufs is not None

    def _pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``(live, standby)``; RuntimeError before :meth:`bind`."""
        if self.bufs is None:
            raise RuntimeError("the weight arena is not bound yet (bind() allocates it)")
        return self.bufs[0], self.bufs[1]

    def names(self) -> list[str]:
        """HF on-disk names in arena order."""
        return list(self._order)

    def layout(self) -> dict[str, list]:
        """``{"names", "shapes", "dtypes"}`` in arena order (``GET /weights_layout``)."""
        dts = [self.params[self.map._slots[n].param_name].dtype for n in self._order]
        return {"names": self.names(), "shapes": [list(self.map.shape(n)) for n in self._order],
                "dtypes": [str(d).removeprefix("torch.") for d in dts]}

    def _param_view(self, buf: torch.Tensor, pname: str) -> torch.Tensor:
        p = self.params[pname]
        off = self.param_off[pname]
        return buf[off: off + p.numel() * p.element_size()].view(p.dtype).view(p.shape)

    @torch.no_grad()
    def bind(self) -> None:
        """Copy the parameters into buffer A and point them at it (scheduler thread only)."""
        if self.bufs is not None:
            return
        dev = next(iter(self.params.values())).device
        a = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        b = torch.empty(self.nbytes, dtype=torch.uint8, device=dev)
        for pname, p in self.params.items():
            v = self._param_view(a, pname)
            v.copy_(p.data)
            p.data = v
        self.bufs = [a, b]

    def standby(self, name: str) -> torch.Tensor:
        """The standby tensor behind on-disk ``name`` (its dtype and shape)."""
        s = self.map._slots[name]
        return self._param_view(self._pair()[1], s.param_name)[s.index]

    def span(self, names: list[str], shapes: list, dtypes: list[torch.dtype]) -> torch.Tensor | None:
        """The standby ``uint8`` span holding ``names`` end to end, or None when they are not
        consecutive in the arena (then the caller receives elsewhere and copies).
        Names and shapes must already be checked."""
        if not names or self.bufs is None:
            return None
        standby = self.bufs[1]
        off, _ = self.slot[names[0]]
        start = end = off
        for n, s, d in zip(names, shapes, dtypes):
            o, nb = self.slot[n]
            p = self.params[self.map._slots[n].param_name]
            if o != end or d != p.dtype:
                return None
            end = o + nb
        return standby[start:end]

    def mark(self, names) -> None:
        self.fresh.update(names)

    def discard(self) -> None:
        self.dirty |= self.fresh  # their standby bytes hold the dropped update
        self.fresh.clear()

    @torch.no_grad()
    def fill_stale(self) -> int:
        """Copy live -> standby every name not written in this update whose standby bytes
        differ from the live ones (:attr:`dirty`); returns how many. Right after a swap the
        standby differs only at the names that update carried, so an update applied call by
        call (every call versioned) copies each call's bytes once more, never the model."""
        live, standby = self._pair()
        todo = self.dirty - self.fresh
        for name in todo:
            o, nb = self.slot[name]
            standby[o: o + nb].copy_(live[o: o + nb])
        self.dirty -= todo
        return len(todo)

    def live_written(self, names) -> None:
        """``names`` were written into the live parameters directly (a disk update): their
        standby bytes are stale now."""
        self.dirty.update(names)

    @torch.no_grad()
    def commit(self, names) -> int:
        """Copy the standby bytes of ``names`` (just received) into the live buffer and unmark
        them: an update applied at once (SGLang's semantics for a call outside an atomic
        update), costing the bytes of ``names`` only, never a copy of the whole model.
        Scheduler thread only (between two forward passes). Returns the bytes copied."""
        live, standby = self._pair()
        n = 0
        for name in names:
            o, nb = self.slot[name]
            live[o: o + nb].copy_(standby[o: o + nb])
            n += nb
        self.fresh.difference_update(names)
        self.dirty.difference_update(names)  # equal on both sides now
        return n

    def swap(self) -> None:
        """Point every parameter at the standby buffer; it becomes live (scheduler thread)."""
        live, standby = self._pair()
        for pname, p in self.params.items():
            p.data = self._param_view(standby, pname)
        self.bufs = [standby, live]
        self.dirty = set(self.fresh)  # the new standby (the old live) differs exactly there
        self.fresh.clear()
