"""The Megatron model as Hugging Face tensors: one exporter for the weight sync (any world
size), the converter and the checks.

Data path: this rank's model chunks -> Megatron-Core's ``sharded_state_dict`` metadata (the
primary shard of every 1-process tensor this rank holds; :func:`sharding.local_pieces`) ->
the family's mapping table (Megatron name -> HF names, split rule) -> one of

- :meth:`HFExporter.shards` + :meth:`HFExporter.convert`: this rank's shards and the split
  rule, for a plan every rank computes from all ranks' metadata (the streamed sync reads
  them through :mod:`moe_async.weight_sync.stream_export`'s ``ShardSource`` protocol);
- :meth:`HFExporter.hf_tensors`: full HF tensors on global rank 0 (converter, checksums);
- :meth:`HFExporter.whole_export`: at world size 1, the zero-copy plan whose HF tensors are
  views of the parameters (:class:`moe_async.weight_sync.relayout.WholeTensorExport`).

Errors: KeyError naming a Megatron tensor the mapping does not know; ValueError if shards do
not tile a tensor; :mod:`moe_async.trainer.finite` errors on non-finite weights
(:meth:`HFExporter.check`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable, Iterator, Sequence

import torch

from moe_async.models.family import HfConfig, ModelFamily
from moe_async.models.mapping import Rule

if TYPE_CHECKING:
    from moe_async.megatron.sharding import Piece
    from moe_async.weight_sync.relayout import WholeTensorExport

Tensor = torch.Tensor


class HFExporter:
    """HF view of one rank's Megatron model chunks.

    Args:
        models: this rank's model chunks (``vp_stage`` order; not DDP-wrapped is not needed:
            ``sharded_state_dict`` of a DDP wrapper is the module's).
        family: the model family (:mod:`moe_async.models`): ``arch_args``, ``table``,
            ``megatron_to_hf``.
        hf_config: the HF config dict.
        vocab_size: HF vocab rows (Megatron pads the vocab tensors beyond them; padded rows
            are never exported).
        version: ``() -> int``, the weight version named by a non-finite refusal.
    """

    def __init__(self, models: Sequence[torch.nn.Module], family: ModelFamily, hf_config: HfConfig, vocab_size: int,
                 version: Callable[[], int] = lambda: 0):
        from moe_async.megatron.sharding import VOCAB_PARAMS

        self.models = list(models)
        self.family, self.hf_config, self.vocab_size = family, hf_config, vocab_size
        self._version = version
        self._args = family.arch_args(hf_config)
        self._table = family.table(self._args)
        #: every 1-process Megatron name the mapping needs (a missing one: KeyError in the plan)
        self.expected: frozenset[str] = frozenset(self._table.by_megatron)
        #: ``{name: HF rows}`` of the vocab tensors (rows beyond are Megatron's padding)
        self.vocab: dict[str, int] = {n: vocab_size for n in VOCAB_PARAMS}
        self._shards: tuple[tuple, list] | None = None

    # ---- the mapping ---------------------------------------------------------------------
    def rule(self, name: str) -> tuple[Rule, tuple[str, ...]]:
        """``(mapping rule, HF names)`` of the 1-process Megatron tensor ``name``; KeyError if
        the family's table does not know it."""
        from moe_async.models.family import local_spec_name

        k = local_spec_name(name)
        if k not in self._table.by_megatron:
            raise KeyError(f"Megatron -> HF conversion: unknown/unused Megatron tensor {name!r}")
        return self._table.by_megatron[k]

    def convert(self, name: str, t: Tensor) -> list[tuple[str, Tensor]]:
        """``[(hf_name, hf_tensor), ...]`` of the full 1-process tensor ``t`` (views where the
        rule is a rename or a row split; works on ``meta`` tensors)."""
        r, hs = self.rule(name)
        return list(zip(hs, r.split(t, self._args)))

    def direct(self, name: str) -> bool:
        """True when ``name``'s HF parts, concatenated along dim 0 in order, are the tensor
        itself (a rename, or gate;up rows of a SwiGLU ``linear_fc1``)."""
        from moe_async.models.mapping import _identity_out, split_rows_2

        return self.rule(name)[0].split in (_identity_out, split_rows_2)

    # ---- this rank's shards --------------------------------------------------------------
    def check(self) -> None:
        """Refuse non-finite weights (nothing NaN/inf reaches an engine or a file)."""
        from moe_async.trainer.finite import check_weights_finite

        check_weights_finite(self.models, self._version())

    def shards(self) -> list[Piece]:
        """This rank's primary shards (:class:`moe_async.megatron.sharding.Piece`: ``name``,
        ``full_shape``, ``offset``, ``data`` a detached view of the parameter), in chunk then
        parameter order. Read from Megatron's ``sharded_state_dict`` (ms per parameter) once
        and kept while every parameter keeps its storage, shape and dtype."""
        return [pc for pc in self._pieces() if pc.primary]

    def replica_shards(self) -> list[Piece]:
        """This rank's non-primary shards (data-parallel replicas of other ranks' primary
        shards, e.g. the dense tensors of DP rank 1), as :meth:`shards`: equal to their primary
        after each optimizer step, so any replica may send one (several senders spread the
        sending over them)."""
        return [pc for pc in self._pieces() if not pc.primary]

    def _pieces(self) -> list[Piece]:
        from moe_async.compat import cpu_device_scope
        from moe_async.megatron.sharding import local_pieces

        key = tuple((n, p.data_ptr(), tuple(p.shape), p.dtype) for m in self.models for n, p in m.named_parameters())
        if self._shards is None or self._shards[0] != key:
            with cpu_device_scope():  # Megatron's sharded_state_dict
                # detached: a view that autograd made (e.g. under no_grad) would be refused once
                # the optimizer has written its base in place; a detached view shares the
                # storage, so it reads each sync's weights
                pieces = [replace(pc, data=pc.data.detach()) for pc in local_pieces(self.models)]
            self._shards = (key, pieces)
        return self._shards[1]

    # ---- full tensors (rank 0) -----------------------------------------------------------
    def hf_tensors(self) -> Iterator[tuple[str, Tensor]]:
        """``(hf_name, tensor)`` of the whole model on global rank 0, full 1-process tensors
        gathered point-to-point from every rank's primary shards
        (:func:`moe_async.megatron.export.full_hf_state`; views at world size 1), vocab
        padding dropped, then split/renamed by the family's table. Collective at world size
        > 1: every rank exhausts it; the other ranks yield nothing. The tensors may be views
        of the parameters: copy before the next optimizer step."""
        import torch.distributed as dist

        from moe_async.megatron.export import full_hf_state
        from moe_async.megatron.sharding import gather_full_state

        full = (full_hf_state(self.models[0], self.vocab_size) if len(self.models) == 1
                else gather_full_state(self.models, self.vocab_size, dst=0))
        if dist.is_initialized() and dist.get_rank() != 0:
            for _ in full:  # take part in the gather
                pass
            return
        yield from self.family.megatron_to_hf(full, self.hf_config)

    def whole_export(self) -> WholeTensorExport | None:
        """At world size 1 with one model chunk holding every tensor whole: the zero-copy
        plan (:class:`moe_async.weight_sync.relayout.WholeTensorExport`) of this model, else
        None (the gather path names any difference)."""
        import torch.distributed as dist

        from moe_async.compat import cpu_device_scope
        from moe_async.models.family import local_spec_name
        from moe_async.weight_sync.relayout import WholeTensorExport

        if dist.is_initialized() and dist.get_world_size() > 1:
            return None
        with cpu_device_scope():  # Megatron's sharded_state_dict
            whole = whole_tensors(self.models, self.vocab_size)
        if whole is None or {local_spec_name(n) for n in whole} != set(self.expected):
            return None
        return WholeTensorExport(whole, self.convert)


def whole_tensors(models: Sequence[torch.nn.Module], vocab_size: int) -> dict[str, tuple[Tensor, int | None]] | None:
    """``{1-process Megatron name: (parameter or buffer, vocab rows or None)}`` when this
    rank holds every tensor of the model whole (one model chunk, each name's shards all from
    one local tensor of the full shape: TP = PP = EP = 1, one process); None otherwise.
    Vocab tensors (:data:`~moe_async.megatron.sharding.VOCAB_PARAMS`) may hold Megatron's
    padded rows after the ``vocab_size`` HF rows."""
    from moe_async.megatron.sharding import VOCAB_PARAMS, local_pieces

    if len(models) != 1:
        return None
    m = models[0]
    tensors: dict[str, torch.Tensor] = dict(m.named_parameters())
    tensors.update({n: b for n, b in m.named_buffers() if n.endswith(".router.expert_bias")})
    by_name: dict[str, list] = {}
    for pc in local_pieces(m):
        by_name.setdefault(pc.name, []).append(pc)
    out: dict[str, tuple[Tensor, int | None]] = {}
    for name, pcs in by_name.items():
        if len({pc.param for pc in pcs}) != 1 or not all(pc.primary for pc in pcs):
            return None
        p = tensors[pcs[0].param]
        if tuple(p.shape) != pcs[0].full_shape or sum(pc.data.numel() for pc in pcs) != p.numel():
            return None
        out[name] = (p, vocab_size if name in VOCAB_PARAMS else None)
    return out
